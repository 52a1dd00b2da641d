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
`__torch_dispatch__` is refused by name: its dispatch would stand in front of the emulator's.
"""
from __future__ import annotations

import functools

import torch

from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import EmulatedTensor, hooks

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
        moved.__dict__.update(tensor.__dict__)
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


@functools.cache
def has_own_torch_function(cls: type) -> bool:
    """Whether a program's subclass handles torch functions itself (PyTorch's and the emulator's own do not)."""
    handler = getattr(cls, "__torch_function__", None)
    return not (cls.__module__ or "").startswith(("torch", "course")) and \
        getattr(handler, "__func__", handler) is not torch._C._disabled_torch_function_impl


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


PATCHES = [(torch.Tensor, {"as_subclass": as_subclass, "_make_subclass": staticmethod(make_subclass)})]
