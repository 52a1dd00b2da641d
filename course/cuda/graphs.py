"""CUDA graphs on emulated GPUs: `torch.cuda.CUDAGraph` and `with torch.cuda.graph(g):` capture work and replay it.

On a GPU, capture records kernels without running them, and `replay()` runs them again on the same memory: static
inputs refilled with `copy_` before a replay feed the recorded kernels, results land in the tensors made during
capture, and in-place updates (an optimizer step) happen once per replay, not at capture. Host work (Python, CPU
tensors) runs at capture only. The emulator does the same one level up, with a dispatch mode on the capturing
thread: each aten op that touches an emulated GPU tensor is recorded; ops that write their arguments (`add_`,
`copy_`, out=, the optimizer's foreach updates) wait for replay; ops that make new tensors run at capture too, so
their results exist with the right shapes and memory, and at replay run again into those same tensors. Views,
in-place views (`t_`) and allocations launch no kernel and are not recorded. Reading a value on the host while
capturing raises CUDA's error. Capture is timed as on a GPU: each recorded op costs the host a launch (stream capture
records the launch instead of running it) and nothing runs on the device (the clock's `recording` threads), so results
made at capture are ready when recorded and no stream is busier after capture. Replay is timed as a GPU runs a graph:
the host pays one graph launch (costs.HOST_GRAPH_LAUNCH_NS) instead of a launch per kernel, and the recorded kernels,
copies and collectives run on the device as captured, each on the stream it was captured on (the capture stream's
work on the stream replay is called on), after their inputs, and the replay stream then waits for all of them, as
work queued after a graph launch waits for the whole graph. `torch.cuda.make_graphed_callables` is PyTorch's own, built on these.

Collectives of an NCCL group are captured too ("Starting with NCCL 2.9, NCCL operations can be captured by CUDA Graphs",
collectives and send/recv alike: NCCL user guide, "Using NCCL with CUDA Graphs",
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/cudagraph.html): the group records the call instead of
running it (nccl.py), so at capture no values move and no link is busy, and each replay runs it again, on the values its
inputs hold then, timed on the links like any collective; a wait on its work while capturing becomes a wait at replay. A
functional collective (`torch.ops._c10d_functional`, DTensor's) is recorded whole like any op that makes a result, so
the group call inside it neither runs nor is recorded at capture (`inside_recorded_op`). Collectives of other groups
raise CUDA's capture error: gloo moves GPU values through the host when called (a host copy and a stream
synchronisation, which a capture refuses), and PyTorch's threaded test group moves them in Python, so neither could run
at replay.
"""
from __future__ import annotations

import threading

import torch
import torch.cuda.graphs
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from course.cuda import devices
from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import CPU, EmulatedTensor
from course.machine import costs

_capturing = threading.local()


def is_current_stream_capturing() -> bool:
    return getattr(_capturing, "graph", None) is not None


def capturing_graph() -> "CUDAGraph | None":
    """The graph this thread is capturing into, if any."""
    return getattr(_capturing, "graph", None)


def replaying() -> bool:
    """Whether this thread is replaying a graph. The ops it runs again passed the device checks at capture, some as
    PyTorch's C++ issued them (a DDP bucket's host scratch beside GPU tensors, which only that C++ may mix): at replay
    they come from here, and keep that right."""
    return getattr(_capturing, "replaying", False)


def inside_recorded_op() -> bool:
    """Whether this thread is running, at capture, an op the graph records whole and runs again at each replay."""
    return getattr(_capturing, "inside_op", False)


def refuse_collective(what: str) -> None:
    """A collective that cannot be captured, issued while capturing: CUDA's error, as the real backend would meet."""
    if is_current_stream_capturing():
        raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({what} inside "
                           "torch.cuda.graph capture; only NCCL collectives can be captured: use the nccl backend)")


def _on_gpu(tree) -> bool:
    return any(isinstance(t, EmulatedTensor) and t._device_index != CPU for t in pytree.tree_leaves(tree))


def _lane(tree) -> tuple[int, int]:
    """(device, current stream) an op on these GPU tensors is queued on."""
    device = next(t._device_index for t in pytree.tree_leaves(tree)
                  if isinstance(t, EmulatedTensor) and t._device_index != CPU)
    return device, devices.active.current_stream_id(device)


def _written(func) -> set[str]:
    """The arguments an op writes: those its schema marks (`Tensor(a!)`), and batch norm's running statistics,
    which its legacy schema does not."""
    declared = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    return declared | _UNDECLARED_WRITES.get(func, set())


