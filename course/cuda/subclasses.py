"""Python tensor subclasses (`x.as_subclass(MyTensor)`, `torch.Tensor._make_subclass`) of tensors on emulated GPUs.

An emulated GPU tensor is itself a Python subclass (devices.EmulatedTensor), and PyTorch ties one Python object to
each tensor: re-classing it as the program's own subclass fails in C++ with a message about EmulatedTensor that
reads like the program's bug. Such calls raise an error naming what the emulator does not model instead. Subclasses
made on the host (and kept there), wrapper subclasses (`_make_wrapper_subclass`) and nn.Parameter work.
"""
from __future__ import annotations

import functools

import torch

from course.cuda.cuda_bindings import not_modelled

_TIED = "already associated to a python object of type EmulatedTensor"


def _named(method, cls_at: int):
    """`method`, whose argument `cls_at` is the subclass, with the C++ error replaced by one that names it."""

    @functools.wraps(method)
    def reclass(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except RuntimeError as error:
            if _TIED not in str(error):
                raise
            cls = kwargs.get("cls", args[cls_at] if len(args) > cls_at else None)
            name = getattr(cls, "__name__", "a tensor subclass")
            raise not_modelled(f"Re-classing a tensor on an emulated GPU as the Python subclass {name}",
                               "make the subclass a wrapper (torch.Tensor._make_wrapper_subclass), keep its tensors "
                               "on the CPU, or run this part on a real GPU") from None
    return reclass


PATCHES = [(torch.Tensor, {"as_subclass": _named(torch.Tensor.as_subclass, 1),
                           "_make_subclass": staticmethod(_named(torch.Tensor._make_subclass, 0))})]
