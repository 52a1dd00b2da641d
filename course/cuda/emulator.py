"""`course.emulate`: run code written for several CUDA GPUs on the CPU, with a simulated clock.

Inside the block, `torch.cuda` answers for the emulated GPUs and tensors on `cuda:i` are
`EmulatedTensor`s; outside it torch is untouched. On a machine whose torch sees real GPUs the
emulator steps aside (unless `force=True`), so the same notebook measures the real thing.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
import torch.cuda.comm
import torch.distributed
import torch.distributed.distributed_c10d
import torch.cuda.nccl
import torch.cuda.nvtx
import torch.cuda.profiler
import torch.nn.parallel._functions
import torch.nn.parallel.comm

from course.cuda import (autocast, backward_hooks, build_info, checkpoints, collectives, cuda_api, cuda_key_factories,
                         cuda_libraries, devices, environment, forked_rng, fsdp1, fsdp2, functorch_layers, graphs,
                         interception,
                         join_work, kernels, legacy_types, materialized_grads, module_calls, nccl, nested_fastpath,
                         profiling, rank_rng, replica_rng, rpc, split_group, storages, subclasses, threaded_pg,
                         wall_clock)
from course.cuda.interception import EmulatorMode
from course.cuda.nvtx import PROFILER_PATCHES, EmitNVTX, EmulatedNVTX
from course.machine import costs, hardware, plots, topology
from course.machine.clock import Clock
from course.machine.memory import DeviceMemory
from course.machine.trace import TraceEvent


# An EmulatedTensor's behaviour comes from modules above the one that defines it (see devices.hooks).
devices.hooks.torch_function = interception.handle_torch_function
devices.hooks.torch_dispatch = kernels.run_kernel
devices.hooks.reduce_ex = checkpoints.reduce_ex

_ABSENT = object()  # what _patch remembers for a name the module did not have (ProcessGroupNCCL on a CPU build)


class Emulator:
    """The state of one emulated machine: its GPUs, links, clock, memory and trace.

    Use it as a context manager (`with course.emulate(...) as emu:`), or call `start()` once at the
    top of a notebook and `stop()` at the end, since a `with` block cannot span notebook cells.
    """

    mode = "emulated"

    def __init__(self, gpus: int, gpu, link, host_link, materialize: bool, machine=None):
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"gpus must be a whole number of GPUs, 1 or more; got {gpus!r}")
        self.machine = None if machine is None else hardware.machine(machine)
        if self.machine is not None:
            if gpus > self.machine.num_gpus:
                raise ValueError(f"a {self.machine.key} has {self.machine.num_gpus} GPUs; asked for {gpus}: "
                                 f"ask for {self.machine.num_gpus} or fewer")
            gpu, link, host_link = self.machine.gpu, self.machine.link, self.machine.host_link
        self.physical_gpus = gpus
        self._visible: list[int] | None = None  # read from CUDA_VISIBLE_DEVICES when first asked (see num_gpus)
        self.visible_at_start = os.environ.get("CUDA_VISIBLE_DEVICES")  # the real machine's (environment.py)
        self.gpu = hardware.gpu(gpu)
        self.link = hardware.link(link)
        self.host_link = hardware.link(host_link)
        self.materialize = materialize
        self.clock = Clock(costs.HOST_LAUNCH_NS, costs.HOST_MODULE_OP_NS)
        self.memory = DeviceMemory(gpus, self.gpu.memory_bytes)
        self.kernel_ns_cache: dict = {}  # costs.kernel_ns by its arguments: the same kernels recur every step
        self.links = topology.LinkLedger()  # what crosses each link of a machine preset, for shared bandwidth
        self._collective_links: dict[tuple[int, ...], hardware.Link] = {}
        self._per_thread = threading.local()
        self._stream_counts = [1] * gpus
        self._saved: list[tuple[object, str, object]] = []
        self._mode: EmulatorMode | None = None
        self.sync_debug_mode = 0  # torch.cuda.set_sync_debug_mode (course/cuda/sync_debug.py)

    @property
    def num_gpus(self) -> int:
        """The GPUs this process sees: all of the machine's, or those CUDA_VISIBLE_DEVICES names once the program or
        its launcher set it. Like the CUDA driver, which reads the variable when CUDA initialises, it is read at the
        first question about devices, so a program may still set it in os.environ after the emulator started."""
        return len(self.visible_devices())

    def visible_devices(self) -> list[int]:
        """The machine's index of each GPU this process numbers 0, 1, ...: what topology and links are read by."""
        if self._visible is None:
            self._visible = environment.visible_devices(self.physical_gpus, self.visible_at_start)
        return self._visible

    # -- per-thread CUDA state: current device and current stream of each device --------------
    def _thread_state(self):
        state = self._per_thread
        if not hasattr(state, "device"):
            state.device, state.streams = 0, {}
        return state

    def current_device(self) -> int:
        return self._thread_state().device

    def set_current_device(self, index: int) -> None:
        self._thread_state().device = index

    def current_stream_id(self, device: int) -> int:
        try:  # every kernel asks: a thread has its state from its first call on
            return self._per_thread.streams.get(device, 0)
        except AttributeError:
            return self._thread_state().streams.get(device, 0)

    def set_current_stream(self, device: int, stream_id: int) -> None:
        self._thread_state().streams[device] = stream_id

    def collective_link(self, devices=None) -> hardware.Link:
        """The link NCCL's rings over `devices` (default: every GPU) run on, from the machine preset's topology
        (course/machine/topology.py); without a machine preset, `link` itself."""
        visible = self.visible_devices()
        key = tuple(sorted(visible[d] for d in (range(len(visible)) if devices is None else set(devices))))
        if key not in self._collective_links:
            self._collective_links[key] = topology.collective_link(self.machine, self.link, self.host_link,
                                                                   list(key))
        return self._collective_links[key]

    def new_stream_id(self, device: int) -> int:
        with self.clock.lock:
            self._stream_counts[device] += 1
            return self._stream_counts[device] - 1

    def has_stream(self, device: int, stream_id: int) -> bool:
        return 0 <= device < self.num_gpus and 0 <= stream_id < self._stream_counts[device]

    # -- switching on and off -------------------------------------------------------------------
    def start(self) -> "Emulator":
        """Switch the emulator on. Inside another emulator it is a separate machine until it stops
        (tensors of the two should not meet); the outer one comes back then."""
        if self._mode is not None:
            raise RuntimeError("This emulator is already started; call stop() before starting it again.")
        self._outer = devices.active
        self._patch(torch.cuda, cuda_api.PATCHES)
        self._patch(torch.accelerator, cuda_api.ACCELERATOR_PATCHES)
        self._patch(torch, cuda_api.TORCH_PATCHES)
        self._patch(torch._C, {"_group_tensors_by_device_and_dtype": kernels.group_tensors_by_device_and_dtype})
        for target, replacements in cuda_api.module_patches(self.physical_gpus):  # torch._C, RNG, torch.cuda.memory
            self._patch(target, replacements)
        self._patch(torch, {"device": interception.device,  # torch.device(1) is cuda:1, as on a GPU box
                            "range": interception.factory_range})
        self._patch(torch.fx.graph, interception.fx_graph_patches())  # and in FX's generated code
        for target, replacements in build_info.PATCHES:  # torch.version.cuda, cudnn.version(): a CUDA build's
            self._patch(target, replacements)
        self._patch(torch, legacy_types.PATCHES)  # isinstance(cuda_x, torch.FloatTensor) is False, as on a GPU box
        self._patch(torch.nn.parallel.comm, collectives.COMM_PATCHES)
        self._patch(torch.cuda.comm, collectives.COMM_PATCHES)
        self._patch(torch.cuda.nccl, collectives.NCCL_PATCHES)
        self._patch(torch.distributed.distributed_c10d, nccl.C10D_PATCHES)
        self._patch(torch.distributed, nccl.DIST_PATCHES)
        self._patch(torch.nn.parallel.DistributedDataParallel, nccl.DDP_PATCHES)
        for target, replacements in join_work.PATCHES + split_group.PATCHES:  # Join's work handle; split_group
            self._patch(target, replacements)
        # nn.parallel caches one Stream per device across calls; a fresh emulator needs fresh ones.
        self._patch(torch.nn.parallel._functions, {"_streams": None})
        self._patch(torch.nn.parallel._functions.Scatter, collectives.SCATTER_PATCHES)
        for target, replacements in replica_rng.PATCHES:  # DataParallel's replicas each on their own generator
            self._patch(target, replacements)
        # Every thread the program starts while the emulator runs runs inside it too (modes are per thread):
        # parallel_apply's workers, the DataLoader's pin-memory thread, run_threads' ranks.
        self._patch(threading.Thread, THREAD_PATCHES)
        for target, replacements in profiling.PATCHES:  # torch.profiler with CUDA activity
            self._patch(target, replacements)
        self._patch(torch.cuda.nvtx, {"_nvtx": EmulatedNVTX(self)})
        self._patch(torch.autograd.profiler, {"emit_nvtx": EmitNVTX})
        self._patch(torch.cuda.profiler, PROFILER_PATCHES)
        # The host pays for every module call; conversions swap parameters (module_calls.module_apply).
        self._patch(torch.nn.Module, {"__call__": module_calls.module_call, "_apply": module_calls.module_apply})
        # TransformerEncoder's nested fast path, which PyTorch skips for tensor subclasses (nested_fastpath.py)
        self._patch(torch.nn.TransformerEncoder, {"forward": nested_fastpath.encoder_forward})
        for target, replacements in module_calls.PATCHES:
            self._patch(target, replacements)
        for target, replacements in checkpoints.patches() + storages.PATCHES:  # storages of GPU tensors, saved too
            self._patch(target, replacements)
        for target, replacements in cuda_libraries.patches():  # preferred linalg/BLAS library, cuFFT plan cache
            self._patch(target, replacements)
        for target, replacements in functorch_layers.PATCHES:  # a GPU tensor's device inside vmap, grad, jvp
            self._patch(target, replacements)
        for target, replacements in subclasses.PATCHES:  # x.as_subclass(MyTensor) of a GPU tensor
            self._patch(target, replacements)
        for target, replacements in backward_hooks.PATCHES + graphs.PATCHES + rpc.patches():  # callbacks, graphs, RPC
            self._patch(target, replacements)
        for target, replacements in forked_rng.PATCHES:  # the GPUs a fork_rng leaves out draw on
            self._patch(target, replacements)
        for target, replacements in materialized_grads.PATCHES:  # a custom Function's zero gradients on their GPU
            self._patch(target, replacements)
        # FSDP1 imported after the process group was made (course/cuda/fsdp1.py); FSDP2 and DTensor imported at all,
        # since a group that is not emulated NCCL (the threaded one of FSDPTestMultiThread) never installs them
        sharded = (fsdp1.INIT_MODULE, fsdp2.FSDP_MODULE, fsdp2.DTENSOR_MODULE)
        # PyTorch's threaded group, and torch.utils.benchmark.Timer (it reads the simulated clock), whenever imported
        threaded = fsdp1.PatchOnImport(self._patch_threaded_pg, (threaded_pg.MODULE,))
        timer = fsdp1.PatchOnImport(self._patch_timer, (wall_clock.TIMER_MODULE,))
        self._patch(sys, {"meta_path": [fsdp1.PatchOnImport(self._patch_sharded, sharded), threaded, timer]
                          + sys.meta_path})
        self._patch_threaded_pg()  # PyTorch's threaded group, if a test file imported it already
        if wall_clock.TIMER_MODULE in sys.modules:
            self._patch_timer()
        devices.active = self
        autocast.install()
        cuda_key_factories.install()
        self._env_before = environment.publish(self._config())
        self._mode = EmulatorMode()
        self._mode.__enter__()
        return self

    def stop(self) -> None:
        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        self._mode = None
        autocast.uninstall()
        cuda_key_factories.uninstall()
        legacy_types.host_by_default()
        profiling.stop_recordings(self)
        devices.active = self._outer
        environment.restore(self._env_before)
        for module, name, original in reversed(self._saved):
            if original is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, original)
        self._saved.clear()

    def _config(self) -> dict | None:
        """This machine as `emulate()` arguments, for worker processes; None if it is not made of presets."""
        presets = [(self.gpu, hardware.GPUS), (self.link, hardware.LINKS), (self.host_link, hardware.LINKS)]
        if any(presets_of.get(part.key) is not part for part, presets_of in presets):
            return None
        config = {"gpus": self.physical_gpus, "gpu": self.gpu.key, "link": self.link.key,
                  "host_link": self.host_link.key, "materialize": self.materialize,
                  "visible_at_start": self.visible_at_start}
        # Workers must see the same topology, not every pair on the whole link.
        if self.machine is not None:
            config["machine"] = self.machine.key
        return config

    def _patch(self, module, replacements: dict) -> None:
        for name, replacement in replacements.items():
            # a class's own attribute as stored (a staticmethod stays one when put back), else the module's
            original = vars(module).get(name, _ABSENT) if isinstance(module, type) else getattr(module, name, _ABSENT)
            self._saved.append((module, name, original))
            setattr(module, name, replacement)

    def _patch_sharded(self) -> None:
        nccl._install_sharded_support(self)

    def _patch_timer(self) -> None:
        for target, replacements in wall_clock.patches():
            self._patch(target, replacements)

    def _patch_threaded_pg(self) -> None:
        for target, replacements in threaded_pg.patches():
            self._patch(target, replacements)

    def __enter__(self) -> "Emulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what it shows --------------------------------------------------------------------------
    @property
    def trace(self) -> list[TraceEvent]:
        return self.clock.trace

    def now_ms(self) -> float:
        """Simulated host time since the emulator started, in milliseconds."""
        return self.clock.host_ns / 1e6

    def describe(self) -> str:
        values = "real values" if self.materialize else "shapes only (materialize=False)"
        return (f"emulated: {self.num_gpus} x {self.gpu.name}, GPUs linked by {self.link.name}, "
                f"host by {self.host_link.name}; {values}")

    def __repr__(self) -> str:
        return f"<course.Emulator {self.describe()}>"

    def plot_timeline(self, **kwargs):
        return plots.plot_timeline(self.trace, **kwargs)

    def export_chrome_trace(self, path):
        return plots.export_chrome_trace(self.trace, path)

    def summary(self):
        return plots.summary(self.trace)


