"""`init_process_group("nccl")` on emulated GPUs: real numbers through gloo, time from the NCCL cost model.

A CPU build of PyTorch has no NCCL, yet almost every multi-GPU program names it (or lets torchrun pick
it). While an emulator is active, "nccl" builds an `EmulatedNCCL` group: each collective or send/recv
moves the real values through a gloo group underneath (ranks may be threads or processes), and is
charged to the simulated clock on a communication stream of the rank's GPU, as NCCL runs its kernels
on a stream of its own. All ranks agree on when a collective starts (the latest rank to be ready), so
the timeline is the same in every run.
"""
from __future__ import annotations

import datetime
import functools
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel

from course.cuda import (cuda_api, dcp_staging, dtensor_random, fsdp1, fsdp2, functional_collectives, graphs,
                         nccl_checks)
from course.cuda.devices import CPU, EmulatedTensor, current_emulator
from course.cuda.kernels import host_scratch_ready, mark_host_scratch
from course.machine import costs

_TIME = torch.int64


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


def _by_count(tensor):
    """NCCL's all-gather and reduce-scatter into one tensor go by element count, gloo by the first dimension
    (SyncBatchNorm gathers into a 1 x n tensor): give gloo flat views of the same memory."""
    return _unwrap(tensor).view(-1)


def _unwrap(value):
    """The CPU tensors gloo moves: an EmulatedTensor's inner tensor shares its storage, so in-place works."""
    if isinstance(value, EmulatedTensor):
        return value._inner
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    return value


def _premul_sum(opts, tensors, in_place: bool):
    """NCCL's PREMUL_SUM (FSDP's gradient divide factor, `dist._make_nccl_premul_sum`): every rank's input times
    a factor, then summed. gloo has no such op, so the inputs are scaled here (in their own dtype, as NCCL casts
    the factor) and gloo sums them; `in_place=False` scales copies, leaving the caller's inputs as NCCL does."""
    if opts.reduceOp.op != dist.ReduceOp.PREMUL_SUM:
        return tensors
    factor = _unwrap(opts.reduceOp.factor)
    opts.reduceOp = dist.ReduceOp.SUM
    scale = (lambda t: t.mul_(torch.as_tensor(factor, dtype=t.dtype, device="cpu"))) if in_place else \
        (lambda t: t * torch.as_tensor(factor, dtype=t.dtype, device="cpu"))
    return _map(scale, tensors)


def _map(fn, value):
    if isinstance(value, torch.Tensor):
        return fn(value)
    return type(value)(_map(fn, v) for v in value)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _same_sizes(tensors) -> bool:
    return all(t.shape == tensors[0].shape for t in tensors)


def _needs_values(name: str, tensors) -> None:
    """gloo moves the values underneath, and a shape-only tensor has none (gloo would fail with "Bad address")."""
    if any(t.is_meta or (isinstance(t, EmulatedTensor) and t._inner.is_meta) for t in tensors):
        raise NotImplementedError(
            f"nccl:{name} needs values, and this tensor is shape-only (course.emulate(materialize=False)); "
            "run distributed code with materialize=True.")


class _Done(dist.Work):
    """A finished collective. `wait()` makes the current stream wait for it, as NCCL's work.wait() does
    (the host is not blocked)."""

    def __init__(self, group: "EmulatedNCCL", end_ns: int, result, pending=()):
        super().__init__()
        self._group, self._end_ns, self._pending = group, end_ns, list(pending)
        self._future = torch.futures.Future()
        self._future.set_result(result)
        if group._coalescing:
            group._last_work = self

    def wait(self, timeout=None) -> bool:
        for work in self._pending:
            work.wait()
        self._pending.clear()
        self._group._current_stream_waits(self._end_ns)
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self):
        return self._future

    def result(self) -> list:
        """The output tensors, as ProcessGroupNCCL's work gives them."""
        return self._future.value()


