"""The `torch.cuda` surface learners call (device count, streams, events, memory), answered by the emulator.

`course.emulate` puts these in place of the real functions only while it is active. Anything in
`torch.cuda` not listed here reaches `_lazy_init` (or a missing `torch._C._cuda_*` binding, see
`course/cuda/cuda_bindings.py`), which then names the unsupported call instead of saying "Torch not compiled
with CUDA enabled". Random numbers are in `course/cuda/rng.py`.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import warnings

import torch

from course.cuda import (cuda_bindings, cuda_runtime, device_properties, exporting, fake_cache, graphs, legacy_types,
                         nested_jagged, rng, sharing, sync_debug, torchscript, wall_clock)
from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import CPU, current_emulator, parse_device
from course.cuda.transfers import nested_not_modelled
from course.machine import costs, topology
from course.machine.memory import DeviceMemory


def _emu():
    return current_emulator("torch.cuda")


def _queried(emu) -> int:
    """The host time a stream or event query answers at: each query is a call into the CUDA runtime that launches
    nothing, and costs the host as much as a view, so a program polling `while not event.query()` sees the GPU
    finish, as on a real one (without the cost the simulated host never moved and the loop never ended)."""
    emu.clock.host_advance(costs.HOST_VIEW_NS)
    return emu.clock.host_ns


def _index(device=None) -> int:
    emu = _emu()
    if device is None or (isinstance(device, int) and device < 0):
        return emu.current_device()
    index = parse_device(device if not isinstance(device, Stream) else device.device, emu)
    if index == CPU and getattr(_comm_hook, "device", None) is not None:
        return _comm_hook.device
    if index == CPU:  # PyTorch's torch.cuda._utils._get_device_index says the same
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return index


# DDP's buckets are host tensors to Python on emulated GPUs (course/cuda/nccl.py), so a comm hook that passes its
# bucket's device to torch.cuda (PowerSGD's `torch.cuda.synchronize(device)`) names the CPU where a GPU box names
# the bucket's GPU. While a hook runs, torch.cuda takes that CPU device for the GPU the bucket stands for.
_comm_hook = threading.local()


@contextlib.contextmanager
def comm_hook_on(device_index: int):
    """Inside a DDP comm hook for a bucket on emulated GPU `device_index` (see `_comm_hook`)."""
    outer, _comm_hook.device = getattr(_comm_hook, "device", None), device_index
    try:
        yield
    finally:
        _comm_hook.device = outer


_CUDA = 1  # c10::DeviceType::CUDA, for torch.Stream


class Stream(torch._C.Stream):
    """A queue of work on one GPU; work on different streams may overlap.

    A `torch.Stream` underneath (stream id, device index, CUDA device type), so PyTorch calls that
    take a stream, such as `tensor.record_stream(s)`, accept it; every method is the emulator's.
    Priorities are kept (clamped to the range PyTorch supports) but do not change the schedule.
    """

    def __new__(cls, device=None, priority=0, **kwargs):
        if "stream_id" in kwargs and "device_index" in kwargs:  # torch.cuda.Stream(stream_id=..., ...) wraps that one
            return cls._existing(_checked_stream_device(kwargs["device_index"]), kwargs["stream_id"])
        index = _index(device)
        stream = cls._existing(index, _emu().new_stream_id(index))
        low, high = cls.priority_range()
        stream._priority = min(max(priority, high), low)
        return stream

    def __init__(self, device=None, priority=0, **kwargs):
        pass

    @classmethod
    def _existing(cls, device_index: int, stream_id: int) -> "Stream":
        return torch._C.Stream.__new__(cls, stream_id=stream_id, device_index=device_index, device_type=_CUDA)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(least, greatest): CUDA gives (0, -5) on A100/H100 and PyTorch clamps it to the 4 priority
        levels it compiles in (c10/cuda/CUDAStream.h, max_compile_time_stream_priorities), so (0, -3)."""
        return 0, -3

    @property
    def priority(self) -> int:
        return getattr(self, "_priority", 0)

    @property
    def cuda_stream(self) -> int:
        """The `cudaStream_t` handle as an int: 0 for a default stream (CUDA's legacy null stream, on every
        device), else a made-up handle unique to the stream; nothing can be launched on it outside PyTorch."""
        return 0 if self.stream_id == 0 else (self.device_index + 1) << 32 | self.stream_id

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (version 0, the handle), which libraries such as cuda.core read."""
        return 0, self.cuda_stream

    @property
    def _ready_ns(self) -> int:
        return _emu().clock.stream_ready(self.device_index, self.stream_id)

    def _hold_until(self, time_ns: int) -> None:
        clock = _emu().clock
        with clock.lock:
            key = (self.device_index, self.stream_id)
            clock.stream_ready_ns[key] = max(clock.stream_ready(*key), time_ns)

    def wait_event(self, event: "Event") -> None:
        if event.time_ns is not None:
            self._hold_until(event.time_ns)

    def wait_stream(self, stream: "Stream") -> None:
        self._hold_until(stream._ready_ns)

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return _queried(_emu()) >= self._ready_ns

    def is_capturing(self) -> bool:
        """Capture is per thread here (course/cuda/graphs.py), and a thread captures on its current stream."""
        return graphs.is_current_stream_capturing() and self == torch.cuda.current_stream(self.device)

    def synchronize(self) -> None:
        emu = _emu()
        sync_debug.on_sync(emu)  # c10::cuda::stream_synchronize
        emu.clock.host_wait(self._ready_ns, f"stream {self.stream_id} on {self.device}")

    def __enter__(self):
        self._context = torch.cuda.StreamContext(self)
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        self._context.__exit__(*exc)

    def __repr__(self):
        return f"<torch.cuda.Stream device=cuda:{self.device_index} stream={self.stream_id}>"


def set_stream(stream: Stream | None) -> None:
    """Make `stream` current on its device and, as `torch._C._cuda_setStream` does, its device current.

    PyTorch's own `torch.cuda.StreamContext` (what `with torch.cuda.stream(s):` makes) calls this, so the
    block runs on s's device and both the device and the streams are restored after it.
    """
    if stream is None:
        return
    emu = _emu()
    emu.set_current_device(stream.device_index)
    emu.set_current_stream(stream.device_index, stream.stream_id)


class device:  # noqa: N801 - named as torch.cuda.device
    """`with torch.cuda.device(1):` makes cuda:1 the current device for `'cuda'` and `.cuda()`."""

    def __init__(self, device):
        self.index = None if device is None or device == -1 else _index(device)

    def __enter__(self):
        emu = _emu()
        self._previous = emu.current_device()
        if self.index is not None:
            emu.set_current_device(self.index)

    def __exit__(self, *exc):
        _emu().set_current_device(self._previous)


class device_of(device):  # noqa: N801 - named as torch.cuda.device_of
    """`with torch.cuda.device_of(x):` makes x's GPU current; a no-op for a CPU tensor."""

    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.is_cuda else -1)


