"""Emulated GPU tensors inside torch.func transforms (vmap's batched tensors, grad's and jvp's wrappers).

A transform wraps a tensor in a C++ tensor whose device is the one C++ sees inside: the CPU, for an emulated GPU
tensor, so inside `vmap(f)` or `grad(f)` `x.device` said "cpu" and `torch.zeros(3, device=x.device)` made a host
tensor; and what a factory or a copy makes inside a transform comes back wrapped at its level, around a host
tensor: the emulated GPU tensor is made of the tensor inside, then wrapped again at the same levels. While a transform runs, `Tensor.device`, `is_cuda`, `is_cpu` and `get_device()` of such a wrapper answer
from the tensor inside it (`Tensor.device` of a plain tensor never reaches a torch-function mode, so the answer is
a property on `torch.Tensor`, put there only while a transform's level is open). (A random factory under
`vmap(..., randomness="different")` comes back batched: one draw per batch element.)
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch._functorch.eager_transforms
import torch._functorch.vmap

_functorch = torch._C._functorch


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a torch.func transform wrapped (jvp's dual, grad's, vmap's batched)."""
    while _functorch.is_functorch_wrapped_tensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return tensor


def peeled(tensor: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int | None, int]]]:
    """The tensor under a transform's wrappers, and its layers from the outermost: (batch dim, level) for vmap's,
    (None, level) for grad's and jvp's."""
    layers = []
    while _functorch.is_functorch_wrapped_tensor(tensor):
        bdim = _functorch.maybe_get_bdim(tensor) if _functorch.is_batchedtensor(tensor) else None
        layers.append((bdim, _functorch.maybe_get_level(tensor)))
        tensor = _functorch.get_unwrapped(tensor)
    return tensor, layers


def rewrapped(tensor: torch.Tensor, layers: list[tuple[int | None, int]]) -> torch.Tensor:
    for bdim, level in reversed(layers):
        tensor = _functorch._wrap_for_grad(tensor, level) if bdim is None else _functorch._add_batch_dim(
            tensor, bdim, level)
    return tensor


def _from_inside(name: str, query):
    """A wrapper's `name` asked of the tensor it wraps (an emulated one answers for its GPU); of any other tensor,
    PyTorch's own `query`."""
    def answer(self):
        if _functorch.is_functorch_wrapped_tensor(self):
            return getattr(unwrapped(self), name)
        return query(self)
    return answer


_BASE = torch._C.TensorBase
_QUERIES = {"device": property(_from_inside("device", _BASE.device.__get__)),
            "is_cuda": property(_from_inside("is_cuda", _BASE.is_cuda.__get__)),
            "is_cpu": property(_from_inside("is_cpu", _BASE.is_cpu.__get__)),
            "get_device": lambda self: _from_inside("get_device", _BASE.get_device)(self)()
            if _functorch.is_functorch_wrapped_tensor(self) else _BASE.get_device(self)}


class _OpenLevels:
    """How many transform levels are open (in any thread): the queries are on torch.Tensor while any is."""

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def open(self):
        with self.lock:
            self.count += 1
            if self.count == 1:
                for name, query in _QUERIES.items():
                    setattr(torch.Tensor, name, query)
        try:
            yield
        finally:
            with self.lock:
                self.count -= 1
                if self.count == 0:
                    for name in _QUERIES:
                        delattr(torch.Tensor, name)


_LEVELS = _OpenLevels()


def _answering_from_inside(increment_nesting):
    @contextlib.contextmanager
    def nesting(*args, **kwargs):
        with _LEVELS.open(), increment_nesting(*args, **kwargs) as level:
            yield level
    return nesting


PATCHES = [
    (torch._functorch.vmap, {"vmap_increment_nesting": _answering_from_inside(
        torch._functorch.vmap.vmap_increment_nesting)}),
    (torch._functorch.eager_transforms, {
        name: _answering_from_inside(getattr(torch._functorch.eager_transforms, name))
        for name in ("grad_increment_nesting", "jvp_increment_nesting")}),
]
