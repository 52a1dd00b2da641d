"""Foreach ops whose tensor lists span devices, or whose scalars come packed in a host tensor, run as CUDA runs them.

CUDA's multi-tensor kernels need every tensor on one device; when a list spans GPUs (or GPUs and the host), ATen
takes its slow path (`can_use_fast_route` fails in ATen's ForeachUtils.h), which calls the per-tensor op for each
index, so only the tensors at one index must share a device. test_foreach.py's `test_*_tensors_on_different_devices`
expects exactly that. The emulator runs such a call index by index, each as the same foreach op over one tensor: one
kernel each, as the slow path launches, and each index's own device check refuses what the per-tensor op refuses.

`_foreach_copy_(dst, src)` with a source on another device than its destination also takes the slow path: each
index is one `copy_`, a transfer between devices (the emulator's copies time it on its link).

`_foreach_add(gpu_tensors, scalar)` reads its 0-dim scalar tensor on the GPU in CUDA's multi-tensor kernel, which
refuses a host one ("scalar tensor expected to be on cuda:0 but is on cpu", ForeachBinaryOpScalarTensor.cu); only
the slow path, for lists that kernel does not take, adds a host scalar (mul and div read a host one first instead).

`_foreach_addcmul/addcdiv(tensors, t1, t2, scalars)` with a 1-D tensor of scalars reads it on the host (ATen's
`convert_tensor_to_scalar_list`): a CPU tensor joins any device's lists and a GPU one is refused. The emulator reads
it the same way and runs the op's ScalarList form.
"""
from __future__ import annotations

import threading

import torch
from torch._prims_common import _is_non_overlapping_and_dense_or_false

from course.cuda.devices import CPU, EmulatedTensor


PACKED_SCALARS = {getattr(getattr(torch.ops.aten, name), "Tensor") for name in
                  ("_foreach_addcmul", "_foreach_addcmul_", "_foreach_addcdiv", "_foreach_addcdiv_")}


def _index_device(tensor) -> int:
    return tensor._device_index if isinstance(tensor, EmulatedTensor) else CPU


def _tensor_list(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        t is None or isinstance(t, torch.Tensor) for t in value)


def _first_list(args):
    """The first tensor list (`self`; `exponent` of `_foreach_pow(scalar, tensors)`): its tensors set the devices."""
    return next((a for a in args if _tensor_list(a)), None)


def _spans_devices(func, args) -> bool:
    """Whether `func` is a foreach op whose first tensor list holds tensors of more than one device."""
    if not func._schema.name.startswith("aten::_foreach_"):
        return False
    tensors = _first_list(args)
    return tensors is not None and len({_index_device(t) for t in tensors if t is not None}) > 1


def _part(value, position, count):
    """The part of one argument that goes with the tensors at `position`: a list of one entry per index (tensor
    lists, scalar lists: foreach schemas have no other lists) gives that entry alone."""
    if isinstance(value, (list, tuple)) and len(value) == count:
        return [value[position]]
    return value


_COPY = torch.ops.aten._foreach_copy_.default
_ADD_TENSOR = {torch.ops.aten._foreach_add.Tensor, torch.ops.aten._foreach_add_.Tensor}


def _data(tensor) -> torch.Tensor:
    return tensor._inner if isinstance(tensor, EmulatedTensor) else tensor


_slow_path = threading.local()  # set while a call runs index by index: its parts are the slow path's per-tensor ops


def _adds_host_scalar(func, args) -> bool:
    return (func in _ADD_TENSOR and bool(args[0]) and isinstance(args[1], torch.Tensor)
            and _index_device(args[1]) == CPU and not getattr(_slow_path, "on", False))


def _on_fast_route(tensors, scalar, alpha) -> bool:
    """Whether CUDA's multi-tensor kernel takes `_foreach_add(tensors, scalar, alpha=alpha)` (ATen's
    can_use_fast_route): dense tensors of one GPU and one dtype, the scalar's, that alpha does not promote."""
    device, dtype = _index_device(tensors[0]), tensors[0].dtype
    dense = all(_index_device(t) == device and t.dtype == dtype and t.layout == torch.strided
                and _is_non_overlapping_and_dense_or_false(t.shape, _data(t).stride()) for t in tensors)
    return device != CPU and scalar.dtype == dtype and dense and torch.result_type(_data(tensors[0]), alpha) == dtype


def _copies_across(func, args) -> bool:
    return func is _COPY and any(_index_device(d) != _index_device(s) for d, s in zip(args[0], args[1]))


def reroutes(func, args) -> bool:
    """Whether `run` takes this op rather than the dispatcher's one-device path."""
    return (func in PACKED_SCALARS or _copies_across(func, args) or _adds_host_scalar(func, args)
            or _spans_devices(func, args))


def run(func, args, kwargs):
    """A foreach op that `reroutes`: packed scalars read on the host, a copy or a list across devices index by index."""
    if func in PACKED_SCALARS:
        return _with_scalar_list(func, *args, **kwargs)
    if _copies_across(func, args):
        non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        for destination, source in zip(args[0], args[1]):
            destination.copy_(source, non_blocking=non_blocking)
        return None
    if _adds_host_scalar(func, args) and _on_fast_route(args[0], args[1], kwargs.get("alpha", 1)):
        raise RuntimeError(f"scalar tensor expected to be on {args[0][0].device} but is on cpu")
    return _run_per_index(func, args, kwargs)


def _with_scalar_list(func, tensors, tensor1, tensor2, scalars):
    """The op's ScalarList form with the scalars read from their tensor, after ATen's checks of that tensor."""
    if _index_device(scalars) != CPU:
        raise RuntimeError(f"Expected scalars to be on CPU, got cuda:{scalars._device_index} instead.")
    if not scalars.is_contiguous():
        raise RuntimeError("Expected scalars to be contiguous.")
    if scalars.dim() != 1:
        raise RuntimeError(f"Expected packed scalar Tensor to be of dimension 1. Got {scalars.dim()} instead.")
    if scalars.numel() != len(tensors):
        raise RuntimeError(f"Expected length of scalars to match input of length {len(tensors)} but got "
                           f"{scalars.numel()} instead.")
    return func._overloadpacket.ScalarList(tensors, tensor1, tensor2, scalars.tolist())


def _run_per_index(func, args, kwargs):
    """Run a foreach op on each index's tensors alone; its results (none for in-place ops) in index order. A scalar
    tensor (`_foreach_mul(tensors, other)`) is checked first, as the slow path checks it."""
    other = args[1] if len(args) > 1 else None
    if isinstance(other, torch.Tensor) and func._schema.arguments[1].name == "other" and \
            (other.dim(), other.numel()) != (0, 1):
        raise RuntimeError(f"scalar tensor expected to be 0 dim but it has {other.dim()} dimensions and "
                           f"{other.numel()} elements.")
    count = len(_first_list(args))
    results = []
    _slow_path.on = True
    try:
        for position in range(count):
            out = func(*[_part(a, position, count) for a in args],
                       **{k: _part(v, position, count) for k, v in kwargs.items()})
            if out is not None:
                results.extend(out)
    finally:
        _slow_path.on = False
    return results or None