class AcceleratorEvent:
    """A marker in a stream; two of them time the GPU work between them, in simulated milliseconds.

    `torch.Event(device, enable_timing=...)`, the device-generic event, and the base of `torch.cuda.Event`, as in
    PyTorch. As on CUDA, an event belongs to no device until first recorded (`device` is None), and after that
    only streams of that device may record it.
    """

    _handles = itertools.count(1)

    def __init__(self, device=None, *, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing
        self.time_ns: int | None = None
        self.device: torch.device | None = None
        self._handle = 0

    @property
    def cuda_event(self) -> int:
        """The `cudaEvent_t` handle as an int: 0 until the first record creates the event, then a made-up one."""
        return self._handle

    @property
    def event_id(self) -> int:
        return self._handle

    def __repr__(self):
        return f"<torch.cuda.Event {id(self):#x}>" if self.device is not None else "<torch.cuda.Event uninitialized>"

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        if self.device is None:
            self.device = torch.device("cuda", stream.device_index)
            self._handle = next(AcceleratorEvent._handles)
        elif self.device.index != stream.device_index:
            raise RuntimeError(f"Event device {self.device} does not match recording stream's device "
                               f"cuda:{stream.device_index}.")
        self.time_ns = max(_emu().clock.host_ns, stream._ready_ns)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def query(self) -> bool:
        return self.time_ns is None or _queried(_emu()) >= self.time_ns

    def synchronize(self) -> None:
        if self.time_ns is not None:
            _emu().clock.host_wait(self.time_ns, "event.synchronize")

    def elapsed_time(self, end_event: "Event") -> float:
        """The checks of `CUDAEvent::elapsed_time` as torch 2.13 ships them (include/c10/cuda/CUDAEvent.h): two
        ValueErrors, then a RuntimeError for an event the GPU has not reached, before cudaEventElapsedTime could
        say "device not ready"."""
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if self.time_ns is None or end_event.time_ns is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        if self.device != end_event.device:  # cudaEventElapsedTime times events of one device only
            raise RuntimeError(f"CUDA error: invalid resource handle\n(the events were recorded on {self.device} and "
                               f"{end_event.device}: elapsed_time compares events of the same GPU)")
        if _emu().clock.host_ns < max(self.time_ns, end_event.time_ns):  # query() of both, without its host cost
            raise RuntimeError("Both events must be completed before calculating elapsed time.\n(the GPU has not "
                               "reached the end event yet: call end_event.synchronize() or torch.cuda.synchronize() "
                               "before elapsed_time)")
        return (end_event.time_ns - self.time_ns) / 1e6


class Event(AcceleratorEvent):
    """`torch.cuda.Event`, a `torch.Event` of the current GPU."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        super().__init__(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def is_available() -> bool:
    return _emu().num_gpus > 0  # CUDA_VISIBLE_DEVICES="" hides every GPU


def is_initialized() -> bool:
    return True


def device_count() -> int:
    return _emu().num_gpus


def current_device() -> int:
    return _emu().current_device()


def can_device_access_peer(device, peer_device) -> bool:
    """`torch.cuda.can_device_access_peer`: what the peer copies are costed by. Without a machine preset every pair
    copies directly over the link; in a preset, the pairs a switch or NVLink bricks join do, and the others stage
    their copies through host memory (topology.reads_host_memory). A GPU is never its own peer (CUDA answers 0)."""
    emu = _emu()
    device = torch.cuda._utils._get_device_index(device, optional=True)
    peer_device = torch.cuda._utils._get_device_index(peer_device)
    if not 0 <= device < emu.num_gpus:
        raise AssertionError("Invalid device id")
    if not 0 <= peer_device < emu.num_gpus:
        raise AssertionError("Invalid peer device id")
    if device == peer_device:
        return False
    visible = emu.visible_devices()
    return emu.machine is None or not topology.reads_host_memory(emu.machine, visible[device], visible[peer_device])


def set_device(device) -> None:
    _emu().set_current_device(_index(device))


def get_device_properties(device=None) -> device_properties.DeviceProperties:
    return device_properties.of(_emu().gpu, _index(device))


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def get_device_capability(device=None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """Native bfloat16 from sm80; before that torch 2.13 answers True unless `including_emulation=False`, since a
    bfloat16 tensor can be made there (its `_check_bf16_tensor_supported`), so bf16 autocast runs on a V100 or T4."""
    return including_emulation or _emu().gpu.compute_capability >= (8, 0)


def synchronize(device=None) -> None:
    _emu().clock.synchronize([_index(device)])
    wall_clock.note_if_wall_clock()


def _sleep(cycles: int) -> None:
    """`torch.cuda._sleep`: a kernel that spins for `cycles` SM clock cycles on the current stream (PyTorch's
    stream and event tests use it to keep a stream busy)."""
    emu = _emu()
    device = emu.current_device()
    emu.clock.launch("kernel", "aten::_sleep", device, emu.current_stream_id(device),
                     round(cycles / emu.gpu.boost_clock_ghz))


def _checked_stream_device(index: int) -> int:
    """c10's stream functions check the index themselves (`check_gpu`, c10/cuda/CUDAStream.cpp), before any CUDA
    call could say "invalid device ordinal"."""
    num_gpus = _emu().num_gpus
    if not 0 <= index < num_gpus:
        raise RuntimeError(f"Device index value {index} is out of index range [0, {num_gpus})")
    return index


def _stream_index(device) -> int:
    if device is None or isinstance(device, Stream):
        return _index(device)
    index = device if isinstance(device, int) else torch.device(device).index
    return _index(device) if index is None or index < 0 else _checked_stream_device(index)


def current_stream(device=None) -> Stream:
    index = _stream_index(device)
    return Stream._existing(index, _emu().current_stream_id(index))


def default_stream(device=None) -> Stream:
    return Stream._existing(_stream_index(device), 0)


def _memory() -> DeviceMemory:
    return _emu().memory


def memory_allocated(device=None) -> int:
    return _memory().allocated[_index(device)]


def max_memory_allocated(device=None) -> int:
    return _memory().peak[_index(device)]


def reset_peak_memory_stats(device=None) -> None:
    _memory().reset_peak(_index(device))


def mem_get_info(device=None) -> tuple[int, int]:
    total = _memory().capacity_bytes
    return total - memory_allocated(device), total


def ipc_collect() -> None:
    """`torch.cuda.ipc_collect`: frees what CUDA IPC left cached for tensors other processes stopped using. Nothing
    is cached here (a GPU tensor reaches another process as host memory, course/cuda/sharing.py): nothing to free,
    as after `empty_cache`, which the `torch_gc()` helpers of chat-model demos call just before it."""


def _lazy_init() -> None:
    """Where torch.cuda's own functions start; any that get here are not modelled, and are named. PyTorch's Python
    bindings call it too, before a factory with a CUDA device runs where the emulator's mode is off (inside a
    program's `__torch_dispatch__`): that factory is modelled (course/cuda/cuda_key_factories.py)."""
    caller = sys._getframe(1)
    if not caller.f_globals.get("__name__", "").startswith(("torch.cuda", "torch.multiprocessing")) \
            or caller.f_code.co_name == "cudart":  # the runtime module it returns is the emulator's (cuda_runtime.py)
        return
    raise not_modelled(cuda_bindings.caller_in_torch(),
                       "it models devices, streams, events, synchronize, memory statistics and random "
                       "numbers; run this part on a real GPU")


class _LegacyTensorMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.Tensor) and obj.is_cuda and obj.dtype == cls.dtype


