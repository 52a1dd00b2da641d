"""Python tensor subclasses (`x.as_subclass(MyTensor)`, `torch.Tensor._make_subclass`) and their `__torch_function__`.

A program's subclass overrides `__torch_function__` (or inherits PyTorch's default, which keeps the subclass through
ops: torch/_tensor.py, Tensor.__torch_function__ and _convert). The emulator's torch-function mode sees every call
first, and runs it with subclasses' handlers switched off: for such a subclass, the mode runs the subclass's handler
instead, with the mode back on underneath, as PyTorch runs a subclass's handler after a mode's (torch/overrides.py,
handle_torch_function).

An emulated GPU tensor is itself a Python subclass (devices.EmulatedTensor), and PyTorch ties one Python object to
each tensor, so it cannot be re-classed in C++. `as_subclass(MyTensor)` of one is an alias (as PyTorch's is: it
stays in the autograd graph and shares memory) whose class is MyTensor's twin on emulated GPUs: a class built on
MyTensor and EmulatedTensor, named as MyTensor, so isinstance, MyTensor's methods and its `__torch_function__` are
MyTensor's and the device, values and timing the emulator's. `type(t) is MyTensor` is False. A subclass with its own
`__torch_dispatch__` is refused by name there: its dispatch would stand in front of the emulator's.

Such subclasses are wrappers instead (`_make_wrapper_subclass`: a LoggingTensor, torchao's int8 and float8 tensors):
their handler unwraps and calls ops on the tensors inside, which reach the emulator. One made on an emulated GPU is
made on the host, as the emulator's own tensors are, and reports the GPU; its moves go through its own `_to_copy`.
"""
from __future__ import annotations

import functools
import threading

import torch

from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import EmulatedTensor, _make_wrapper, current_emulator, hooks, parse_device
from course.cuda.tensor_attributes import instance_dict

_as_subclass = torch.Tensor.as_subclass
_make_subclass = torch.Tensor._make_subclass


class _SubclassOnGPU(EmulatedTensor):
    """The base of the twins: PyTorch's default `__torch_function__` (Tensor.__torch_function__) over the emulator's
    routing: the op runs as the emulator runs it, and the tensors it returns come back as the subclass."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        __tracebackhide__ = True
        result = hooks.torch_function(func, args, kwargs or {})
        if func in torch.overrides.get_default_nowrap_functions():
            return result
        return torch._tensor._convert(result, cls)


@functools.cache
def _twin(cls: type) -> type:
    """MyTensor's class on emulated GPUs: MyTensor's behaviour, over an emulated GPU tensor's."""
    if any("__torch_dispatch__" in vars(base) for base in cls.__mro__ if base not in (torch.Tensor, torch._C.TensorBase)):
        raise not_modelled(f"A tensor on an emulated GPU as the subclass {cls.__name__}, which has its own "
                           "__torch_dispatch__,", "make the subclass a wrapper (torch.Tensor._make_wrapper_subclass) "
                           "over the GPU tensor, keep its tensors on the CPU, or run this part on a real GPU")
    extra = _UNINITIALIZED_ON_GPU if issubclass(cls, torch.nn.parameter.UninitializedTensorMixin) else {}
    return type(cls.__name__, (cls, _SubclassOnGPU), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                      **extra})


def _materialize_on_gpu(self, shape, device=None, dtype=None) -> None:
    """A lazy module's first forward on an emulated GPU: PyTorch's materialize (nn/parameter.py), whose
    `self.__class__ = self.cls_to_become` would give the GPU tensor a class without the emulator's dispatch; here it
    becomes a plain emulated tensor, flagged as a parameter as nn.Parameter flags tensors it cannot re-class."""
    is_param = issubclass(_user_class(type(self)).cls_to_become, torch.nn.Parameter)
    torch.nn.parameter.UninitializedTensorMixin.materialize(self, shape, device, dtype)
    if is_param:
        self._is_param = True


