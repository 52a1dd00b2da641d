"""Where `device="cuda:1"`, `.to()`, `.cuda()` and friends are caught before CPU-only PyTorch refuses them.

A CPU build raises "Torch not compiled with CUDA enabled" as soon as a Python call names a CUDA
device, before any op reaches the dispatcher, so these calls are taken over at the
`__torch_function__` level: by `EmulatorMode` for plain tensors and factories, and by
`EmulatedTensor.__torch_function__` in threads where the mode is not pushed.
"""
from __future__ import annotations

import sys

import torch
import torch.utils._device
from torch.nn._reduction import get_enum as _reduction_enum
from torch.overrides import TorchFunctionMode

from course.cuda import (aliasing_factories, attention, cudnn_rnn, device_asserts, forked_rng, functorch_layers,
                         fused_dropout, graph_moves, half_fft, inner_factories, packed_sequences, storages, subclasses)
from course.cuda.legacy_types import gpu_by_default, holds_gpu_tensors, on_host
from course.cuda.devices import CPU, EmulatedTensor, KEEP_FRAMES, current_emulator, device_name, parse_device, wrap
from course.cuda.tensor_attributes import instance_dict, set_instance_dict
from course.cuda.transfers import (copy_into, copy_with_grad, device_of, is_pinned, move, nbytes_of, pin,
                                   program_dispatch_mode, to_host_copy)
from course.machine import costs


RealDevice = torch.device  # PyTorch's own class, kept before the emulator puts `torch.device` below in its place


class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, RealDevice)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, RealDevice)


class device(metaclass=_DeviceMeta):
    """`torch.device` while the emulator runs: `torch.device(1)` is cuda:1, as on a GPU box.

    A CPU build has no accelerator, so PyTorch itself refuses a bare index ("Cannot access accelerator
    device when none is available"). Everything else, and every instance, is PyTorch's own `torch.device`.
    """

    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and _is_index(args[0]):
            return RealDevice("cuda", args[0])
        return RealDevice(*args, **kwargs)


device.__module__, device.__qualname__ = "torch", "device"  # pickles as torch.device


def fx_graph_patches() -> dict:
    """torch.fx's builtins for generated code, with `device` as the class `torch.device` is while emulating: FX
    defines `device` in a graph's code only if its registered class is `torch.device`, and renames a global that
    is not the registered one (torch/fx/graph.py, add_global and _Namespace.create_name); with PyTorch's own class
    registered, a graph naming a device raises NameError when run."""
    graph = torch.fx.graph
    return {"_custom_builtins": {**graph._custom_builtins, "device": graph._CustomBuiltin("from torch import device",
                                                                                        device)},
            "_illegal_names": {**graph._illegal_names, "device": device}}


def _unwrap(value):
    return value._inner if isinstance(value, EmulatedTensor) else value


_FROM_HOST_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
# Sparse constructors take their parts' values: without a size they read the indices for one (a meta tensor has
# none to read), and what they hold is their parts, not the dense shape. Like tensors of host data, they are made
# on the host first.
_SPARSE_FROM_PARTS = {torch.sparse_coo_tensor, torch.sparse_csr_tensor, torch.sparse_csc_tensor,
                      torch.sparse_bsr_tensor, torch.sparse_bsc_tensor, torch.sparse_compressed_tensor}


_UNINITIALISED = {"empty", "empty_like", "empty_strided", "empty_permuted"}


def _create_on_device(func, device, args, kwargs):
    """A factory call aimed at a fake GPU: make the tensor on the CPU (or meta) and move it there."""
    emu = current_emulator(f"torch.{getattr(func, '__name__', func)}")
    index = parse_device(device, emu)
    if index == CPU:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **dict(kwargs, device="cpu"))
    if program_dispatch_mode():  # it sees the factory itself, as on a GPU box (course/cuda/cuda_key_factories.py)
        with torch._C.DisableTorchFunction():
            return func(*args, **dict(kwargs, device=torch.device("cuda", index)))
    requires_grad = kwargs.pop("requires_grad", False)
    kwargs.pop("pin_memory", None)
    if func in aliasing_factories.ALIASING:
        aliasing_factories.refuse_host_alias(func, args, kwargs, index)
    args = tuple(_unwrap(a) for a in args)
    # and keyword ones: `linspace(start=gpu_scalar, ...)` (torch.signal.windows.kaiser) made a GPU tensor inside a GPU
    # tensor, whose .cpu() stayed on the GPU
    kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
    with torch._C.DisableTorchFunction():
        # inside a torch.func transform the tensor comes back wrapped (a random one batched: a draw per element);
        # one made of host data is made there (its data is in host memory already; torch.tensor(..., device="meta")
        # inside grad would mutate a captured tensor)
        from_data = emu.materialize and (func in _SPARSE_FROM_PARTS or func in _FROM_HOST_DATA)
        shape_only, layers = functorch_layers.peeled(_sized(func, args, kwargs, emu.materialize, from_data))
        nbytes = nbytes_of(shape_only)
        block = emu.memory.allocate(index, nbytes)  # refuse before the CPU allocates anything
        inner = shape_only if not emu.materialize or not shape_only.is_meta else functorch_layers.peeled(
            _on_host(func, args, kwargs, nbytes, index))[0]
        if func in aliasing_factories.ALIASING and emu.materialize:
            inner = inner.clone()  # as_tensor/asarray alias host data; a GPU tensor owns its memory
    if func in _FROM_HOST_DATA or func in _SPARSE_FROM_PARTS:
        block.ready_ns = emu.clock.launch("copy", "copy cpu->cuda", index, emu.current_stream_id(index),
                                          costs.copy_ns(emu.host_link, nbytes, pinned=False),
                                          nbytes=nbytes, peer="cpu")
        emu.clock.host_wait(block.ready_ns, "wait for copy cpu->cuda")
    elif getattr(func, "__name__", "") not in _UNINITIALISED:  # torch.empty only asks the allocator for memory
        duration = costs.kernel_ns(emu.gpu, 0, nbytes, inner.dtype, False, False)
        block.ready_ns = emu.clock.launch("kernel", f"aten::{getattr(func, '__name__', 'fill')}", index,
                                          emu.current_stream_id(index), duration, nbytes=nbytes)
    inner = functorch_layers.peeled(inner.detach())[0]  # an op inside a transform: its result comes back wrapped
    return functorch_layers.rewrapped(wrap(inner, index, block, requires_grad), layers)


