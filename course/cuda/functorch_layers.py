"""Emulated GPU tensors inside torch.func transforms (vmap's batched tensors, grad's and jvp's wrappers).

A transform wraps a tensor in a C++ tensor whose device is the one C++ sees inside: the CPU, for an emulated GPU
tensor. So inside `vmap(f)` or `grad(f)`, `x.device` said "cpu" and `torch.zeros(3, device=x.device)` made a host
tensor. While a transform's level is open, `Tensor.device`, `is_cuda`, `is_cpu` and `get_device()` of a wrapper
answer from the tensor inside it (a property on `torch.Tensor`: `Tensor.device` of a plain tensor never reaches a
torch-function mode). What a factory or a copy makes inside a transform comes back wrapped at its levels around a
host tensor (a random factory under `vmap(..., randomness="different")` batched: a draw per batch element): the GPU
tensor is made of the tensor inside, then wrapped again at the same levels.

`make_fx` (functorch's tracer) loses emulated tensors: the ops the emulator runs on their host tensors are traced as
constants, so the graph returned wrong values; tracing GPU tensors with it is refused by name. `torch.func.linearize`
traces its JVP with it: of GPU primals, the JVP is computed eagerly with forward-mode AD at each call, which is what
the graph computes.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch._functorch.eager_transforms
import torch._functorch.vmap
import torch.autograd.forward_ad as fwAD
import torch.func
from torch.fx.experimental.proxy_tensor import _MakefxTracer
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten

from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import EmulatedTensor

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


_linearize = torch._functorch.eager_transforms.linearize


def linearize(func, *primals):
    """`torch.func.linearize`: PyTorch's own for host tensors; for GPU ones, its checks and an eager JVP."""
    flat_primals, primals_spec = tree_flatten(primals)
    if not any(isinstance(p, EmulatedTensor) for p in flat_primals):
        return _linearize(func, *primals)
    output = func(*primals)

    def jvp_fn(*tangents):
        flat_tangents, tangents_spec = tree_flatten(tangents)
        if tangents_spec != primals_spec:
            raise RuntimeError(f"Expected the tangents {tangents_spec} to have the same argspec as the primals "
                               f"{primals_spec}")
        for idx, (tangent, primal) in enumerate(zip(flat_tangents, flat_primals)):
            for what in ("shape", "device", "dtype"):
                if getattr(tangent, what) != getattr(primal, what):
                    raise RuntimeError(f"tangent:{idx} with {what} {getattr(tangent, what)} in flattened pytree "
                                       f"doesn't match the {what} {getattr(primal, what)} of the corresponding primal.")
        with fwAD.dual_level():
            duals = tree_unflatten([fwAD.make_dual(p, t) for p, t in zip(flat_primals, flat_tangents)], primals_spec)
            return tree_map_only(torch.Tensor, lambda dual: torch._functorch.eager_transforms.safe_unpack_dual(
                dual, False)[1], func(*duals))

    return output, jvp_fn


_trace = _MakefxTracer.trace


def _trace_host_tensors_only(self, f, *args):
    if any(isinstance(unwrapped(a), EmulatedTensor) for a in tree_leaves(args) if isinstance(a, torch.Tensor)):
        raise not_modelled("make_fx (torch.fx.experimental.proxy_tensor) of GPU tensors",
                           "trace the function with CPU tensors, or run it eagerly")
    return _trace(self, f, *args)


PATCHES = [
    (_MakefxTracer, {"trace": _trace_host_tensors_only}),
    (torch.func, {"linearize": linearize}),
    (torch._functorch.eager_transforms, {"linearize": linearize}),
    (torch._functorch.vmap, {"vmap_increment_nesting": _answering_from_inside(
        torch._functorch.vmap.vmap_increment_nesting)}),
    (torch._functorch.eager_transforms, {
        name: _answering_from_inside(getattr(torch._functorch.eager_transforms, name))
        for name in ("grad_increment_nesting", "jvp_increment_nesting")}),
]