# What an uninitialized parameter's or buffer's twin adds: it materializes into an emulated tensor, and lets
# nn.Parameter detach it (Module._apply wraps a moved parameter in one), as it lets `.to()` run.
_UNINITIALIZED_ON_GPU = {
    "cls_to_become": EmulatedTensor, "materialize": _materialize_on_gpu,
    "_allowed_methods": [*torch.nn.parameter.UninitializedTensorMixin._allowed_methods, torch.Tensor.detach,
                         torch.Tensor.requires_grad_],
}


def uninitialized_like(tensor, data: torch.Tensor):
    """`uninitialized.to(device, dtype)`: it holds no values, so the moved one is made anew around `data` (empty, on
    the device), as UninitializedParameter.__new__ makes one, keeping its attributes (a buffer's `persistent`)."""
    with torch._C.DisableTorchFunctionSubclass():
        moved = torch.Tensor._make_subclass(_user_class(type(tensor)), data, tensor.requires_grad)
        instance_dict(moved).update(instance_dict(tensor))
    return moved


def _user_class(cls: type) -> type:
    return cls.__mro__[1] if issubclass(cls, _SubclassOnGPU) and cls is not _SubclassOnGPU else cls


def _reclassed(tensor: EmulatedTensor, cls: type) -> EmulatedTensor:
    if cls in (torch.Tensor, EmulatedTensor):
        return tensor
    tensor.__class__ = _twin(_user_class(cls))  # a fresh Python object, which only this call holds
    return tensor


def as_subclass(self, cls):
    """`Tensor.as_subclass`: an alias of the GPU tensor as MyTensor's twin; on the host, PyTorch's own."""
    if not isinstance(self, EmulatedTensor):
        return _as_subclass(self, _user_class(cls))
    with torch._C.DisableTorchFunctionSubclass():
        return _reclassed(torch.ops.aten.alias.default(self), cls)