class _Captured(_Done):
    """The work of a collective captured into a CUDA graph (see `_capturable`): each replay runs the collective again,
    with its options as at capture (PREMUL_SUM rewrites them to SUM as it runs), and a wait on this work while
    capturing waits, at each replay, for that replay's collective."""

    def __init__(self, group: "EmulatedNCCL", graph, method, args, kwargs):
        super().__init__(group, 0, _flat(args[0]) if args else [])
        self._graph, self._replayed = graph, None
        options = [(a, a.reduceOp) for a in (*args, *kwargs.values()) if hasattr(a, "reduceOp")]
        device, stream = group._lane(_flat(list(args)) + _flat(list(kwargs.values())))

        def run():
            for opts, op in options:
                opts.reduceOp = op
            self._replayed = method(group, *args, **kwargs)
        graph.record_call(device, run, side_lane=(device, stream))

    def wait(self, timeout=None) -> bool:
        if graphs.capturing_graph() is self._graph:
            self._graph.record_call(self._group._device, lambda: self._replayed.wait())
        return True


def _capturable(method):
    """A collective or send/recv issued while its thread captures a CUDA graph is recorded, not run: NCCL's kernels are
    captured like any other (course/cuda/graphs.py), so no values move and no link is busy until a replay runs it."""
    @functools.wraps(method)
    def issue(self, *args, **kwargs):
        graph = graphs.capturing_graph()
        if graph is None:
            return method(self, *args, **kwargs)
        if graphs.inside_recorded_op():  # a functional collective: the graph replays it whole, this call with it
            return _Done(self, 0, _flat(args[0]) if args else [])
        return _Captured(self, graph, method, args, kwargs)
    return issue


class _Recv(_Done):
    """A posted receive: its values and its timing are known only once the message has arrived."""

    def __init__(self, group, tensors, src: int, tag: int):
        super().__init__(group, 0, list(tensors))
        self._tensors, self._src = tensors, src
        self._sender_ready = torch.zeros(2, dtype=_TIME, device="cpu")  # when the sender was ready, and its GPU
        self._buffers = [t.contiguous() for t in _unwrap(tensors)]  # NCCL receives into any layout, gloo does not
        self._pending = [group._gloo.recv(self._buffers, src, tag),
                         group._gloo.recv([self._sender_ready], src, tag)]
        self._done = False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            for work in self._pending:
                work.wait()
            self._pending.clear()
            gpus = [-1] * self._group.size()
            gpus[self._src] = int(self._sender_ready[1])
            gpus[self._group.rank()] = self._group._physical_gpu(self._tensors)
            nccl_checks.check_distinct_gpus(gpus, self._group.rank())  # NCCL's pair communicator, as below
            for tensor, buffer in zip(_unwrap(self._tensors), self._buffers):
                if buffer is not tensor:
                    tensor.copy_(buffer)
            self._end_ns = self._group._finish_recv(self._tensors, self._src, int(self._sender_ready[0]))
            self._done = True
        self._group._current_stream_waits(self._end_ns)
        return True


