"""The aten moves a traced graph calls (`torch.export`'s `ep.module()`, FX graphs), routed as `Tensor.to` is.

A graph calls ops such as `torch.ops.aten.to.device(x, cuda:1, float32)` or `aten.type_as(mask, x)` itself, not the
Tensor methods the emulator routes: their C++ reads the other tensor's device off its wrapper (the host's) or would
allocate on a CUDA device a CPU build lacks. Each is handed to the emulator's `.to()` with the same meaning (the
schemas are in aten/src/ATen/native/native_functions.yaml). `_assert_tensor_metadata`, which export adds to check a
`.to()`'s input, compares the emulated device and checks the rest on the host tensor.
"""
from __future__ import annotations

import torch

from course.cuda.devices import EmulatedTensor, parse_device

aten = torch.ops.aten


def handlers(to, type_as) -> dict:
    """The handlers, over the emulator's `Tensor.to` and `Tensor.type_as` (course/cuda/interception.py)."""

    def to_device(self, device, dtype, non_blocking=False, copy=False, memory_format=None):
        return to(self, device, dtype, non_blocking=non_blocking, copy=copy, memory_format=memory_format)

    def to_dtype_layout(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
                        copy=False, memory_format=None):
        if layout not in (None, torch.strided) or pin_memory:
            with torch._C.DisableTorchFunctionSubclass():
                return aten.to.dtype_layout(self, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
                                            non_blocking=non_blocking, copy=copy, memory_format=memory_format)
        return to(self, device=device, dtype=dtype, non_blocking=non_blocking, copy=copy, memory_format=memory_format)

    def to_other(self, other, non_blocking=False, copy=False, memory_format=None):
        return to(self, other, non_blocking=non_blocking, copy=copy, memory_format=memory_format)

    def assert_tensor_metadata(a, size=None, stride=None, dtype=None, *, device=None, layout=None):
        if device is not None and isinstance(a, EmulatedTensor) and parse_device(device) != a.get_device():
            raise RuntimeError(f"Tensor device mismatch! Expected: {device}, Got: {a.device}")
        inner = a._inner if isinstance(a, EmulatedTensor) else a
        with torch._C.DisableTorchFunctionSubclass():
            return aten._assert_tensor_metadata.default(inner, size, stride, dtype,
                                                        device=None if inner is not a else device, layout=layout)

    return {aten.to.device: to_device, aten.to.dtype_layout: to_dtype_layout, aten.to.other: to_other,
            aten.type_as.default: type_as, aten._assert_tensor_metadata.default: assert_tensor_metadata}