_legacy_warned = False


def _legacy_tensor_type(name: str, dtype: torch.dtype):
    """`torch.cuda.FloatTensor(2)`, `torch.cuda.LongTensor([1, 2], device=1)`: the CPU constructor's tensor, on
    the current GPU or `device` (a copy from the host, as the legacy constructor does for data), with the warning
    PyTorch gives once (torch/csrc/tensor/python_tensor.cpp, TORCH_WARN_ONCE). Given a tensor, it is an alias of a
    GPU tensor of its dtype (on that tensor's GPU) and refuses any other, as tensor_new.cpp does."""

    def __new__(cls, *args, device=None, **kwargs):
        global _legacy_warned
        if not _legacy_warned or torch.is_warn_always_enabled():
            _legacy_warned = True
            warnings.warn("The torch.cuda.*DtypeTensor constructors are no longer recommended. It's best to use "
                          "methods such as torch.tensor(data, dtype=*, device='cuda') to create tensors.",
                          UserWarning, stacklevel=2)
        if args and isinstance(args[0], torch.Tensor):  # the C++ parser's `new(Tensor other)`: an alias
            if device is not None or kwargs or len(args) > 1:
                raise RuntimeError("Legacy tensor constructor of the form torch.Tensor(tensor, device=device) is not "
                                   "supported.  Use torch.tensor(...) or torch.as_tensor(...) instead.")
            if not (args[0].is_cuda and args[0].dtype == dtype):
                raise legacy_types.type_mismatch(name, "cuda", args[0])
            return torch.ops.aten.alias.default(args[0])
        return getattr(torch, name)(*args, **kwargs).cuda(device)

    return _LegacyTensorMeta(name, (), {"__new__": __new__, "dtype": dtype, "is_cuda": True,
                                        "__module__": "torch.cuda"})