_QUANTIZED = {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _sized(func, args, kwargs, materialize: bool, from_data: bool) -> torch.Tensor:
    """The new tensor on the meta device, to size it before anything is allocated. Made of host data, or quantized
    (`torch._empty_affine_quantized`, which a CUDA build runs for QuantizedCUDA, has no meta kernel), its host tensor,
    which holds the values anyway, is made first."""
    if from_data or (materialize and kwargs.get("dtype") in _QUANTIZED):
        return func(*args, **dict(kwargs, device="cpu"))
    return func(*args, **dict(kwargs, device="meta"))


def _on_host(func, args, kwargs, nbytes: int, index: int) -> torch.Tensor:
    """The values of a new GPU tensor, held in this computer's memory, which may be smaller than the GPU's. A random
    one is drawn from GPU `index`'s stream (course/cuda/forked_rng.py)."""
    kwargs = dict(kwargs, device="cpu")
    try:
        if forked_rng.leaves_out(index):
            return forked_rng.draw_outside(func, args, kwargs)
        return func(*args, **kwargs)
    except RuntimeError as error:
        if "can't allocate memory" not in str(error):
            raise
        raise MemoryError(f"The emulated GPU has room for this {nbytes / 2**30:.2f} GiB tensor, but the computer "
                          "running the emulator cannot hold its values: use course.emulate(..., materialize=False) "
                          "to work with shapes, times and memory only.") from None


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cuda_index(value):
    """A bare device index as a GPU box reads it: `1` is cuda:1 (a CPU build has no accelerator for it)."""
    return RealDevice("cuda", value) if _is_index(value) else value


def _parse_to(*args, **kwargs):
    """Tensor.to / Module.to argument parsing, with `.to(rank)` meaning `.to("cuda:<rank>")`; no `copy=`."""
    if args and isinstance(args[0], EmulatedTensor):  # `module.to(gpu_x)`: C++ would read the wrapper's CPU device
        non_blocking = args[1] if len(args) > 1 else kwargs.get("non_blocking", False)
        return args[0].device, args[0].dtype, non_blocking, kwargs.get("memory_format")
    if args and not isinstance(args[0], torch.Tensor):
        args = (_cuda_index(args[0]),) + args[1:]
    kwargs = {k: _cuda_index(v) if k == "device" else v for k, v in kwargs.items() if k != "copy"}
    with torch._C.DisableTorchFunction():
        return torch._C._nn._parse_to(*args, **kwargs)


def _positional_copy(args) -> tuple[tuple, bool]:
    """Tensor.to's `copy` given in its place among the positional arguments (`x.to(torch.float64, False, True)`,
    `x.to("cuda", torch.float64, False, True)`), which `_parse_to` refuses: the arguments without it, and it."""
    at = 2 if args and isinstance(args[0], (torch.dtype, torch.Tensor)) else 3
    if len(args) > at:
        return args[:at] + args[at + 1:], bool(args[at])
    return args, False


def _to(self, *args, **kwargs):
    args, copy = _positional_copy(args)
    if args and isinstance(args[0], torch.Tensor):
        other = args[0]
        device, dtype, memory_format = other.device, other.dtype, None
        non_blocking = args[1] if len(args) > 1 else kwargs.get("non_blocking", False)
    else:
        device, dtype, non_blocking, memory_format = _parse_to(*args, **kwargs)
    result = self
    if device is not None and device.type == "meta":  # _parse_to and other.device give a torch.device
        return _to_meta(self, dtype)
    if device is not None:
        index = parse_device(device)
        if _sharded_on_host(self, index):
            result = _move_shard(self, index, non_blocking)
        elif not _sharded_and_on(self, index):
            result = move(result, index, non_blocking)
    if dtype is not None and dtype != result.dtype:
        with torch._C.DisableTorchFunctionSubclass():
            result = torch.Tensor.to(result, dtype)
    result = _in_memory_format(result, kwargs.get("memory_format", memory_format))
    if (copy or kwargs.get("copy")) and result is self:
        result = self.clone()
    return result


def _to_meta(tensor, dtype):
    """`gpu_tensor.to("meta")` (the base model of torch.func's ensembling tutorial): a shape-only tensor, as on a
    GPU; it has no values for a gradient to carry back, so it is not tied to the tensor's graph."""
    with torch._C.DisableTorchFunction():
        return _unwrap(tensor).detach().to("meta", dtype)


def _sharded_and_on(tensor, index) -> bool:
    """A DTensor whose local shard is on emulated GPU `index` already (`clip_grad_norm_` moves its per-shard norms
    to the first gradient's device): nothing to move, as for a GPU tensor, and its wrapper has no storage to copy."""
    local = getattr(tensor, "_local_tensor", None)
    return not isinstance(tensor, EmulatedTensor) and isinstance(local, EmulatedTensor) and local._device_index == index


def _sharded_on_host(tensor, index) -> bool:
    """A DTensor whose local shard is a host tensor, sent to a GPU (FSDP2's CPU-offloaded parameters, which
    `get_model_state_dict` gathers with `value.to("cuda")`)."""
    local = getattr(tensor, "_local_tensor", None)
    return index != CPU and isinstance(local, torch.Tensor) and not isinstance(local, EmulatedTensor) and \
        not isinstance(tensor, EmulatedTensor)


def _move_shard(tensor, index, non_blocking):
    """What DTensor's own `_to_copy` does on a GPU box: the local shard moves, the placements stay. The wrapper has
    no storage to copy, and its shard's move must be the emulator's, so it is done here, differentiably."""
    moved = move(tensor.to_local(), index, non_blocking)
    return type(tensor).from_local(moved, tensor.device_mesh, tensor.placements, run_check=False,
                                   shape=tensor.shape, stride=tensor.stride())


def _in_memory_format(tensor, memory_format):
    """`.to(memory_format=torch.channels_last)` and friends: the layout asked for, by PyTorch's own rule (a copy
    unless the tensor's suggested format is that one already; `contiguous` would keep a (1, 3, 1, 1) tensor's
    strides, where `to` gives it channels-last ones)."""
    if memory_format is None or memory_format is torch.preserve_format:
        return tensor
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.to(tensor, memory_format=memory_format)


def _cuda(self, device=None, non_blocking=False, memory_format=None):
    emu = current_emulator(".cuda()")
    if device is not None and not _is_index(device) and torch.device(device).type != "cuda":
        raise RuntimeError("Invalid device, must be cuda device")
    index = emu.current_device() if device is None else parse_device(device, emu)
    return _in_memory_format(move(self, index, non_blocking), memory_format)


def _cpu(self, memory_format=None):
    return _in_memory_format(move(self, CPU), memory_format)


def _copy_(self, src, non_blocking=False):
    # A number for `src` (`grad.copy_(float("nan"))`) becomes a wrapped-number tensor, which any device takes.
    if not isinstance(src, torch.Tensor) or device_of(self) == device_of(src):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.copy_(self, src, non_blocking)
    if torch.is_grad_enabled() and (self.requires_grad or src.requires_grad):
        return copy_with_grad(self, src, non_blocking)
    copy_into(self, src, non_blocking)
    if isinstance(self, EmulatedTensor):  # it wrote the inner tensor: autograd must see the write, as for copy_
        torch.autograd.graph.increment_version(self)
    return self


def _pin_memory(self, device=None):
    if device_of(self) != CPU:
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
    return pin(self)


def _is_pinned(self, device=None):
    return is_pinned(self)


def _numpy(self, force=False):
    if force and device_of(self) != CPU:  # PyTorch's `t.detach().cpu().resolve_conj().resolve_neg().numpy()`
        return _numpy(self.detach().cpu(), force=True)
    if device_of(self) != CPU:
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )
    tensor = to_host_copy(self) if isinstance(self, EmulatedTensor) else self
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.numpy(tensor, force=force)


