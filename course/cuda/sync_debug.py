"""`torch.cuda.set_sync_debug_mode`: warn about (or refuse) the operations that make the host wait for a GPU.

CUDA PyTorch calls `c10::cuda::warn_or_error_on_sync()` (c10/cuda/CUDAFunctions.cpp) from `memcpy_and_sync` and
`stream_synchronize`: a blocking copy to or from a GPU, `.item()`, `Stream.synchronize()`, the ops whose output
size comes from the GPU's data (nonzero, masked_select, unique, boolean-mask indexing and assignment,
repeat_interleave without output_size), and indexing a GPU tensor with host index tensors, which CUDA copies over
from pageable memory. The emulator knows each of
those places, so the mode acts there, with PyTorch's words; torch.cuda.synchronize() does not warn, as on a GPU.
"""
from __future__ import annotations

import warnings

import torch

from course.cuda.devices import current_emulator

_MODES = {"default": 0, "warn": 1, "error": 2}
MESSAGE = "called a synchronizing CUDA operation"

aten = torch.ops.aten
# Ops whose CUDA kernels copy a count to the host and wait for it (all overloads).
DATA_DEPENDENT_OPS = frozenset({aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
                                aten.unique_consecutive, aten.unique_dim_consecutive})
_INDEXING = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                       aten._index_put_impl_.default})
# Overloads that wait in some calls only (is_data_dependent says which).
SOMETIMES = _INDEXING | {aten.repeat_interleave.Tensor}


def set_sync_debug_mode(debug_mode) -> None:
    if isinstance(debug_mode, str):
        if debug_mode not in _MODES:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = _MODES[debug_mode]
    current_emulator("torch.cuda.set_sync_debug_mode").sync_debug_mode = int(debug_mode)


def get_sync_debug_mode() -> int:
    return current_emulator("torch.cuda.get_sync_debug_mode").sync_debug_mode


def on_sync(emu) -> None:
    """`warn_or_error_on_sync`: nothing in the default mode."""
    if emu.sync_debug_mode == 2:
        raise RuntimeError(MESSAGE)
    if emu.sync_debug_mode == 1:
        warnings.warn(MESSAGE, UserWarning, stacklevel=2)


def is_data_dependent(func, args, kwargs) -> bool:
    """Whether an op on a GPU waits for it: the ops above, indexing by a bool mask or by host index tensors, and
    repeat_interleave's count of repeats when no output_size is given."""
    if func._overloadpacket in DATA_DEPENDENT_OPS:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return func in _INDEXING and not _masked_fill(func, args, kwargs) and any(
        isinstance(i, torch.Tensor) and (i.dtype in (torch.bool, torch.uint8) or i.device.type == "cpu")
        for i in (args[1] or ()))


def _masked_fill(func, args, kwargs) -> bool:
    """`x[mask] = 1.0`: ATen's index_put_ runs masked_fill_ for one mask on x's device and a one-element host value
    (canDispatchToMaskedFill, aten/src/ATen/native/TensorAdvancedIndexing.cpp), which does not wait."""
    if func is aten.index.Tensor:
        return False
    self, indices, value = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    masks = [i for i in indices if i is not None]
    return (not accumulate and value.numel() == 1 and value.device.type == "cpu" and len(masks) == 1
            and masks[0].dtype in (torch.bool, torch.uint8) and masks[0].device == self.device)
