"""FSDP2 (`fully_shard`) on emulated GPUs: freeing and re-growing the unsharded parameters' memory.

After a block's forward and backward, FSDP2 frees the all-gathered (unsharded) parameters by resizing their
storage to zero bytes, and grows it back before the next all-gather (torch/distributed/fsdp/_fully_shard/
_fsdp_param.py, `free_storage` / `alloc_storage`). An emulated tensor's Python storage is a placeholder that
cannot be resized, so these two do it on the CPU storage inside and give the bytes back to (or take them
from) the emulated GPU's memory count, which is what makes FSDP's memory saving show in
`torch.cuda.memory_allocated`.
"""
from __future__ import annotations

import sys

from course.devices import EmulatedTensor

# Imported by every FSDP2 entry point; it imports _fsdp_param, the other module that calls the two.
FSDP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_PARAM_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param"


def _fsdp_own(name: str):
    """FSDP's own function (for tensors not on an emulated GPU): the module keeps it under another name."""
    return getattr(sys.modules[_PARAM_MODULE], "_course_fsdp_" + name)


def _recount(block, nbytes: int) -> None:
    """Make `block` (shared by the tensor and all its views) count `nbytes` from now on: a block of the new
    size is allocated (so the capacity check and peak apply), the two swap their counts, and the old count
    goes when the spare block dies. Only `DeviceMemory.allocate` and the block's slots are used."""
    spare = block.memory.allocate(block.device, nbytes, block.ready_ns)
    for slot in type(block).__slots__:
        if slot not in ("memory", "device", "ready_ns"):
            kept = getattr(block, slot)
            setattr(block, slot, getattr(spare, slot))
            setattr(spare, slot, kept)
    del spare


def alloc_storage(tensor) -> None:
    if not isinstance(tensor, EmulatedTensor):
        return _fsdp_own("alloc_storage")(tensor)
    size = tensor.numel() * tensor.itemsize
    storage = tensor._inner.untyped_storage()
    if storage.size() != size:
        if tensor._block is not None:
            _recount(tensor._block, size)
        storage.resize_(size)


def free_storage(tensor) -> None:
    if not isinstance(tensor, EmulatedTensor):
        return _fsdp_own("free_storage")(tensor)
    storage = tensor._inner.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)
        if tensor._block is not None:
            _recount(tensor._block, 0)


def in_place() -> bool:
    return getattr(sys.modules.get(_PARAM_MODULE), "free_storage", None) is free_storage


def patches() -> list:
    """(module, replacements) for the emulator to put in place; FSDP's modules must be imported already."""
    param, param_group = sys.modules[_PARAM_MODULE], sys.modules[FSDP_MODULE]
    for name in ("alloc_storage", "free_storage"):
        if not hasattr(param, "_course_fsdp_" + name):
            setattr(param, "_course_fsdp_" + name, getattr(param, name))
    return [(param, {"alloc_storage": alloc_storage, "free_storage": free_storage}),
            (param_group, {"alloc_storage": alloc_storage})]