_UNDECLARED_WRITES = {torch.ops.aten.native_batch_norm.default: {"running_mean", "running_var"}}


def _aliased_results(func, args, kwargs):
    """What an op that writes its arguments returns without running it: the arguments its results alias (the
    tensor of `x.add_(y)`, the out= tensors), or None for ops that return nothing (`_foreach_add_`)."""
    named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    by_alias = {next(iter(a.alias_info.before_set)): named.get(a.name) for a in func._schema.arguments
                if a.alias_info is not None and a.alias_info.before_set}
    results = [by_alias.get(next(iter(r.alias_info.before_set))) if r.alias_info is not None else None
               for r in func._schema.returns]
    if not results:
        return None
    return results[0] if len(results) == 1 else tuple(results)


def _written_copied(func, args, kwargs) -> tuple[list, dict]:
    """The op's arguments with each one it writes replaced by a copy."""
    written = _written(func)
    names = [a.name for a in func._schema.arguments]
    copy = lambda name, value: pytree.tree_map_only(torch.Tensor, torch.clone, value) if name in written else value
    return ([copy(name, value) for name, value in zip(names, args)],
            {name: copy(name, value) for name, value in kwargs.items()})


class _Capture(TorchDispatchMode):
    """Pushed on the capturing thread between capture_begin and capture_end; see the module docstring."""

    def __init__(self, graph: "CUDAGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _on_gpu((args, kwargs)):
            return func(*args, **kwargs)  # host work runs at capture, and only then
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (reading a GPU value "
                               "on the host, e.g. .item() or print, inside torch.cuda.graph capture)")
        if func.namespace == "c10d":  # a C++ backend's collective on GPU tensors: gloo's
            refuse_collective("a gloo collective copies GPU values to the host and synchronizes")
        if func.is_view or func._overloadpacket in _NO_KERNEL or torch.Tag.inplace_view in func.tags:
            return func(*args, **kwargs)  # no kernel: shapes and allocations are the host's work
        if _written(func):
            if all(r.alias_info is not None for r in func._schema.returns):
                self.graph._ops.append((_lane((args, kwargs)), func, args, kwargs, None))
                clock = devices.active.clock
                clock.host_advance(clock.host_launch_ns)  # recorded, not run: the host pays its launch
                return _aliased_results(func, args, kwargs)
            # writes some arguments and makes new results (batch norm's running statistics): made at capture on
            # copies of what it writes, so the writes themselves wait for replay
            copied_args, copied_kwargs = _written_copied(func, args, kwargs)
            out = func(*copied_args, **copied_kwargs)
            self.graph._ops.append((_lane((args, kwargs)), func, args, kwargs, out))
            return out
        lane = _lane((args, kwargs))
        _capturing.inside_op = True
        try:
            out = func(*args, **kwargs)
        finally:
            _capturing.inside_op = False
        self.graph._ops.append((lane, func, args, kwargs, out))
        return out


_NO_KERNEL = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
              torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten.detach,
              torch.ops.aten.alias, torch.ops.aten._unsafe_view}


