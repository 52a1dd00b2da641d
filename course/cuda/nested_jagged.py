"""Jagged nested tensors (`torch.nested.nested_tensor(..., layout=torch.jagged)`) on emulated GPUs.

A jagged NestedTensor is a Python tensor subclass whose data are ordinary tensors: `values` (the sequences packed
end to end) and `offsets` (torch/nested/_internal/nested_tensor.py). Its ops unwrap to ops on those tensors, so when
they are emulated GPU tensors, every kernel runs, is timed and counted as an emulated one, with CPU torch's values.
Only its wrapper needs care: PyTorch makes it on the values' device, and a C++ `cuda` device aborts a CPU build's
autograd engine, so while emulating the wrapper stays on the host and `device` answers with the values' device.
Strided-layout nested tensors are C++ tensors (NestedTensorImpl) and stay refused (transfers.nested_not_modelled).
"""
from __future__ import annotations

import torch
from torch.nested._internal.nested_tensor import NestedTensor, _tensor_symint_registry, get_tensor_symint

from course.cuda.devices import EmulatedTensor

_new = NestedTensor.__new__


def _host_side(tensor):
    """What the C++ wrapper is built from: an emulated tensor's inner host tensor (same sizes, strides, dtype)."""
    return tensor._inner if isinstance(tensor, EmulatedTensor) else tensor


def _wrapper_on_host(cls, values, offsets, *, lengths=None, **kwargs):
    """`NestedTensor.__new__` given the inner host tensors: the same wrapper, on the host. `__init__` still keeps
    the emulated values, offsets and lengths. The nested int of the ragged size is memoised on the emulated offsets
    (or lengths), as PyTorch's own ops look it up (`_to_copy`), and on their inner tensor, which `__new__` sees."""
    ragged_source = offsets if lengths is None else lengths
    if isinstance(ragged_source, EmulatedTensor):
        _tensor_symint_registry[ragged_source._inner] = get_tensor_symint(ragged_source, coeff=1)
    return _new(cls, _host_side(values), _host_side(offsets), lengths=_host_side(lengths), **kwargs)


def _values_device(self) -> torch.device:
    return self._values.device


PATCHES = [(NestedTensor, {"__new__": staticmethod(_wrapper_on_host),
                           "device": property(_values_device),
                           "is_cuda": property(lambda self: self._values.is_cuda),
                           "is_cpu": property(lambda self: self._values.is_cpu),
                           "get_device": lambda self: self._values.get_device()})]


def _moved(nt: NestedTensor, dst: int, non_blocking: bool, move_part) -> NestedTensor:
    """What NJT's own `_to_copy` does (torch/nested/_internal/ops.py to_copy_default): values, offsets and lengths
    each copied, the ragged size kept by registering the new offsets (or lengths) under the old nested int."""
    values = move_part(nt._values, dst, non_blocking)
    offsets = move_part(nt._offsets, dst, non_blocking)
    lengths = None if nt._lengths is None else move_part(nt._lengths, dst, non_blocking)
    source, target = (nt._offsets, offsets) if lengths is None else (nt._lengths, lengths)
    _tensor_symint_registry[target] = get_tensor_symint(source, coeff=1)
    return NestedTensor(values, offsets, lengths=lengths, _ragged_idx=nt._ragged_idx,
                        _metadata_cache=dict(nt._metadata_cache))


class _Move(torch.autograd.Function):
    """`nt.to(device)`: the gradient, a jagged tensor too, travels back to the source device."""

    @staticmethod
    def forward(ctx, nt, dst, non_blocking, move_part, src):
        ctx.src, ctx.move_part = src, move_part
        return _moved(nt, dst, non_blocking, move_part)

    @staticmethod
    def backward(ctx, grad):
        return _moved(grad, ctx.src, False, ctx.move_part), None, None, None, None


def move(nt: NestedTensor, dst: int, non_blocking: bool, move_part, src: int) -> NestedTensor:
    """Move a jagged tensor from emulated device `src` to `dst`, with `move_part(tensor, dst, non_blocking)` copying
    (and timing) each of its tensors."""
    return _Move.apply(nt, dst, non_blocking, move_part, src)
