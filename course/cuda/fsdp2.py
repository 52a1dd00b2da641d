"""FSDP2 (`fully_shard`) on emulated GPUs: freeing and re-growing the unsharded parameters' memory.

After a block's forward and backward, FSDP2 frees the all-gathered (unsharded) parameters by resizing their
storage to zero bytes, and grows it back before the next all-gather (torch/distributed/fsdp/_fully_shard/
_fsdp_param.py, `free_storage` / `alloc_storage`). An emulated tensor's Python storage is a placeholder that
cannot be resized, so these two do it on the CPU storage inside and resize its block in the emulated GPU's memory
(DeviceMemory.resize, as `storage.resize_` does), which is what makes FSDP's memory saving show in
`torch.cuda.memory_allocated` and `torch.cuda.memory_snapshot()`.

A DTensor is a wrapper made in C++ from its local tensor's C++ device, which for an emulated tensor is the CPU, so
it would say `device(type='cpu')` where a GPU box says `cuda:0`, and `torch.optim`'s foreach test
(`_default_to_fused_or_foreach`: a supported type *on a CUDA device*) would send FSDP's optimizer down its
per-parameter loop instead of the multi-tensor kernels a GPU runs. `dtensor_patches` makes DTensor report its local
tensor's device when that tensor is emulated.
"""
from __future__ import annotations

import functools
import importlib
import sys

import torch

from course.cuda.devices import EmulatedTensor, current_emulator

# Imported by every FSDP2 entry point; it imports _fsdp_param, the other module that calls the two.
FSDP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_PARAM_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param"
_INIT_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_init"


def _fsdp_own(name: str):
    """FSDP's own function (for tensors not on an emulated GPU): the module keeps it under another name once
    `patches` has replaced it, and under its own before."""
    module = importlib.import_module(_PARAM_MODULE)
    return getattr(module, "_course_fsdp_" + name, None) or getattr(module, name)


def alloc_storage(tensor) -> None:
    if not isinstance(tensor, EmulatedTensor):
        return _fsdp_own("alloc_storage")(tensor)
    size = tensor.numel() * tensor.itemsize
    storage = tensor._inner.untyped_storage()
    if storage.size() != size:
        if tensor._block is not None:
            current_emulator("FSDP2 alloc_storage").memory.resize(tensor._block, size)
        storage.resize_(size)


def free_storage(tensor) -> None:
    if not isinstance(tensor, EmulatedTensor):
        return _fsdp_own("free_storage")(tensor)
    storage = tensor._inner.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)
        if tensor._block is not None:
            current_emulator("FSDP2 free_storage").memory.resize(tensor._block, 0)


DTENSOR_MODULE = "torch.distributed.tensor"


def _dtensor_device(original):
    def device(self):
        local = self._local_tensor
        return local.device if isinstance(local, EmulatedTensor) else original.__get__(self)
    return property(device)


def _dtensor_is_cuda(original):
    def is_cuda(self):
        local = self._local_tensor
        return local.is_cuda if isinstance(local, EmulatedTensor) else original.__get__(self)
    return property(is_cuda)


def dtensor_patches() -> list:
    """(DTensor, replacements) for the emulator to put in place once DTensor is imported, else nothing."""
    module = sys.modules.get(DTENSOR_MODULE)
    # another rank thread may be importing DTensor right now: the module is then in sys.modules without
    # the class yet, and the next call (every group creation and collective makes one) patches it
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None or isinstance(dtensor.__dict__.get("device"), property):
        return []
    return [(dtensor, {"device": _dtensor_device(dtensor.device), "is_cuda": _dtensor_is_cuda(dtensor.is_cuda)})]


def in_place() -> bool:
    return getattr(sys.modules.get(_PARAM_MODULE), "free_storage", None) is free_storage


def move_states_to_device(original):
    """FSDP1's and FSDP2's `_move_states_to_device` for a CPU module sharded onto a GPU: they move each parameter with
    `param.data = param.to(device)`, which cannot turn a CPU tensor into an emulated one, so on an emulated GPU each is
    swapped for its moved copy instead (`torch.utils.swap_tensors`, what `Module.to` does here), and every reference
    to a parameter still sees it."""
    @functools.wraps(original)
    def move(params, buffers, device):
        if device is None or device.type != "cuda":
            return original(params, buffers, device)
        with torch.no_grad():
            for tensor in list(params) + list(buffers):
                if tensor.device == device or tensor.device.type == "meta":
                    continue
                moved = tensor.to(device)
                if isinstance(tensor, torch.nn.Parameter):
                    moved = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
                grad = tensor.grad
                torch.utils.swap_tensors(tensor, moved)
                if grad is not None:
                    tensor.grad = grad.to(device)
    move.course_emulated = True
    return move


def init_patches() -> list:
    """`fully_shard(cpu_module)` moves the module to the mesh's GPU in `_fsdp_init._move_states_to_device`."""
    init = sys.modules.get(_INIT_MODULE)
    original = getattr(init, "_move_states_to_device", None)
    if original is None or getattr(original, "course_emulated", False):
        return []
    return [(init, {"_move_states_to_device": move_states_to_device(original)})]


def patches() -> list:
    """(module, replacements) for the emulator to put in place; FSDP's modules must be imported already."""
    param, param_group = sys.modules[_PARAM_MODULE], sys.modules[FSDP_MODULE]
    for name in ("alloc_storage", "free_storage"):
        if not hasattr(param, "_course_fsdp_" + name):
            setattr(param, "_course_fsdp_" + name, getattr(param, name))
    return [(param, {"alloc_storage": alloc_storage, "free_storage": free_storage}),
            (param_group, {"alloc_storage": alloc_storage})]