class CUDAGraph:
    """`torch.cuda.CUDAGraph`: capture_begin/capture_end around the work, then replay() as often as needed."""

    def __init__(self, keep_graph: bool = False):
        self._ops: list = []  # (device, stream) it was queued on, op, arguments, results made at capture
        self._mode: _Capture | None = None
        self._captured = False
        self._origin: tuple[int, int] | None = None  # the capture stream, whose work replays on replay's stream
        self._side_lanes: set[tuple[int, int]] = set()  # NCCL's streams, which captured collectives run on

    def capture_begin(self, pool=None, capture_error_mode: str = "global", check_input_liveness: bool = False):
        if is_current_stream_capturing():
            raise RuntimeError("CUDA graph capture is already underway on this thread: captures cannot nest")
        emu = devices.active
        self._origin = (emu.current_device(), emu.current_stream_id(emu.current_device()))
        if self._origin[1] == 0:  # CUDAGraph::capture_begin (aten/src/ATen/cuda/CUDAGraph.cpp)
            raise RuntimeError("CUDA graphs must be captured on a non-default stream. (However, after capture, it's "
                               "ok to replay them on the default stream.)")
        self._ops, self._side_lanes, self._captured = [], set(), False
        self._mode = _Capture(self)
        self._mode.__enter__()
        _capturing.graph = self
        emu.clock.recording.add(threading.get_ident())

    def capture_end(self) -> None:
        devices.active.clock.recording.discard(threading.get_ident())
        _capturing.graph = None
        self._mode.__exit__(None, None, None)
        self._mode, self._captured = None, True

    def record_call(self, device: int, run, side_lane: tuple[int, int] | None = None) -> None:
        """Record `run()` to be called at each replay, on `device`'s current stream as now (a collective, or a wait
        on one, issued while capturing); the host pays its launch now. `side_lane` is a stream the call's work runs
        on besides: the graph's end waits for it too, as a graph completes when all its work has."""
        emu = devices.active
        self._ops.append(((device, emu.current_stream_id(device)), run, (), {}, None))
        if side_lane is not None:
            self._side_lanes.add(side_lane)
        emu.clock.host_advance(emu.clock.host_launch_ns)

    def instantiate(self) -> None:
        pass  # nothing to build: replay runs the recorded ops

    def replay(self) -> None:
        """One graph launch on the host; the recorded work queued at once, on the device as captured."""
        if not self._captured:
            raise RuntimeError("CUDAGraph.replay: the graph has not been captured (capture_end was not called)")
        emu = devices.active
        clock = emu.clock
        issued = clock.host_ns + costs.HOST_GRAPH_LAUNCH_NS
        origin_device = self._origin[0]
        replay_lane = (origin_device, emu.current_stream_id(origin_device))
        lanes = {replay_lane, *self._side_lanes}
        _capturing.replaying = True
        try:
            with torch.no_grad():  # a replay runs kernels; autograd recorded what it needed at capture
                for (device, stream), func, args, kwargs, out in self._ops:
                    lane = replay_lane if (device, stream) == self._origin else (device, stream)
                    lanes.add(lane)
                    current = emu.current_stream_id(device)
                    emu.set_current_stream(device, lane[1])
                    clock.issue_at(issued)
                    try:
                        self._run(func, args, kwargs, out)
                    finally:
                        emu.set_current_stream(device, current)
        finally:
            _capturing.replaying = False
        clock.host_ns = issued
        clock.join_lanes(replay_lane, lanes)

    @staticmethod
    def _run(func, args, kwargs, out) -> None:
        """Run a recorded op again; results it makes land in the tensors made at capture, ready when it ends."""
        fresh = func(*args, **kwargs)
        if out is None:
            return
        for static, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(fresh)):
            if isinstance(static, EmulatedTensor) and isinstance(new, EmulatedTensor):
                torch.ops.aten.copy_.default(static._inner, new._inner)
                static._block.ready_ns = max(static._block.ready_ns, new.ready_ns)

    def reset(self) -> None:
        self._ops, self._side_lanes, self._captured = [], set(), False

    def pool(self) -> tuple[int, int]:
        return (0, id(self))

    def enable_debug_mode(self) -> None:
        pass

    def debug_dump(self, debug_path: str) -> None:
        raise not_modelled("CUDAGraph.debug_dump (there is no cudaGraph_t to dump)")


class AcceleratorGraph(CUDAGraph):
    """`torch.accelerator.Graph`, the device-generic graph (torch/accelerator/graphs.py), which on CUDA is a CUDA graph:
    its pool and capture mode are given when it is made, and `with stream, graph:` captures on the current stream."""

    def __init__(self, keep_graph: bool = False, *, pool=None, capture_error_mode: str = "default"):
        super().__init__(keep_graph)
        self.graph_pool, self.capture_error_mode = pool, capture_error_mode

    def capture_begin(self) -> None:
        super().capture_begin(pool=self.graph_pool, capture_error_mode=self.capture_error_mode)

    def __enter__(self) -> None:
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
        self.capture_begin()

    def __exit__(self, *exc_info) -> None:
        self.capture_end()


def graph_pool_handle() -> tuple[int, int]:
    """A token to share one memory pool between captures; the emulator keeps no pools, so any token will do."""
    return (0, 0)


# torch/cuda/graphs.py's own names, which make_graphed_callables and torch.cuda.graph look up in their module.
PATCHES = [(torch.cuda.graphs, {"CUDAGraph": CUDAGraph, "graph_pool_handle": graph_pool_handle,
                                "is_current_stream_capturing": is_current_stream_capturing}),
           (torch.accelerator, {"Graph": AcceleratorGraph})]