_thread_start, _thread_bootstrap_inner, _thread_join = (threading.Thread.start, threading.Thread._bootstrap_inner,
                                                         threading.Thread.join)


def _start_thread(self) -> None:
    """`Thread.start` while the emulator runs: every thread the program starts (a prefetching thread, one thread
    per GPU) runs inside it too, on a host timeline forked from its parent's. Its current device is 0, as CUDA's
    current device is per thread."""
    emu = devices.active
    if emu is not None:
        self._course_emulator, self._course_host_ns = emu, emu.clock.host_ns
        self._course_generator = rank_rng.for_new_thread()  # a rank's own; None for the process's
    _thread_start(self)


# Python objects torch keeps in a thread's C++ thread-locals: torch/_inductor/cudagraph_trees.py stashes these in the
# thread that first imports it, which `torch._dynamo.reset()` does when torch.cuda.is_available() (so under the
# emulator, from the rank threads of PyTorch's threaded tests). Dropping them needs the GIL; left to the thread's C++
# exit, that can come after the main thread has begun finalizing, and the process aborts ("terminate called without
# an active exception": 1 run in 12 of a threaded FSDP2 test file).
_TLS_OBJECTS = ("tree_manager_containers", "tree_manager_locks")


def _run_thread(self) -> None:
    emu = getattr(self, "_course_emulator", None)
    if emu is None or devices.active is not emu:
        return _thread_bootstrap_inner(self)
    emu.clock.host_ns = self._course_host_ns
    generator = self._course_generator
    try:
        with EmulatorMode(), rank_rng.rank_thread(generator) if generator is not None else contextlib.nullcontext():
            _thread_bootstrap_inner(self)
    finally:
        self._course_host_ns = emu.clock.host_ns
        for key in _TLS_OBJECTS:  # dropped now, while this thread holds the GIL
            if torch._C._is_key_in_tls(key):
                torch._C._remove_obj_from_tls(key)