def _array(self, dtype=None):
    """`numpy.asarray(tensor)`: `Tensor.__array__` calls `numpy()`, the checks above included."""
    array = _numpy(self)
    return array if dtype is None else array.astype(dtype, copy=False)


def _tolist(self):
    if not isinstance(self, EmulatedTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.tolist(self)
    return to_host_copy(self).tolist()


def _new_tensor(self, data, **kwargs):
    if holds_gpu_tensors(data):  # `x.new_tensor([gpu_loss_a, gpu_loss_b])`: C++ would read the GPU scalars in place
        data = on_host(data)
    if isinstance(self, EmulatedTensor) and kwargs.get("device") is None:
        kwargs["device"] = self.device
    kwargs.setdefault("dtype", self.dtype)
    if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
        return _create_on_device(torch.tensor, kwargs.pop("device"), (data,), kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.new_tensor(self, data, **kwargs)


def _type_as(self, other):
    """`x.type_as(y)` is `x.to(y.options())` in ATen: y's device too, which C++ would read off the wrapper as the
    CPU's (a host mask `.type_as(gpu_x)` stayed on the host, a GPU tensor `.type_as(host_double)` on its GPU)."""
    return _to(self, other)


# Factories shaped like a tensor argument: given a host `device=`, they make a host tensor whatever the argument's
# device (`torch.zeros_like(gpu_x, device="cpu")`), which the op's kernel, seeing a GPU argument, would not.
_SHAPED_LIKE = frozenset({torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                          torch.randn_like, torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
                          torch.Tensor.new_empty, torch.Tensor.new_full, torch.Tensor.new_empty_strided})


_FILLED_LIKE = frozenset({torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like})


def _dtensor(tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _dtensor_shaped_like(func, args, kwargs):
    """`torch.empty_like(dtensor, device="cuda")` (FSDP2's `to_empty` after meta-device init): a DTensor over the
    local tensor made so, as DTensor's dispatch makes it on a GPU box. Its aten op cannot be called here: torch's
    bindings would initialise the CPU build's CUDA for the `device=` before DTensor's dispatch is reached."""
    dtensor = args[0]
    local = _route_torch_function(func, (dtensor._local_tensor, *args[1:]), kwargs)
    return type(dtensor).from_local(local, dtensor.device_mesh, dtensor.placements, run_check=False,
                                    shape=dtensor.shape, stride=dtensor.stride())


def _new(self, *args, **kwargs):
    """Legacy `x.new(data)` / `x.new(*sizes)`: x's dtype and, unless `device=` says otherwise, x's device; for a
    sparse x, `x.new(indices, values, size)` (SparseAdam) is a sparse tensor made of them, unchecked and without
    the warning that checks are off, as the legacy constructor makes it."""
    if self.layout is torch.sparse_coo and args and isinstance(args[0], torch.Tensor):
        return torch.sparse_coo_tensor(*args, **{"check_invariants": False, **kwargs})
    device = kwargs.pop("device", None)
    if device is not None:  # tensor_new.cpp's checks of legacy_tensor_new, which C++ would make against the CPU
        if args and isinstance(args[0], torch.Tensor):
            raise RuntimeError("Legacy tensor new of the form tensor.new(tensor, device=device) is not supported.  "
                               "Use torch.as_tensor(...) instead.")
        wanted = "cuda" if _is_index(device) else torch.device(device).type
        if wanted != self.device.type:
            raise RuntimeError(f"legacy constructor expects device type: {self.device.type} but device type: "
                               f"{wanted} was passed")
    if device is None and isinstance(self, EmulatedTensor):
        device = self.device
    with torch._C.DisableTorchFunctionSubclass():
        host = torch.Tensor.new(torch.empty(0, dtype=self.dtype), *args, **kwargs)
    return host if device is None else move(host, parse_device(device))


def _data_ptr(self):
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.data_ptr(_unwrap(self))


def _record_stream(self, stream):
    """The caching allocator's bookkeeping: nothing to do when nothing is really allocated."""
    if not isinstance(self, EmulatedTensor):
        raise RuntimeError("record_stream: expected a CUDA tensor, got a CPU tensor")


def _set_data(self, new):
    """`param.data = tensor` (weight-init and weight-tying code): the tensor keeps its identity, which optimizers and
    autograd hold, and takes the new values, shape and dtype. The C++ assignment alone would leave an emulated
    tensor its old values. A GPU tensor given host values (`flat_param.data = flat_param.cpu()`, FSDP's offload to the
    CPU) stays an emulated tensor, on the host. The other way the Python class would have to change: not modelled."""
    if isinstance(self, EmulatedTensor) and type(new) is torch.Tensor and new.device.type == "cpu":
        new = wrap(new, CPU, None)
    if isinstance(new, EmulatedTensor) and not isinstance(self, EmulatedTensor) and torch.nn.parameter.is_lazy(self):
        return _take_gpu_tensor(self, new)
    if isinstance(new, EmulatedTensor) and type(self) in (torch.Tensor, torch.nn.Parameter) and self.is_leaf \
            and self.grad is None:
        return _take_gpu_tensor(self, new)
    if isinstance(self, EmulatedTensor) != isinstance(new, EmulatedTensor):
        raise RuntimeError(f"`tensor.data = other` with `tensor` on {self.device} and `other` on {new.device} is not "
                           "modelled by the GPU emulator (course.emulate): move `other` to the tensor's device "
                           "first, or move the module with .to(device).")
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.data.__set__(self, new)
    if isinstance(self, EmulatedTensor):
        self._inner, self._device_index, self._block = new._inner, new._device_index, new._block


def _set_grad(self, grad):
    """`tensor.grad = g` refuses a gradient on another device with THPVariable_set_grad's words: its C++ compares the
    CPU devices emulated tensors have underneath, and took a GPU gradient for a host tensor, or one from another GPU."""
    if isinstance(grad, torch.Tensor) and isinstance(self, torch.Tensor):
        mine, theirs = device_of(self), device_of(grad)
        if (mine == CPU) != (theirs == CPU):
            raise RuntimeError(
                f"attempting to assign a gradient with device type '{'cpu' if theirs == CPU else 'cuda'}' to a tensor "
                f"with device type '{'cpu' if mine == CPU else 'cuda'}'. Please ensure that the gradient and the "
                "tensor are on the same device")
        if mine != theirs:
            raise RuntimeError(
                f"attempting to assign a gradient located on device with index '{theirs}' to a tensor located on "
                f"device with index '{mine}'. Please ensure that the gradient and the tensor are on the same device")
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.grad.__set__(self, grad)


def _take_gpu_tensor(host, gpu):
    """`host_tensor.data = gpu_tensor`, which `model.to("cuda")` runs when autograd still holds a parameter (a CPU
    forward pass's output alive, as tests keep their reference output): the tensor's Python object, which optimizers
    and modules hold, becomes the GPU tensor, as torch.utils.swap_tensors makes it. The pending graph keeps the host
    values it saved; a backward through it raises, as swap_tensors makes it (on a GPU it would mix devices)."""
    moved = gpu.detach().requires_grad_(host.requires_grad)
    if type(host) is torch.nn.Parameter:
        moved._is_param = True
    if torch.nn.parameter.is_lazy(gpu):
        moved.__class__ = type(gpu)  # stays uninitialized, for the lazy module to materialize
    if host.requires_grad and not torch.nn.parameter.is_lazy(host):  # a lazy one is in no graph
        torch.autograd.graph.get_gradient_edge(host).node.register_prehook(_moved_to_gpu_hook)
    host_attributes, moved_attributes = instance_dict(host), instance_dict(moved)
    host.__class__, moved.__class__ = moved.__class__, host.__class__
    set_instance_dict(host, moved_attributes)
    set_instance_dict(moved, host_attributes)
    torch._C._swap_tensor_impl(host, moved)


def _moved_to_gpu_hook(grad_outputs):
    raise RuntimeError("Trying to backward through a graph whose CPU parameter was since moved to an emulated GPU "
                       "with `.to()`/`.data =`: run backward before moving the module, or run forward again after.")


def on_gradient_device(gradient, tensor):
    """A gradient PyTorch's C++ made as a plain CPU tensor for an emulated GPU tensor, on that GPU.

    Backward formulas make some gradients from the input's sizes and options alone (`copysign`'s gradient for its
    sign argument, `sgn`'s, `normal`'s, `repeat` with a zero count: `at::zeros(sizes, options)`), and on a CPU
    build those options name the host. On a GPU that gradient is a GPU tensor, made by a fill kernel."""
    if isinstance(gradient, EmulatedTensor):
        return _scalar_gradient_on_host(gradient, tensor)
    if (gradient is None or not isinstance(tensor, EmulatedTensor)
            or tensor._device_index == CPU or gradient.layout is not torch.strided or _batched(gradient)):
        return gradient
    emu, index = current_emulator("gradient"), tensor._device_index
    nbytes = gradient.numel() * gradient.element_size()
    block = emu.memory.allocate(index, nbytes)
    block.ready_ns = emu.clock.launch("kernel", "aten::fill_", index, emu.current_stream_id(index),
                                      costs.kernel_ns(emu.gpu, 0, nbytes, gradient.dtype, False, False), nbytes=nbytes)
    inner = gradient.detach() if emu.materialize else gradient.detach().to("meta")
    return wrap(inner, index, block)


def _scalar_gradient_on_host(gradient: EmulatedTensor, tensor) -> torch.Tensor:
    """A 0-dim CPU tensor used with GPU tensors (a scalar parameter, `x * a` with x on the GPU) has its gradient on
    the CPU: the autograd engine moves a 0-dim gradient to its input's device (`validate_outputs`, engine.cpp),
    which it cannot see here, where a GPU tensor's C++ device is the CPU too. So does a 0-dim GPU value that
    `fill_` read from another GPU."""
    if gradient.dim() == 0 and gradient._device_index != device_of(tensor):
        return move(gradient, device_of(tensor))
    return gradient


def _batched(gradient) -> bool:
    """A gradient vmap batches (gradcheck's batched-gradient check, `autograd.grad(is_grads_batched=True)`): its
    values are the GPU tensors autograd made under the batching wrapper, which a copy could not see through."""
    return torch._C._functorch.is_legacy_batchedtensor(gradient) or torch._C._functorch.is_batchedtensor(gradient)


def _grad(self):
    """`tensor.grad`, a GPU tensor for a GPU tensor (see `on_gradient_device`), kept as the tensor's gradient."""
    with torch._C.DisableTorchFunctionSubclass():
        gradient = torch.Tensor.grad.__get__(self)
        moved = on_gradient_device(gradient, self)
        if moved is not gradient:
            torch.Tensor.grad.__set__(self, moved)
    return moved


_autograd_grad = torch.autograd.grad


def _grad_of(outputs, inputs, *args, **kwargs):
    """`torch.autograd.grad`, its gradients for GPU inputs on the GPU (see `on_gradient_device`)."""
    with torch._C.DisableTorchFunctionSubclass():
        gradients = _autograd_grad(outputs, inputs, *args, **kwargs)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return tuple(on_gradient_device(g, t) for g, t in zip(gradients, inputs))


def _empty_result_on_device(function):
    """`torch.linalg.matrix_rank` / `cond`: for an empty matrix their C++ returns `at::zeros(shape, input.options())`
    without running an op, a plain CPU tensor on a CPU build; on a GPU it is a GPU tensor (see `on_gradient_device`)."""

    def run(input, *args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return on_gradient_device(function(input, *args, **kwargs), input)
    return run


_REDUCTION_NONE, _REDUCTION_MEAN = 0, 1  # at::Reduction


def _ctc_loss_as_cuda_runs_it(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=None,
                              zero_infinity=False):
    """`F.ctc_loss` / `torch.ctc_loss` as CUDA PyTorch runs them (ctc_loss_impl, LossCTC.cpp): length tensors read on the
    host, the targets moved to the log-probs' device wherever they are (cuDNN's CTC takes int32 ones on the host, the
    native kernel gets them moved "as a service for the user"), and the mean's division by the target lengths made on
    that device. The C++ reads an emulated tensor's device as the host's, so it moved neither: a device mismatch.
    (`F.ctc_loss` always passes its reduction.)"""
    lengths = [input_lengths, target_lengths]
    if all(isinstance(n, torch.Tensor) and not n.is_floating_point() for n in lengths):
        lengths = [n.tolist() for n in lengths]
    if isinstance(reduction, str):
        reduction = _reduction_enum(reduction)
    if isinstance(targets, torch.Tensor) and isinstance(log_probs, torch.Tensor) and \
            device_of(targets) != device_of(log_probs):
        targets = handle_torch_function(torch.Tensor.to, (targets, log_probs.device), {})
    mean = reduction == _REDUCTION_MEAN and all(isinstance(n, (list, tuple)) for n in lengths)
    with torch._C.DisableTorchFunctionSubclass():
        if reduction is None:  # `torch.ctc_loss` called without one: its binding's own default
            return torch.ctc_loss(log_probs, targets, *lengths, blank, zero_infinity=zero_infinity)
        losses = torch.ctc_loss(log_probs, targets, *lengths, blank, _REDUCTION_NONE if mean else reduction,
                                zero_infinity)
    if not mean:
        return losses
    divisors = handle_torch_function(torch.tensor, (lengths[1],), {"dtype": losses.dtype, "device": losses.device})
    return (losses / divisors.clamp_min(1)).mean()


def _tensor_split(input, indices_or_sections, *args, **kwargs):
    """`torch.tensor_split` given its split points as a tensor reads them on the host and refuses a GPU tensor
    (TensorShape.cpp); its C++ sees the CPU device emulated tensors have underneath, and read a wrapper's data."""
    if isinstance(indices_or_sections, EmulatedTensor) and indices_or_sections._device_index != CPU:
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to be on cpu, but it's on "
                           f"{device_name(indices_or_sections._device_index)}")
    with torch._C.DisableTorchFunctionSubclass():
        return torch.tensor_split(input, indices_or_sections, *args, **kwargs)


def _vander(x, N=None, increasing=False):
    """`torch.vander`, step by step as its C++ (LinearAlgebra.cpp) takes them, on x's GPU: that C++ allocates its
    result with `x.options()`, which name the host for an emulated tensor, so the matrix came back a CPU tensor."""
    if x.dim() != 1:
        raise RuntimeError("x must be a one-dimensional tensor.")
    n = x.size(0) if N is None else N
    if n < 0:
        raise RuntimeError("N must be non-negative.")
    dtype = torch.promote_types(x.dtype, torch.int64)  # cumprod promotes integers to long
    result = handle_torch_function(torch.empty, (x.size(0), n), {"dtype": dtype, "device": x.device})
    if n > 0:
        result.fill_(1)
        if n > 1:
            result[:, 1:].copy_(x.unsqueeze(1))
            result[:, 1:].copy_(torch.cumprod(result[:, 1:], 1))
    return result if increasing else torch.flip(result, (1,))


def _take_along_dim(input, indices, dim=None, *, out=None):
    """`torch.take_along_dim` checks its tensors' devices itself before the gather it runs (checkDevice,
    TensorAdvancedIndexing.cpp): its words, where the gather's would name two devices. Its C++ sees the CPU device
    emulated tensors have underneath."""
    for tensor in (indices, out):
        if tensor is not None and device_of(tensor) != device_of(input):
            raise RuntimeError(f"Expected tensor to have {device_name(device_of(input))} Device, but got tensor with "
                               f"{device_name(device_of(tensor))} Device (while checking arguments for "
                               "torch.take_along_dim():)")
    with torch._C.DisableTorchFunctionSubclass():
        return torch.take_along_dim(input, indices, dim, out=out)


def _type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None:
        if isinstance(self, EmulatedTensor) and self.is_cuda:
            return f"torch.cuda.{_unwrap(self).type().split('.')[-1]}"
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.type(self)
    if isinstance(dtype, torch.dtype):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.type(self, dtype, non_blocking, **kwargs)
    return _to_legacy_type(self, dtype if isinstance(dtype, str) else f"{dtype.__module__}.{dtype.__name__}",
                           non_blocking)


def _to_legacy_type(tensor, name: str, non_blocking: bool):
    """`x.type(torch.cuda.DoubleTensor)`, `x.type("torch.FloatTensor")`: a legacy type names a device type as
    well as a dtype, so a GPU tensor given a CPU type comes to the host, and a CPU one given a CUDA type goes
    to the current GPU (PyTorch's THPVariable_type)."""
    module, _, base = name.rpartition(".")
    if module not in ("torch", "torch.cuda") or not isinstance(getattr(torch, base, None), type):
        raise ValueError(f"invalid type: '{name}'")
    if module == "torch":
        index = CPU
    else:
        index = device_of(tensor) if device_of(tensor) != CPU else current_emulator("Tensor.type").current_device()
    return _to(tensor, device_name(index), getattr(torch, base).dtype, non_blocking=non_blocking)


_HANDLERS = {
    torch._C._nn._parse_to: _parse_to,
    torch.Tensor.to: _to,
    torch.Tensor.cuda: _cuda,
    torch.Tensor.cpu: _cpu,
    torch.Tensor.copy_: _copy_,
    torch.Tensor.pin_memory: _pin_memory,
    torch.Tensor.is_pinned: _is_pinned,
    torch.Tensor.numpy: _numpy,
    torch.Tensor.tolist: _tolist,
    torch.Tensor.__array__: _array,
    torch.Tensor.new_tensor: _new_tensor,
    torch.Tensor.new: _new,
    torch.Tensor.data_ptr: _data_ptr,
    torch.Tensor.record_stream: _record_stream,
    torch.Tensor.type: _type,
    torch.Tensor.type_as: _type_as,
    torch.Tensor.data.__set__: _set_data,
    torch.Tensor.grad.__get__: _grad,
    torch.Tensor.grad.__set__: _set_grad,
    torch.autograd.grad: _grad_of,
    torch.linalg.matrix_rank: _empty_result_on_device(torch.linalg.matrix_rank),
    torch.linalg.cond: _empty_result_on_device(torch.linalg.cond),
    torch.take_along_dim: _take_along_dim,
    torch.Tensor.take_along_dim: _take_along_dim,
    torch.tensor_split: _tensor_split,
    torch.Tensor.tensor_split: _tensor_split,
    torch.vander: _vander,
    torch.ctc_loss: _ctc_loss_as_cuda_runs_it,
    torch.nn.functional.ctc_loss: _ctc_loss_as_cuda_runs_it,
    torch.nn.functional.scaled_dot_product_attention: attention.scaled_dot_product_attention,
    attention.flex_attention_hop: attention.flex_attention,
    torch._VF._pack_padded_sequence: packed_sequences.pack_padded_sequence,
    torch._VF._pad_packed_sequence: packed_sequences.pad_packed_sequence,
    torch._C._nn.pad_sequence: packed_sequences.pad_sequence,
    torch.Tensor.untyped_storage: storages.untyped_storage,
    torch.Tensor.storage: storages.typed_storage,
}


_HANDLERS.update(inner_factories.handlers(lambda: EmulatorMode()))
_HANDLERS.update(cudnn_rnn.handlers())
_HANDLERS.update(graph_moves.handlers(_to, _type_as))
_HANDLERS.update(half_fft.handlers())
_HANDLERS.update(fused_dropout.handlers())
_HANDLERS.update(device_asserts.handlers())
attention.register_eager_flex_attention(lambda: EmulatorMode())

# Calls that may need routing even with no keyword arguments: the rest go straight to their kernels.
_ROUTED = frozenset(_HANDLERS) | torch.utils._device._device_constructors() | {torch.normal}

# Calls inside which PyTorch's C++ (the autograd engine, DDP's reducer hooks) issues ops of its own.
ENGINE_ENTRY_POINTS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})


def _default_device():
    """The device `with torch.device(...)` or `torch.set_default_device` made the default, if a GPU."""
    current = torch.utils._device.CURRENT_DEVICE
    return current if current is not None and current.type == "cuda" else None


# `with DisableTorchFunctionSubclass(): func(*args)` in one C call: most torch calls need nothing else.
_run_unrouted = torch._C._disabled_torch_function_impl


def handle_torch_function(func, args, kwargs):
    """Route one Python-level torch call; an error in it is raised from here, as CUDA's come from the C++ below
    the learner's line: the emulator's own frames are dropped (devices.KEEP_FRAMES keeps them), and IPython
    and pytest hide this one (`__tracebackhide__`)."""
    __tracebackhide__ = True
    try:
        if kwargs or func in _ROUTED:
            return _route_torch_function(func, args, kwargs or {})
        return _run_unrouted(func, (), args)  # most calls: nothing to route, the op runs as it is
    except Exception as error:
        if KEEP_FRAMES:
            raise
        # The error belongs to the torch call in the frame above: the emulator's frames below it are dropped.
        raise error.with_traceback(None) from error.__cause__


def _names_host(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def _check_generator(func, args, kwargs, generator):
    """A generator of the wrong device type, refused with the words of ATen's `check_generator`, as a GPU box refuses
    it: the CUDA generator here is a CPU one underneath, which the CPU kernels would take either way. The CPU
    generator that `torch.cuda.default_generators` holds here (course/cuda/rng.py) stands for a CUDA one."""
    if any(generator is d for d in torch.cuda.default_generators):
        return
    if func is torch.randperm and args and args[0] == 0:  # randperm of nothing draws nothing, on any generator
        return
    device = kwargs.get("device")
    if device is None and func in torch.utils._device._device_constructors():
        device = _default_device()
    if device is not None:
        want = "cuda" if isinstance(device, int) else torch.device(device).type
    else:
        # the tensor drawn into or from: the first argument, or a keyword one (`nn.init.normal_(tensor=...)`)
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        want = "cpu" if first is None else first.device.type
    if want in ("cpu", "cuda") and generator.device.type in ("cpu", "cuda") and generator.device.type != want:
        raise RuntimeError(f"Expected a '{want}' device type for generator but found '{generator.device.type}'")


_TO_KEYS = {"dtype", "device"}


def _sparse_from_tensors(func, args, kwargs):
    """`torch.sparse_coo_tensor(indices, values, size, device="cuda")`: its indices and values moved there (or to the
    values' device) with `.to(device)`, as the Python binding moves them, and the constructor run on them, so that
    autograd records it (made as a new GPU tensor, the result had no grad_fn and gradients stopped at it; host
    indices with GPU values were refused). Two things read the indices through host pointers, which an emulated
    tensor has none of, and run on a host copy, as CUDA's read a host copy: the invariant checks
    (`check_invariants`, on in PyTorch's test suite), and, with no size given, the size PyTorch infers from them (their
    largest entries plus one; GNN code's `sparse_coo_tensor(edge_index, weights, device=device)`)."""
    kwargs = dict(kwargs)
    device = kwargs.pop("device", None)
    if device is None:  # the values' device, where the binding moves the indices (tensor_new.cpp)
        position = 1 if func is torch.sparse_coo_tensor else 2
        values = args[position] if len(args) > position else kwargs.get("values")
        device = values.device if isinstance(values, torch.Tensor) else None
    if device is not None:
        args = tuple(handle_torch_function(torch.Tensor.to, (a, device), {}) if isinstance(a, torch.Tensor) else a
                     for a in args)
    check = kwargs.get("check_invariants")
    check = bool(check or check is None and torch.sparse.check_sparse_tensor_invariants.is_enabled())
    sized = len(args) > (2 if func is torch.sparse_coo_tensor else 3) or kwargs.get("size") is not None
    with torch._C.DisableTorchFunction():  # a default device's mode would name the GPU to CPU torch's constructor
        if check or not sized:
            on_the_host = func(*on_host(args), **dict(kwargs, check_invariants=check))
            if not sized:
                kwargs["size"] = on_the_host.shape
            if check:
                kwargs["check_invariants"] = False
        return func(*args, **kwargs)


def _route_torch_function(func, args, kwargs):
    """Take over the calls that name a device, pass the rest on."""
    generator = kwargs.get("generator")
    if generator is not None:
        _check_generator(func, args, kwargs, generator)
    if func in aliasing_factories.ALIASING and len(args) == 1 and isinstance(args[0], EmulatedTensor) and \
            kwargs.keys() <= _TO_KEYS:
        # a tensor's `.to(device, dtype)`, as tensor_new.cpp's internal_new_from_data makes it: the same tensor when
        # nothing changes, autograd's graph kept (made anew, it had no grad_fn, and one for another GPU shared memory)
        return handle_torch_function(torch.Tensor.to, args, {k: v for k, v in kwargs.items() if v is not None})
    if func in _SPARSE_FROM_PARTS and any(isinstance(a, torch.Tensor) for a in args) and \
            (kwargs.get("device") is not None or any(isinstance(a, EmulatedTensor) for a in args)):
        return _sparse_from_tensors(func, args, kwargs)
    if func in aliasing_factories.ALIASING and args and isinstance(args[0], EmulatedTensor) \
            and args[0]._device_index != CPU and kwargs.get("device") is not None:
        return aliasing_factories.from_gpu_tensor(func, args[0], kwargs)
    if func in _FROM_HOST_DATA and args and holds_gpu_tensors(args[0]):  # `torch.tensor([loss_a, loss_b])`
        args = (on_host(args[0]),) + args[1:]
    elif func in _FROM_HOST_DATA and args and isinstance(args[0], EmulatedTensor) and _names_host(kwargs.get("device")):
        args = (on_host(args[0]),) + args[1:]  # `torch.as_tensor(gpu_x, device="cpu")`: a copy to the host
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    return _route_factory(func, args, kwargs)


def _route_factory(func, args, kwargs):
    """A call no handler takes: a factory aimed at a GPU is made there, anything else runs as it is."""
    device = kwargs.get("device") if kwargs else None
    if device is None and (func in torch.utils._device._device_constructors()
                           or _of_the_default_type(func, args, kwargs)):
        device = _default_device()
    if device is not None and isinstance(kwargs.get("out"), torch.Tensor):  # the kernel writes into `out`, where it is
        _check_out_device(device, kwargs["out"])
        device, kwargs = None, {k: v for k, v in kwargs.items() if k != "device"}
    if device is not None and func in _FILLED_LIKE and args and _dtensor(args[0]):
        return _dtensor_shaped_like(func, args, kwargs)
    if device is not None and not (isinstance(device, str) and device.startswith(("cpu", "meta"))):
        if isinstance(device, int) or torch.device(device).type not in ("cpu", "meta"):
            return _create_on_device(func, device, args, dict(kwargs))
    if device is not None and func in _SHAPED_LIKE and args and isinstance(args[0], EmulatedTensor):  # host
        args = (args[0]._inner,) + args[1:]
    if kwargs and kwargs.get("pin_memory"):  # CPU torch has no pinned allocator: a buffer for async copies
        with torch._C.DisableTorchFunctionSubclass():
            return pin(func(*args, **dict(kwargs, pin_memory=False)), copy=False)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _of_the_default_type(func, args, kwargs) -> bool:
    """`torch.normal(0.0, 1.0, size)` after a CUDA default tensor type: its C++ takes the default type's device, a GPU,
    while `torch.set_default_device`'s mode, which PyTorch's list of constructors leaves it out of, does not move it."""
    return func is torch.normal and gpu_by_default() and \
        not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))