LEGACY_TENSOR_TYPES = {
    name: _legacy_tensor_type(name, dtype) for name, dtype in [
        ("FloatTensor", torch.float32), ("DoubleTensor", torch.float64), ("HalfTensor", torch.float16),
        ("BFloat16Tensor", torch.bfloat16), ("ByteTensor", torch.uint8), ("CharTensor", torch.int8),
        ("ShortTensor", torch.int16), ("IntTensor", torch.int32), ("LongTensor", torch.int64),
        ("BoolTensor", torch.bool)]
}


def caching_allocator_alloc(size: int, device=None, stream=None) -> int:
    """`torch.cuda.caching_allocator_alloc`: `size` bytes counted on the emulated GPU until
    `caching_allocator_delete`, at the address `memory_snapshot()` shows. Nothing is there to read or write: a
    program that hands the address to its own CUDA kernels has none to run here."""
    return _memory().allocate_raw(_index(device), size)


def caching_allocator_delete(mem_ptr: int) -> None:
    _memory().free_raw(mem_ptr)


class ExternalStream(Stream):
    """`torch.cuda.ExternalStream(handle)`: a stream known by its `cudaStream_t`. Only the emulator's own streams have
    handles here (`Stream.cuda_stream`), so only those can be wrapped; 0 is the current GPU's default stream."""

    def __new__(cls, stream_ptr, device=None, **kwargs):
        if stream_ptr == 0:
            return cls._existing(_index(device), 0)
        index, stream_id = (stream_ptr >> 32) - 1, stream_ptr & 0xFFFFFFFF
        if not _emu().has_stream(index, stream_id):
            raise not_modelled("torch.cuda.ExternalStream (a stream made outside PyTorch)",
                               f"no other library makes CUDA streams here and {stream_ptr:#x} is none of the "
                               "emulator's; use torch.cuda.Stream")
        return cls._existing(index, stream_id)