def _join_thread(self, timeout=None) -> None:
    _thread_join(self, timeout)
    emu = getattr(self, "_course_emulator", None)
    if emu is not None and not self.is_alive():
        emu.clock.host_ns = max(emu.clock.host_ns, self._course_host_ns)


THREAD_PATCHES = {"start": _start_thread, "_bootstrap_inner": _run_thread, "join": _join_thread}


class RealGPUs:
    """What `course.emulate` gives back on a machine with real GPUs: it changes nothing."""

    mode = "real"
    trace = None

    def __init__(self):
        self.num_gpus = torch.cuda.device_count()

    def start(self) -> "RealGPUs":
        return self

    def stop(self) -> None:
        pass

    def __enter__(self) -> "RealGPUs":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def describe(self) -> str:
        return f"real: {self.num_gpus} x {torch.cuda.get_device_name(0)}"

    def __repr__(self) -> str:
        return f"<course.RealGPUs {self.describe()}>"


def emulate(gpus: int | None = None, gpu="A100-80GB", link="nvlink3", host_link="pcie4",
            materialize: bool = True, force: bool = False, machine=None) -> Emulator | RealGPUs:
    """An emulated machine of `gpus` x `gpu`, peers joined by `link`, host by `host_link`.

    Defaults: 4 A100-80GB on NVLink 3 behind PCIe 4, like a DGX A100 quarter, every pair of GPUs with the whole
    link. `machine="DGX-1V"`, `"DGX-A100"`, `"DGX-H100"`, `"8xL4"` or `"4xRTX4090"` (course.machine.hardware.MACHINES)
    takes the GPU, links and how each pair of GPUs reaches the other (a switch, NVLink bricks, or host memory)
    from a real machine, with all its GPUs unless `gpus` asks for fewer. `materialize=False` computes shapes,
    times and memory without any values, for what-ifs at real scale. On a machine whose torch sees real GPUs
    this returns `RealGPUs` and changes nothing, unless `force=True`.
    """
    if torch.cuda.is_available() and devices.active is None and not force:
        return RealGPUs()
    if gpus is None:
        gpus = hardware.machine(machine).num_gpus if machine is not None else 4
    return Emulator(gpus, gpu, link, host_link, materialize, machine)
