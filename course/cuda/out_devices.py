"""Tensors on two devices where a GPU op writes one of them: refused in ATen's words for that op.

A 0-dim host tensor may join a GPU op as an input, never as what it writes: neither `out=` nor the self of an
in-place op (`host_scalar += gpu_scalar`). The ops whose native_functions.yaml entry inherits TensorIteratorBase
(add, mul, pow, sin, clamp, ... and their in-place and functional forms, which delegate to them) check every operand
in TensorIterator's compute_types, which names the first GPU operand's device first: "Expected all tensors to be on
the same device, but found at least two devices, cuda:0 and cpu!". The other structured ops that skip the generated
device check (`device_check: NoCheck`: sum, mean, max.dim, ...) refuse an out tensor in their generated resize_out:
"Expected out tensor to have device cuda:0, but got cpu instead"; `mode.values` checks in its own words (mode_out,
TensorCompare.cpp), and the rest in the generated check's, argument by argument (the emulator's `device_mismatch`).
The host stand-ins PyTorch's own C++ writes (DDP's reducer) still pass, as in `kernels._common_device`.
"""
from __future__ import annotations

import functools

import torch

from course.cuda import native_functions
from course.cuda.devices import CPU, EmulatedTensor, device_mismatch, device_name

_MODE_VALUES = "mode.values"


def _resized(name: str) -> bool:
    """Whether the op is a structured one that skips the generated device check, checking its out tensor in its
    generated resize_out instead (sum, mean, max.dim, ...)."""
    entry = native_functions.fields(name)
    return entry.get("structured") == "True" and entry.get("device_check") == "NoCheck"


@functools.cache
def _written(func) -> tuple[tuple[str, ...], bool]:
    """The op's out arguments, and whether it writes its first argument (an in-place op)."""
    arguments = func._schema.arguments
    first = arguments[0].alias_info if arguments else None
    return tuple(a.name for a in arguments if a.is_out), bool(first is not None and first.is_write)


def _index(t: torch.Tensor) -> int:
    return t._device_index if isinstance(t, EmulatedTensor) else CPU


def _iterator_refusal(outputs, inputs) -> RuntimeError | None:
    """TensorIterator's compute_types: the common device is the first GPU operand's, outputs first; a 0-dim host
    input may join it, nothing else."""
    common = next((_index(t) for t in outputs + inputs if _index(t) != CPU), CPU)
    for position, t in enumerate(outputs + inputs):
        if _index(t) != common and not (position >= len(outputs) and t.dim() == 0 and _index(t) == CPU):
            return RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                                f"{device_name(common)} and {device_name(_index(t))}!")
    return None


def refusal(func, args, kwargs) -> RuntimeError | None:
    """ATen's error for the op's mix of devices where it writes a tensor, or where it is a TensorIterator op (whose
    error names the GPU first); None where `kernels._common_device`'s rules apply."""
    names, inplace = _written(func)
    name = native_functions.op_name(func)
    iterator = native_functions.runs_on_tensor_iterator(name)
    if iterator:  # an in-place op's self is written too (copy_, index_put_ and the like are not these)
        inplace = inplace and isinstance(args[0], torch.Tensor)
    elif names:
        inplace = False
    else:
        return None
    outputs = [kwargs[n] for n in names if isinstance(kwargs.get(n), torch.Tensor)] + list(args[:int(inplace)])
    inputs = [a for a in list(args[int(inplace):]) + [v for k, v in kwargs.items() if k not in names]
              if isinstance(a, torch.Tensor)]
    if iterator:
        return _iterator_refusal(outputs, inputs)
    placed = [t for t in inputs if isinstance(t, EmulatedTensor) or t.dim() > 0]
    if not placed:
        return None
    device = _index(placed[0])
    for out in outputs:
        if _index(out) == device:
            continue
        if name == _MODE_VALUES:
            which = next(n for n in names if kwargs.get(n) is out)
            return RuntimeError(f"expected device '{device_name(device)}' but got '{device_name(_index(out))}' for "
                                f"{which} output")
        if _resized(name):
            return RuntimeError(f"Expected out tensor to have device {device_name(device)}, but got "
                                f"{device_name(_index(out))} instead")
        return device_mismatch(device, _index(out))
    return None