class MemPool:
    """`torch.cuda.MemPool`: a private pool of the caching allocator (for NCCL buffers or a custom allocator)."""

    def __new__(cls, *args, **kwargs):
        raise not_modelled("torch.cuda.MemPool (a private memory pool)",
                           "allocate without it: the emulated GPU's memory counts are the same in any pool")


def _external_stream(*args, **kwargs):
    return ExternalStream(*args, **kwargs)


def _philox_offset(name):
    def refuse(*args, **kwargs):
        raise not_modelled(f"torch.cuda.{name} (the Philox offset of CUDA's generator)",
                           "an emulated GPU draws from the CPU generator, which has no offset; use "
                           "torch.cuda.get_rng_state and set_rng_state")
    return refuse


_compile_warned = False


def compile(model=None, **options):  # noqa: A001 - named as torch.compile
    """`torch.compile` while emulating: the model or function runs eagerly, with a one-time warning.

    Dynamo cannot trace emulated tensors. Eager numbers are the compiled numbers up to rounding; the
    clock then times eager kernels, without fusion. A module comes back wrapped as PyTorch wraps it
    (`OptimizedModule`, `_orig_mod`, "_orig_mod." state_dict keys), so checkpoint code runs unchanged.
    """
    global _compile_warned
    if model is None:
        return functools.partial(compile, **options)
    if not _compile_warned:
        _compile_warned = True
        warnings.warn("torch.compile is not modelled by the GPU emulator (course.emulate): running eagerly, "
                      "with the same numbers; simulated times are those of eager kernels.", stacklevel=2)
    if isinstance(model, torch.nn.Module):
        from torch._dynamo.eval_frame import DisableContext, OptimizedModule

        return OptimizedModule(model, DisableContext())
    return model


_fake_from_real = torch._subclasses.fake_tensor.FakeTensorConverter.from_real_tensor


def _fake_of(self, fake_mode, t, *args, **kwargs):
    """A fake tensor made from a real one (`torch.library.opcheck`, FakeTensorMode.from_tensor, tracing): refused,
    naming it, for an emulated GPU tensor, whose fake would be a C++ tensor on a CUDA device that a CPU build's
    autograd aborts the whole process on; PyTorch's own otherwise."""
    if isinstance(t, torch.Tensor) and t.is_cuda:
        raise not_modelled("A fake tensor (FakeTensorMode, torch.library.opcheck, tracing) of a tensor on an emulated "
                           "GPU", "run this check on CPU tensors (the op's fake kernel is the same), or skip it")
    return _fake_from_real(self, fake_mode, t, *args, **kwargs)