def _check_out_device(device, out: torch.Tensor) -> None:
    """A factory's `device=` beside `out=`: PyTorch's Python bindings compare only its type with `out`'s
    (check_out_type_matches, torch/csrc/utils/out_types.cpp); C++ would compare it with the wrapper's CPU device."""
    wanted = "cuda" if _is_index(device) else torch.device(device).type
    if wanted != out.device.type:
        raise RuntimeError(f"device type {wanted} does not match device type of out parameter ({out.device.type})")


_range = torch.range


def factory_range(*args, **kwargs):
    """`torch.range` (deprecated): its Python binding skips torch-function modes, so `device="cuda"` reached C++."""
    return handle_torch_function(_range, args, kwargs)


class EmulatorMode(TorchFunctionMode):
    """Pushed on every thread that runs emulated code: sees factory calls and plain-tensor `.to()`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """`handle_torch_function` with its usual case inlined: every torch call of a program comes here."""
        __tracebackhide__ = True
        for cls in types:  # a program's subclass with a __torch_function__ runs it first, as in PyTorch
            if cls is not EmulatedTensor and cls is not torch.Tensor and subclasses.has_own_torch_function(cls) \
                    and torch._C._is_torch_function_enabled():
                return subclasses.run_torch_function(EmulatorMode, func, types, args, kwargs or {})
        if kwargs or func in _ROUTED:
            return handle_torch_function(func, args, kwargs)
        try:
            return _run_unrouted(func, types, args)
        except Exception as error:
            if KEEP_FRAMES:
                raise
            raise error.with_traceback(None) from error.__cause__
