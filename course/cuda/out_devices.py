"""An `out=` tensor on another device than the op's inputs, refused in ATen's words for that op.

A GPU op a program calls never writes a host tensor given as `out=`, not even a 0-dim one (which may join a GPU op
as an input); the host stand-ins PyTorch's own C++ writes (DDP's reducer) still pass, as in `kernels._common_device`.
Most ops' CUDA wrappers check that every tensor argument shares one device (the emulator's `device_mismatch`). The
structured ops whose native_functions.yaml entry says `device_check: NoCheck` (TensorIterator's: sum, add, sin,
max.dim, ...) skip that check, and their generated `resize_out` then refuses the out tensor: "Expected out tensor to
have device cuda:0, but got cpu instead". `mode.values` runs its own check (mode_out, TensorCompare.cpp).
"""
from __future__ import annotations

import functools
import pathlib

import torch
import torchgen

from course.cuda.devices import CPU, EmulatedTensor, device_mismatch, device_name

_NATIVE_FUNCTIONS = pathlib.Path(torchgen.__file__).parent / "packaged/ATen/native/native_functions.yaml"
_MODE_VALUES = "aten::mode.values"


@functools.cache
def _resize_out_checked() -> frozenset[str]:
    """`aten::name.overload` of the structured ops whose device check is their generated resize_out."""
    entries = _NATIVE_FUNCTIONS.read_text().split("\n- func:")
    return frozenset("aten::" + entry.split("(")[0].strip() for entry in entries
                     if "\n  structured: True" in entry and "\n  device_check: NoCheck" in entry)


@functools.cache
def _out_names(func) -> tuple[str, ...]:
    return tuple(a.name for a in func._schema.arguments if a.is_out)


def _index(t: torch.Tensor) -> int:
    return t._device_index if isinstance(t, EmulatedTensor) else CPU


def refusal(func, args, kwargs) -> RuntimeError | None:
    """ATen's error if an out tensor is not on the device of the op's first input that is not a host scalar."""
    names = _out_names(func)
    if not names:
        return None
    inputs = [a for a in list(args) + [v for k, v in kwargs.items() if k not in names] if isinstance(a, torch.Tensor)]
    placed = [t for t in inputs if isinstance(t, EmulatedTensor) or t.dim() > 0]
    if not placed:
        return None
    device = _index(placed[0])
    for name in names:
        out = kwargs.get(name)
        if not isinstance(out, torch.Tensor) or _index(out) == device:
            continue
        if func.name() == _MODE_VALUES:
            return RuntimeError(f"expected device '{device_name(device)}' but got '{device_name(_index(out))}' for "
                                f"{name} output")
        if func.name() in _resize_out_checked():
            return RuntimeError(f"Expected out tensor to have device {device_name(device)}, but got "
                                f"{device_name(_index(out))} instead")
        return device_mismatch(device, _index(out))
    return None