class EmulatedNCCL(dist.ProcessGroup):
    """The process group `init_process_group("nccl")` gives on emulated GPUs (see the module docstring)."""

    class Options:
        """Stands in for ProcessGroupNCCL.Options: init_process_group sets these attributes."""

        def __init__(self):
            self._timeout = datetime.timedelta(minutes=10)
            self.is_high_priority_stream = False

    def __init__(self, store, rank: int, size: int, options=None):
        super().__init__(rank, size)
        self._emu = current_emulator('init_process_group("nccl")')
        timeout = getattr(options, "_timeout", None) or datetime.timedelta(minutes=10)
        self._gloo_group = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._streams: dict[int, int] = {}
        self._device: int | None = None  # the rank's GPU, learnt from the first tensors it sends
        self._sent_clock = torch.zeros(1, dtype=_TIME, device="cpu")
        _install_sharded_support(self._emu)

    @property
    def _gloo(self):
        if self._gloo_group is None:
            raise RuntimeError("this process group was destroyed (destroy_process_group): make a new one with "
                               "init_process_group before communicating again")
        return self._gloo_group

    # -- what torch.distributed asks of a backend ----------------------------------------------------
    def getBackendName(self) -> str:
        return "nccl"

    def shutdown(self) -> None:
        """destroy_process_group: shut the gloo group down and drop it now. Left to interpreter exit, its
        destructor can run after Python is gone and abort the process ("terminate called without an active
        exception", about 1 run in 10 of a torchrun script)."""
        gloo, self._gloo_group = self._gloo_group, None
        if gloo is not None:
            gloo.shutdown()

    def abort(self) -> None:
        """As shutdown: there is no communicator to abort, only the gloo group to let go."""
        self.shutdown()

    def _set_sequence_number_for_group(self) -> None:
        """NCCL numbers its collectives for debugging; nothing to number here."""

    def __repr__(self) -> str:
        return f"<EmulatedNCCL rank {self.rank()} of {self.size()} on emulated cuda:{self._device}>"

    # -- the per-device Backend torch asks for -------------------------------------------------------
    # A C++ process group keeps one Backend per device type; this group is its own backend for every
    # device. `init_process_group(device_id=...)`, FSDP2's buffer allocation and batch_isend_irecv ask
    # it what it supports: no communicator splitting (new groups are made afresh), no coalesced batches of
    # point-to-point ops (each runs on its own), no special tensor allocator. torch sets `bound_device_id` on
    # the group it replaces by this one, so it stays unset here: DeviceMesh then makes its sub-groups with
    # new_group, which works, instead of splitting a communicator.
    supports_splitting = supports_coalescing = supports_time_estimate = False

    def _get_backend(self, device):
        return self

    def supports_tensor_alloc(self, device) -> bool:
        return False

    @property
    def _device_types(self) -> list:
        """The devices the group serves, as a C++ group lists its backends': CUDA, and the CPU too when
        init_process_group named a CPU backend ("cpu:gloo,cuda:nccl"). Object collectives pick their device from
        it, and DCP's async_save refuses a group without the CPU, just before it stages the tensors: the
        staging of emulated ones is put in place here if DCP was imported after the group was made.
        (gloo underneath moves CPU tensors either way.)"""
        _install_sharded_support(self._emu)
        config = distributed_c10d._world.pg_backend_config.get(self, "cuda:nccl")
        return [torch.device(entry.split(":")[0]) for entry in config.split(",")]

    _coalescing = False
    _last_work = None

    def _start_coalescing(self, device) -> None:
        """`dist._coalescing_manager(device=...)`: NCCL groups the collectives up to `_end_coalescing` into one
        launch; here each still runs on its own, and the work of the last one stands for the batch. Only then is
        a work kept by the group: it holds its outputs, whose memory must be freed when the caller drops them."""
        self._coalescing, self._last_work = True, None

    def _end_coalescing(self, device):
        work = self._last_work or _Done(self, self._emu.clock.host_ns, [])
        self._coalescing, self._last_work = False, None
        return work

    def eager_connect_single_device(self, device) -> None:
        """NCCL connects its communicator early when given a device_id; the gloo group is connected."""

    # C++ ProcessGroup keeps its name and description in its backends, and a Python group has none
    # registered ("ProcessGroup name not set" from DeviceMesh, functional collectives, FSDP2): keep them here.
    _name = _desc = ""

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        _install_sharded_support(self._emu)
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    group_name = property(getGroupName)
    group_desc = property(getGroupDesc)

    # -- timing ----------------------------------------------------------------------------------
    def _lane(self, tensors) -> tuple[int, int]:
        """The rank's GPU (from its tensors, else the last one it used, else NCCL's guess) and NCCL's stream on it.

        Guessing from the rank, not from the calling thread's current device, keeps rank threads off each
        other's streams before they call set_device: the timeline is then the same on every run."""
        _install_sharded_support(self._emu)
        gpus = [t._device_index for t in tensors if isinstance(t, EmulatedTensor) and t._device_index != CPU]
        if gpus:
            self._device = gpus[0]
        elif self._device is None:  # as ProcessGroupNCCL guesses (guessDeviceForRank): rank % local GPUs
            self._device = self.rank() % self._emu.num_gpus
        if self._device not in self._streams:
            self._streams[self._device] = self._emu.new_stream_id(self._device)
        return self._device, self._streams[self._device]

    def _physical_gpu(self, tensors) -> int:
        """The machine's index of the GPU NCCL would run this call on (-1 for host tensors only: no communicator)."""
        if tensors and not any(isinstance(t, EmulatedTensor) and t._device_index != CPU for t in tensors):
            return -1
        return self._emu.visible_devices()[self._lane(tensors)[0]]

    def _ready_ns(self, tensors, device: int, stream: int) -> int:
        """When this rank could start: its host has launched, its inputs and both streams are ready."""
        clock = self._emu.clock
        ready = [clock.host_ns + clock.host_launch_ns, clock.stream_ready(device, stream),
                 clock.stream_ready(device, self._emu.current_stream_id(device))]
        for t in tensors:
            ready.append(t.ready_ns if isinstance(t, EmulatedTensor) else host_scratch_ready(t))
        return max(ready)

    def _charge(self, name: str, tensors, outputs, duration_ns: int, start_ns: int, nbytes: int) -> int:
        device, stream = self._lane(tensors)
        end = self._emu.clock.record_span("collective", f"nccl:{name}", device, stream, start_ns,
                                          start_ns + duration_ns, nbytes)
        for t in outputs:
            if isinstance(t, EmulatedTensor):
                if t._block is not None:  # not a GPU tensor moved to the host (interception._set_data)
                    t._block.ready_ns = max(t._block.ready_ns, end)
            elif t.dim() > 0:
                mark_host_scratch(t, end)
        return end

    def _current_stream_waits(self, end_ns: int) -> None:
        emu = self._emu
        device = self._device if self._device is not None else emu.current_device()
        key = (device, emu.current_stream_id(device))
        with emu.clock.lock:
            emu.clock.stream_ready_ns[key] = max(emu.clock.stream_ready(*key), end_ns)

    def _check_device_types(self, tensors, from_python: bool = False) -> None:
        """A C++ group hands a collective to its backend for the tensors' device type, and a group made with "nccl"
        alone has none for CPU tensors ("No backend type associated with device type cpu", ProcessGroup::getBackend
        in torch/csrc/distributed/c10d/ProcessGroup.hpp). Nor has torch 2.13's default group, which BackendConfig
        gives the accelerator's backend only. A plain CPU tensor that PyTorch's C++ hands over (DDP's buckets) stands
        for GPU memory here (it reaches comm hooks, Python ones too, inside backward), so only calls from
        torch.distributed's Python functions outside backward are checked, and `from_python`, DDP's broadcast of a
        module's parameters and buffers (`dist._broadcast_coalesced`: a model or a buffer left on the host)."""
        if "cpu" in [d.type for d in self._device_types] or all(
                isinstance(t, EmulatedTensor) and t._device_index != CPU for t in tensors) or \
                torch._C._current_graph_task_id() != -1:
            return
        if from_python:
            raise RuntimeError("No backend type associated with device type cpu")
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") == __name__:
            frame = frame.f_back
        if frame is not None and frame.f_globals.get("__name__") == distributed_c10d.__name__:
            raise RuntimeError("No backend type associated with device type cpu")

    def _collective(self, name: str, cost, call, inputs, outputs, nbytes: int, finish=None):
        """Run `call` on the CPU tensors through gloo, then charge `cost(nbytes)` from the agreed start. `finish`
        then completes the outputs (nccl_checks.reduction): after the one wait, since a gloo work may write its
        output again at each wait (reduce_scatter's)."""
        tensors = _flat(inputs) + _flat(outputs)
        self._check_device_types(tensors)
        nccl_checks.check_tensors(tensors)
        device, stream = self._lane(tensors)
        stamp = torch.tensor([self._ready_ns(tensors, device, stream), self._physical_gpu(tensors)], dtype=_TIME,
                             device="cpu")
        _needs_values(name, tensors)
        stamps = [torch.empty(2, dtype=_TIME, device="cpu") for _ in range(self.size())]
        self._gloo.allgather([stamps], [stamp]).wait()  # when each rank is ready, and on which GPU
        nccl_checks.check_distinct_gpus([int(s[1]) for s in stamps], self.rank())
        call().wait()
        if finish is not None:
            finish()
        start = max(int(s[0]) for s in stamps)
        end = self._charge(name, tensors, _flat(outputs), cost(nbytes), start, nbytes)
        return _Done(self, end, outputs if isinstance(outputs, list) else [outputs])

    def _reduction(self, opts, tensors):
        """ProcessGroupNCCL's checks before a reduction changes anything (PREMUL_SUM scales inputs in place)."""
        self._check_device_types(_flat(tensors))
        nccl_checks.check_tensors(_flat(tensors))
        return nccl_checks.reduction(opts, _flat(tensors), self.size())

    def _link_cost(self, model):
        link, n = self._emu.collective_link(range(self.size())), self.size()
        return lambda nbytes: model(link, nbytes, n)

    # -- collectives -----------------------------------------------------------------------------
    @_capturable
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        finish = self._reduction(opts, tensors)
        inner = _premul_sum(opts, _unwrap(tensors), in_place=True)
        return self._collective("all_reduce", self._link_cost(costs.ring_allreduce_ns),
                                lambda: self._gloo.allreduce(inner, opts), tensors, tensors, _nbytes(tensors),
                                lambda: finish(inner))

    @_capturable
    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        finish = self._reduction(opts, tensors)
        inner = _premul_sum(opts, _unwrap(tensors), in_place=True)
        return self._collective("all_reduce", self._link_cost(costs.ring_allreduce_ns),
                                lambda: self._gloo.allreduce_coalesced(inner, opts), tensors, tensors,
                                _nbytes(tensors), lambda: finish(inner))

    @_capturable
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._collective("broadcast", self._link_cost(costs.broadcast_ns),
                                lambda: self._gloo.broadcast(_unwrap(tensors), opts), tensors, tensors,
                                _nbytes(tensors))

    @_capturable
    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        finish = self._reduction(opts, tensors)
        inner = _unwrap(tensors)
        root = self.rank() == opts.rootRank
        scaled = _premul_sum(opts, inner, in_place=False)
        if scaled is inner and not root:  # NCCL writes only the root's buffer; gloo leaves partial results in others'
            scaled = [t.clone() for t in inner]

        def call():
            work = self._gloo.reduce(scaled, opts)
            if scaled is not inner:
                work.wait()
                if root:
                    inner[opts.rootTensor].copy_(scaled[opts.rootTensor])
            return work
        return self._collective("reduce", self._link_cost(costs.broadcast_ns), call, tensors, tensors,
                                _nbytes(tensors), lambda: finish(inner if root else []))

    @_capturable
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or distributed_c10d.AllgatherOptions()
        outputs, own = _unwrap(output_lists), _unwrap(inputs)
        call = (functools.partial(self._gloo.allgather, outputs, own, opts) if _same_sizes(outputs[0])
                else functools.partial(self._broadcast_each, outputs[0], own[0]))
        return self._collective("all_gather", self._link_cost(costs.ring_allgather_ns), call,
                                inputs, output_lists, _nbytes(_flat(output_lists)))

    def _broadcast_each(self, outputs, own):
        """NCCL's all_gather of tensors of different sizes (ProcessGroupNCCL::allgather), which gloo refuses: one
        broadcast from each rank, its own input copied into its slot first."""
        outputs[self.rank()].copy_(own)
        for root, output in enumerate(outputs):
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            work = self._gloo.broadcast([output], opts)
            work.wait()
        return work

    def _reduce_each(self, output, inputs, opts):
        """NCCL's reduce_scatter of tensors of different sizes (ProcessGroupNCCL::reduce_scatter), which gloo
        refuses: one reduce to each rank, on copies, since NCCL's reduce is out of place."""
        for root, tensor in enumerate(inputs):
            copy = tensor.clone()
            reduce_opts = dist.ReduceOptions()
            reduce_opts.reduceOp, reduce_opts.rootRank = opts.reduceOp, root
            work = self._gloo.reduce([copy], reduce_opts)
            work.wait()
            if root == self.rank():
                output.copy_(copy)
        return work

    @_capturable
    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts or distributed_c10d.AllgatherOptions()
        return self._collective("all_gather", self._link_cost(costs.ring_allgather_ns),
                                lambda: self._gloo.allgather_coalesced(_unwrap(output_lists), _unwrap(inputs), opts),
                                inputs, output_lists, _nbytes(_flat(output_lists)))

    @_capturable
    def all_gather_single(self, output, input, opts=None):
        opts = opts or distributed_c10d.AllgatherOptions()
        nccl_checks.check_gathered(output, input, self.size())
        return self._collective("all_gather", self._link_cost(costs.ring_allgather_ns),
                                lambda: self._gloo._allgather_base(_by_count(output), _by_count(input), opts),
                                [input], [output], _nbytes([output]))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1]

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_capturable
    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        finish = self._reduction(opts, [outputs, input_lists])
        own, inputs = _unwrap(outputs), _premul_sum(opts, _unwrap(input_lists), in_place=False)
        call = (functools.partial(self._gloo.reduce_scatter, own, inputs, opts) if _same_sizes(inputs[0])
                else functools.partial(self._reduce_each, own[0], inputs[0], opts))
        return self._collective("reduce_scatter", self._link_cost(costs.ring_reduce_scatter_ns), call,
                                input_lists, outputs, _nbytes(_flat(input_lists)), lambda: finish(own))

    @_capturable
    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        nccl_checks.check_scattered(output, input, self.size())
        finish = self._reduction(opts, [output, input])
        return self._collective("reduce_scatter", self._link_cost(costs.ring_reduce_scatter_ns),
                                lambda: self._gloo._reduce_scatter_base(
                                    _by_count(output), _premul_sum(opts, _by_count(input), in_place=False), opts),
                                [input], [output], _nbytes([input]), lambda: finish([_unwrap(output)]))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1]

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _all_to_all_cost(self, nbytes: int) -> int:
        """Every rank sends (n-1)/n of its bytes, one peer after another over its link."""
        n = self.size()
        return costs.copy_ns(self._emu.link, nbytes * (n - 1) // max(n, 1)) if n > 1 else 0

    @_capturable
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._collective("all_to_all", self._all_to_all_cost,
                                lambda: self._gloo.alltoall_base(_unwrap(output), _unwrap(input),
                                                                 output_split_sizes, input_split_sizes, opts),
                                [input], [output], _nbytes([input]))

    alltoall_base = all_to_all_single

    @_capturable
    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or dist.AllToAllOptions()
        own, peers = _unwrap(inputs), _unwrap(outputs)
        one_dtype = len({t.dtype for t in own + peers}) == 1  # else gloo's refusal, not a silent promotion
        call = (functools.partial(self._all_to_all_each, peers, own, opts) if one_dtype and not _same_sizes(own + peers)
                else functools.partial(self._gloo.alltoall, peers, own, opts))
        return self._collective("all_to_all", self._all_to_all_cost, call, inputs, outputs, _nbytes(_flat(inputs)))

    def _all_to_all_each(self, outputs, inputs, opts):
        """NCCL's all_to_all of tensors of different sizes (ProcessGroupNCCL::alltoall sends and receives each
        one on its own), which gloo refuses: one all_to_all of them flattened, split by element counts."""
        sizes = [t.numel() for t in outputs]
        received = inputs[0].new_empty(sum(sizes))
        work = self._gloo.alltoall_base(received, torch.cat([t.reshape(-1) for t in inputs]), sizes,
                                        [t.numel() for t in inputs], opts)
        work.wait()
        for output, part in zip(outputs, received.split(sizes)):
            output.copy_(part.view(output.shape))
        return work

    @_capturable
    def gather(self, outputs, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        return self._collective("gather", self._link_cost(costs.broadcast_ns),
                                lambda: self._gloo.gather(_unwrap(outputs), _unwrap(inputs), opts),
                                inputs, outputs, _nbytes(_flat(inputs)) * self.size())

    @_capturable
    def scatter(self, outputs, inputs, opts=None):
        opts = opts or dist.ScatterOptions()
        return self._collective("scatter", self._link_cost(costs.broadcast_ns),
                                lambda: self._gloo.scatter(_unwrap(outputs), _unwrap(inputs), opts),
                                inputs, outputs, _nbytes(_flat(outputs)) * self.size())

    def barrier(self, opts=None):
        if graphs.is_current_stream_capturing():  # NCCL's barrier synchronizes the device after its all-reduce
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (dist.barrier "
                               "synchronizes the device, inside torch.cuda.graph capture)")
        flag = torch.zeros(1, device="cpu")
        return self._collective("barrier", self._link_cost(costs.ring_allreduce_ns),
                                lambda: self._gloo.allreduce([flag]), [], [], 0)

    # -- point to point --------------------------------------------------------------------------
    @_capturable
    def send(self, tensors, dst: int, tag: int = 0):
        """Post the values and this rank's ready time; the sender's stream is busy for the transfer."""
        _needs_values("send", tensors)
        self._check_device_types(tensors)
        nccl_checks.check_tensors(tensors, p2p=True)
        device, stream = self._lane(tensors)
        ready = self._ready_ns(tensors, device, stream)
        clock_msg = torch.tensor([ready, self._physical_gpu(tensors)], dtype=_TIME, device="cpu")
        works = [self._gloo.send([t.contiguous() for t in _unwrap(tensors)], dst, tag),
                 self._gloo.send([clock_msg], dst, tag)]
        nbytes = _nbytes(tensors)
        end = self._charge(f"send to {dst}", tensors, [], costs.copy_ns(self._emu.link, nbytes), ready, nbytes)
        return _Done(self, end, list(tensors), pending=works)

    @_capturable
    def recv(self, tensors, src: int, tag: int = 0):
        _needs_values("recv", tensors)
        self._check_device_types(tensors)
        nccl_checks.check_tensors(tensors, p2p=True)
        return _Recv(self, tensors, src, tag)

    def _finish_recv(self, tensors, src: int, sender_ready_ns: int) -> int:
        """The transfer starts when both the sender and this receiver are ready."""
        device, stream = self._lane(tensors)
        start = max(sender_ready_ns, self._ready_ns(tensors, device, stream))
        nbytes = _nbytes(tensors)
        return self._charge(f"recv from {src}", tensors, tensors, costs.copy_ns(self._emu.link, nbytes), start,
                            nbytes)

    def recv_anysource(self, tensors, tag: int = 0):
        raise NotImplementedError(
            "recv from any source is not modelled by the GPU emulator (NCCL does not support it either); "
            "name the sending rank: dist.recv(tensor, src=...).")


def _install_sharded_support(emu) -> None:
    """FSDP2's storage handling (and backward hooks inside the emulator, which its pre-backward all-gather
    needs), FSDP1's flat-parameter sharding (course/cuda/fsdp1.py), DCP's async staging
    (course/cuda/dcp_staging.py), DTensor's random ops refused (course/cuda/dtensor_random.py) and funcol's
    wrapper, in place once their torch modules are imported.

    Importing FSDP or DTensor costs about a second, so the emulator does not do it for every program. Any use
    of them goes through an emulated NCCL group (made, named by a DeviceMesh, used for a collective), which
    calls this cheap check: the first call after the import puts the handling in place. The emulator's import
    hook calls it too, for groups that are not emulated NCCL (the threaded one of PyTorch's FSDP tests).
    """
    if fsdp2.FSDP_MODULE in sys.modules and not fsdp2.in_place():
        for target, replacements in fsdp2.patches():
            emu._patch(target, replacements)  # undone when the emulator stops
    for target, replacements in (fsdp2.dtensor_patches() + fsdp2.init_patches() + fsdp1.patches()
                                 + dcp_staging.patches() + dtensor_random.patches()):
        emu._patch(target, replacements)
    functional_collectives.register()


def _nccl_available() -> bool:
    return True


_broadcast_coalesced_in_cpp = dist._broadcast_coalesced


def _broadcast_coalesced(process_group, tensors, buffer_size: int, src: int = 0) -> None:
    """DDP's parameter and buffer broadcast, one device at a time. C++ buckets the tensors by device, and sees an
    emulated tensor's device as the CPU: a module spread over two GPUs (DDP with model parallelism) would be
    flattened into one bucket and fail with 'Expected all tensors to be on the same device'. Every rank groups
    its tensors in the same order (by first appearance), so the broadcasts still pair up."""
    if isinstance(process_group, EmulatedNCCL) and any(
            not isinstance(t, EmulatedTensor) or t._device_index == CPU for t in tensors):
        process_group._check_device_types(tensors, from_python=True)
    by_device: dict = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    for group in by_device.values():
        _broadcast_coalesced_in_cpp(process_group, group, buffer_size, src)


# What course.emulate puts in place in torch.distributed while it is active. NCCL's default timeout is
# 10 minutes (torch/distributed/constants.py, when NCCL is built in).
C10D_PATCHES = {"is_nccl_available": _nccl_available, "ProcessGroupNCCL": EmulatedNCCL,
                "default_pg_nccl_timeout": datetime.timedelta(minutes=10)}
DIST_PATCHES = {"is_nccl_available": _nccl_available, "ProcessGroupNCCL": EmulatedNCCL,
                "_broadcast_coalesced": _broadcast_coalesced}


def _ddp_init(original):
    """DDP without `gradient_as_bucket_view` on emulated GPUs: the reducer's buckets are plain CPU tensors to
    Python (see kernels.host_scratch_ready), so gradients that were views of them would read as CPU tensors.
    The values are the same; the memory is one gradient copy more than on a GPU, and a warning says so."""
    @functools.wraps(original)
    def __init__(self, module, *args, **kwargs):
        if kwargs.get("gradient_as_bucket_view") and any(isinstance(p, EmulatedTensor) for p in module.parameters()):
            warnings.warn("The GPU emulator runs DDP with gradient_as_bucket_view=False: same gradients, but "
                          "memory counts one extra copy of them.", stacklevel=2)
            kwargs["gradient_as_bucket_view"] = False
        original(self, module, *args, **kwargs)
    return __init__


def _register_comm_hook(original):
    """A comm hook runs with torch.cuda taking its bucket's host device for the bucket's GPU (cuda_api._comm_hook).
    DDP's own check on the bf16 hooks (`torch.version.cuda` set, NCCL 2.10 or newer) passes as on a CUDA box, since
    the emulator reports a CUDA build (build_info.py) and NCCL 2.29 (collectives.NCCL_PATCHES)."""
    @functools.wraps(original)
    def register_comm_hook(self, state, hook):
        @functools.wraps(hook)
        def on_the_bucket_gpu(state, bucket):
            gpus = [p.get_device() for p in bucket.parameters()[:1] if isinstance(p, EmulatedTensor)]
            if not gpus or gpus[0] == CPU:
                return hook(state, bucket)
            with cuda_api.comm_hook_on(gpus[0]):
                return hook(state, bucket)
        return original(self, state, on_the_bucket_gpu)
    return register_comm_hook


DDP_PATCHES = {"__init__": _ddp_init(DistributedDataParallel.__init__),
               "register_comm_hook": _register_comm_hook(DistributedDataParallel.register_comm_hook)}