def make_subclass(cls, data, requires_grad=False, **kwargs):
    """`Tensor._make_subclass` (nn.Parameter subclasses use it): the data detached, as MyTensor's twin. Its
    signature is the one torch._dynamo's polyfill of it checks (torch/_dynamo/polyfills/tensor.py)."""
    if not isinstance(data, EmulatedTensor):
        return _make_subclass(_user_class(cls), data, requires_grad, **kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return _reclassed(data.detach().requires_grad_(requires_grad), cls)


def _from_a_program(cls: type) -> bool:
    """Written by the program or a library (torchao's tensors too), not by PyTorch or the emulator."""
    return (cls.__module__ or "").partition(".")[0] not in ("torch", "course")


@functools.cache
def has_own_torch_function(cls: type) -> bool:
    """Whether a program's subclass handles torch functions itself (PyTorch's and the emulator's own do not)."""
    handler = getattr(cls, "__torch_function__", None)
    return _from_a_program(cls) and getattr(handler, "__func__", handler) is not torch._C._disabled_torch_function_impl


def run_torch_function(mode_type, func, types, args, kwargs):
    """The subclasses' `__torch_function__`, in PyTorch's order, with an emulator mode back on underneath; the
    emulator's own handling if each answers NotImplemented."""
    __tracebackhide__ = True
    for cls in types:
        if has_own_torch_function(cls):
            with mode_type():
                result = cls.__torch_function__(func, types, args, kwargs)
            if result is not NotImplemented:
                return result
    return hooks.torch_function(func, args, kwargs)


def make_wrapper_subclass(cls, size, *args, **kwargs):
    """`Tensor._make_wrapper_subclass`, with which a program's `__torch_dispatch__` subclass wraps its tensors (a
    LoggingTensor, an int8 or float8 weight), given an emulated GPU as the device. PyTorch would make a C++ CUDA
    tensor, and a CPU build stops the process (no CUDA device guard) as soon as autograd records one. Like the
    emulator's own tensors, the wrapper is made on the host and says which GPU it is on (`device`, `is_cuda`,
    `get_device`); its ops still go to its own handler, which hands the emulator its inner GPU tensors."""
    device = kwargs.get("device")
    index = _gpu_index(device) if device is not None and _from_a_program(cls) else None
    if index is None:
        return _make_wrapper(cls, size, *args, **kwargs)
    tensor = _make_wrapper(cls, size, *args, **dict(kwargs, device="cpu"))
    tensor.__dict__[ON_GPU] = index
    _report_gpu(cls)
    return tensor


ON_GPU = "_course_wrapper_on_gpu"  # a program wrapper's emulated GPU, in its __dict__


def _gpu_index(device) -> int | None:
    if isinstance(device, int) and not isinstance(device, bool):
        return parse_device(device)
    return parse_device(device) if torch.device(device).type == "cuda" else None


_LOCK = threading.Lock()


def _report_gpu(cls: type) -> None:
    """Make the class report the GPU of its wrappers made on one (others keep PyTorch's answers), unless the
    program defines those itself; undone when the emulator stops."""
    if getattr(cls.__dict__.get("device"), "fget", None) is _wrapper_device:
        return
    with _LOCK:
        if getattr(cls.__dict__.get("device"), "fget", None) is _wrapper_device or _defines_device(cls):
            return
        emu = current_emulator("a tensor subclass on an emulated GPU")
        emu._patch(cls, {"device": property(_wrapper_device), "is_cuda": property(_wrapper_is_cuda),
                         "is_cpu": property(lambda self: not _wrapper_is_cuda(self)), "get_device": _wrapper_get_device})


def _defines_device(cls: type) -> bool:
    return any("device" in vars(base) for base in cls.__mro__ if base not in (torch.Tensor, torch._C.TensorBase))


_HOST_DEVICE = torch._C.TensorBase.device.__get__
_HOST_GET_DEVICE = torch._C.TensorBase.get_device


def _wrapper_device(self) -> torch.device:
    index = self.__dict__.get(ON_GPU)
    return _HOST_DEVICE(self) if index is None else torch.device("cuda", index)


def _wrapper_is_cuda(self) -> bool:
    return ON_GPU in self.__dict__ or _HOST_DEVICE(self).type == "cuda"


def _wrapper_get_device(self) -> int:
    index = self.__dict__.get(ON_GPU)
    return _HOST_GET_DEVICE(self) if index is None else index


def gpu_of_wrapper(tensor) -> int | None:
    """The emulated GPU a program's wrapper subclass was made on, else None."""
    return tensor.__dict__.get(ON_GPU) if _from_a_program(type(tensor)) else None


def is_program_wrapper(tensor) -> bool:
    """A program's subclass with its own `__torch_dispatch__` (not the emulator's twins of plain subclasses)."""
    cls = type(tensor)
    return not isinstance(tensor, EmulatedTensor) and _from_a_program(cls) and \
        cls.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl


def move_from_host(tensor, dst: int, non_blocking: bool, move):
    """`.to(device)` of a program's wrapper subclass made on the host. Its handler's ops would take the CPU build's
    own path to CUDA, which it has none of; a wrapper that lists its tensors (`__tensor_flatten__`, as torchao's and
    torch.compile-ready subclasses do) is rebuilt around moved ones, as its `_to_copy` would."""
    if not callable(getattr(tensor, "__tensor_flatten__", None)) or tensor.requires_grad:
        raise not_modelled(f"Moving a {type(tensor).__name__} (a tensor subclass with its own __torch_dispatch__) "
                           "from the host to an emulated GPU", "make it from tensors already on the GPU, give the "
                           "subclass __tensor_flatten__ / __tensor_unflatten__, or run this part on a real GPU")
    names, context = tensor.__tensor_flatten__()
    moved = {name: move(getattr(tensor, name), dst, non_blocking) for name in names}
    return type(tensor).__tensor_unflatten__(moved, context, tensor.shape, tensor.stride())


PATCHES = [(torch.Tensor, {"as_subclass": as_subclass, "_make_subclass": staticmethod(make_subclass),
                           "_make_wrapper_subclass": staticmethod(make_wrapper_subclass)})]