def _host_only_dlpack(to_dlpack):
    """DLPack export (`to_dlpack`, `__dlpack__`) of an emulated GPU tensor to a capsule: refused,
    naming it. PyTorch's C++ would read the wrapper's storage, which holds nothing, and crash the process; a capsule
    of the CPU values inside would tell the consumer (NumPy, CuPy, JAX) the wrong device."""

    @functools.wraps(to_dlpack)
    def refusing(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            raise not_modelled("DLPack export of a tensor on an emulated GPU", "copy it to the host with .cpu() first")
        return to_dlpack(tensor, *args, **kwargs)

    return refusing


def _torch_to_torch_dlpack(from_dlpack):
    """`torch.from_dlpack(gpu_tensor)`: for a torch tensor, PyTorch's exchange gives a tensor on the same device over
    the same memory, outside autograd, which `detach()` is, after `Tensor.__dlpack__`'s own refusals (torch/_tensor.py).
    With `device=` or `copy=`, a capsule, or another library's array, it goes on as before (GPU capsules: refused)."""

    @functools.wraps(from_dlpack)
    def exchanging(ext_tensor, *args, **kwargs):
        if not (isinstance(ext_tensor, torch.Tensor) and ext_tensor.is_cuda) or args or \
                any(value is not None for value in kwargs.values()):
            return from_dlpack(ext_tensor, *args, **kwargs)
        if ext_tensor.requires_grad:
            raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
        if ext_tensor.is_conj():
            raise BufferError("Can't export tensors with the conjugate bit set")
        if ext_tensor.layout != torch.strided:
            raise BufferError("Can't export tensors with layout other than torch.strided")
        if ext_tensor.device.index != torch.cuda.current_device():
            raise BufferError(f"Can't export tensors on a different CUDA device index. Expected: "
                              f"{ext_tensor.device.index}. Current device: {torch.cuda.current_device()}.")
        return ext_tensor.detach()

    return exchanging


DLPACK_PATCHES = [(torch._C, {name: _host_only_dlpack(getattr(torch._C, name))
                              for name in ("_to_dlpack", "_to_dlpack_versioned")}),
                  (torch.utils.dlpack, {"to_dlpack": _host_only_dlpack(torch.utils.dlpack.to_dlpack),
                                        "from_dlpack": _torch_to_torch_dlpack(torch.utils.dlpack.from_dlpack)}),
                  (torch, {"to_dlpack": _host_only_dlpack(torch.to_dlpack),
                           "from_dlpack": _torch_to_torch_dlpack(torch.from_dlpack)})]


def _host_only_nested(make):
    """torch.nested's constructors of strided-layout nested tensors given a GPU device or GPU tensors: refused,
    naming it (transfers.py). Jagged ones are Python tensors over ordinary ones, and run (nested_jagged.py)."""

    @functools.wraps(make)
    def refusing(*args, **kwargs):
        if make.__name__ == "nested_tensor_from_jagged" or any(
                a is torch.jagged for a in (*args, kwargs.get("layout"))):
            return make(*args, **kwargs)
        device = kwargs.get("device")
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if (device is not None and torch.device(device).type == "cuda") or any(
                isinstance(t, torch.Tensor) and t.is_cuda for t in leaves):
            raise nested_not_modelled()
        return make(*args, **kwargs)

    return refusing


NESTED_PATCHES = [(torch.nested, {name: _host_only_nested(getattr(torch.nested, name)) for name in
                                  ("nested_tensor", "as_nested_tensor", "nested_tensor_from_jagged", "narrow")})]


PATCHES = {
    "is_available": is_available,
    "is_initialized": is_initialized,
    # what torch.utils.checkpoint reads to stash the GPUs' random states, as after CUDA's lazy init on a GPU box
    "_initialized": True,
    "_is_in_bad_fork": sharing.in_bad_fork,
    "device_count": device_count,
    "current_device": current_device,
    "set_device": set_device,
    "device": device,
    "get_device_name": get_device_name,
    "get_device_properties": get_device_properties,
    "get_device_capability": get_device_capability,
    "is_bf16_supported": is_bf16_supported,
    "synchronize": synchronize,
    "_sleep": _sleep,
    "Stream": Stream,
    "set_stream": set_stream,
    "current_stream": current_stream,
    "default_stream": default_stream,
    "Event": Event,
    "device_of": device_of,
    "init": lambda: None,
    "get_allocator_backend": lambda: "native",
    "can_device_access_peer": can_device_access_peer,
    "ipc_collect": ipc_collect,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": memory_allocated,
    "max_memory_reserved": max_memory_allocated,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "mem_get_info": mem_get_info,
    "set_sync_debug_mode": sync_debug.set_sync_debug_mode,
    "get_sync_debug_mode": sync_debug.get_sync_debug_mode,
    "is_current_stream_capturing": graphs.is_current_stream_capturing,
    "_lazy_init": _lazy_init,
    "_cudart": cuda_runtime.RUNTIME,
    "CUDAGraph": graphs.CUDAGraph,
    "graph_pool_handle": graphs.graph_pool_handle,
    "ExternalStream": ExternalStream,
    "MemPool": MemPool,
    "get_stream_from_external": _external_stream,
    "_set_rng_state_offset": _philox_offset("_set_rng_state_offset"),
    "_get_rng_state_offset": _philox_offset("_get_rng_state_offset"),
    "caching_allocator_alloc": caching_allocator_alloc,
    "caching_allocator_delete": caching_allocator_delete,
    **LEGACY_TENSOR_TYPES,
}

TORCH_PATCHES = {  # the device-generic classes torch.nn.parallel and others call with a device index
    "Stream": Stream,
    "Event": AcceleratorEvent,
    "compile": compile,
}

# torch.accelerator's memory API asks torch._C's accelerator bindings; torch.cuda's answers for the GPUs. Its functions
# live in torch.accelerator.memory and are re-exported by torch.accelerator: both names are patched.
ACCELERATOR_MEMORY_PATCHES = {
    "empty_cache": lambda: torch.cuda.empty_cache(),
    "empty_host_cache": lambda: None,
    "memory_stats": lambda device_index=None, /: torch.cuda.memory_stats(device_index),
    "memory_allocated": lambda device_index=None, /: torch.cuda.memory_allocated(device_index),
    "max_memory_allocated": lambda device_index=None, /: torch.cuda.max_memory_allocated(device_index),
    "memory_reserved": lambda device_index=None, /: torch.cuda.memory_reserved(device_index),
    "max_memory_reserved": lambda device_index=None, /: torch.cuda.max_memory_reserved(device_index),
    "reset_accumulated_memory_stats": lambda device_index=None, /: torch.cuda.reset_accumulated_memory_stats(
        device_index),
    "reset_peak_memory_stats": lambda device_index=None, /: torch.cuda.reset_peak_memory_stats(device_index),
    "get_memory_info": lambda device_index=None, /: torch.cuda.mem_get_info(device_index),
}


def _device_capability(device=None, /):
    """torch 2.13's CUDA device guard answers no capability query (only XPU's and the meta device's do), so
    `torch.accelerator.get_device_capability()` stops on a GPU box with c10's words."""
    raise RuntimeError("Backend doesn't support getting device capabilities.")


ACCELERATOR_PATCHES = {
    "is_available": is_available,
    "device_count": device_count,
    "current_accelerator": lambda check_available=False: torch.device("cuda"),
    "current_device_index": current_device,
    "set_device_index": set_device,
    "synchronize": synchronize,
    "current_stream": current_stream,
    "device_index": device,
    "set_stream": set_stream,
    "current_device_idx": current_device,
    "set_device_idx": set_device,
    "get_device_capability": _device_capability,
    **ACCELERATOR_MEMORY_PATCHES,
}


def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
    """`torch._C._cuda_setStream`, which PyTorch's test harness calls directly (common_utils.CudaNonDefaultStream)."""
    set_stream(Stream._existing(device_index, stream_id))


def _stream_triple(stream: Stream) -> tuple[int, int, int]:
    return stream.stream_id, stream.device_index, _CUDA


# The device and stream bindings under torch.cuda's Python, for the code that calls them directly. Not
# `_cuda_getDeviceCount`: torch.cuda._is_compiled() looks for it, and torch._dynamo would then import CUDA-only bindings.
DEVICE_BINDINGS = {
    "_cuda_setStream": _set_stream_by_id,
    "_cuda_getCurrentStream": lambda device: _stream_triple(current_stream(device)),
    "_cuda_getDefaultStream": lambda device: _stream_triple(default_stream(device)),
    "_cuda_setDevice": lambda device: set_device(device),  # own objects: torch._dynamo's rules tell the two apart
    "_cuda_getDevice": lambda: current_device(),
    "_cuda_synchronize": lambda: synchronize(),
}


def module_patches(num_gpus: int) -> list[tuple[object, dict]]:
    """Patches beyond torch.cuda's namespace: torch._C's CUDA bindings, torch.cuda.memory's and
    torch.cuda.random's own imports, torch.accelerator.memory's functions, torch.Generator, torch.export, DLPack
    export, fake tensors of GPU tensors and the fake dispatch cache (fake_cache.py), torch.nested's constructors and
    jagged tensors' wrapper, TorchScript's save and load."""
    return (cuda_bindings.PATCHES + [(torch._C, DEVICE_BINDINGS), (torch.cuda.memory, {"mem_get_info": mem_get_info}),
                                    (torch.accelerator.memory, ACCELERATOR_MEMORY_PATCHES)]
            + rng.patches(num_gpus) + [(torch.export, {"export": exporting.export})] + DLPACK_PATCHES
            + [(torch._subclasses.fake_tensor.FakeTensorConverter, {"from_real_tensor": _fake_of})] + fake_cache.PATCHES
            + NESTED_PATCHES
            + nested_jagged.PATCHES + torchscript.patches())
