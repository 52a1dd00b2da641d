"""`tensor.untyped_storage()` and `tensor.storage()` of a tensor on an emulated GPU: the CPU storage inside it,
marked as that GPU's memory.

An emulated tensor's own storage is a placeholder (it holds nothing: reading it fails). Its inner CPU storage
holds the values, and is marked with the tensor's `Block`, so that `.device` says `cuda:i`, `.is_cuda` is True, and
`.cpu()` is a copy to the host, as for a CUDA storage (the mark is not the one torch.load puts on the storages it
restores to a GPU, course/cuda/checkpoints.py: PyTorch rebuilds tensors on those from their `.device`, which must
stay the CPU's). Inside torch.save the mark is not shown: the emulator's tagger has already put the
storage down as 'cuda:i' and charged its copy (checkpoints.reduce_ex), which torch.save would otherwise repeat.
"""
from __future__ import annotations

import torch

from course.cuda.checkpoints import host_copy, saving
from course.cuda.devices import CPU, EmulatedTensor, current_emulator, device_name
from course.cuda.transfers import charge_copy

_untyped_storage = torch.Tensor.untyped_storage
_tensor_typed_storage = torch.Tensor._typed_storage
_storage_device = torch._C.StorageBase.device
_storage_is_shared = torch._C.StorageBase.is_shared
_storage_resize = torch._C.StorageBase.resize_
_typed_storage_removal_warning = torch.storage._warn_typed_storage_removal


def untyped_storage(tensor):
    if not isinstance(tensor, EmulatedTensor) or tensor._device_index == CPU or tensor._block is None:
        with torch._C.DisableTorchFunctionSubclass():
            return _untyped_storage(tensor)
    storage = tensor._inner.untyped_storage()
    storage._course_shown_on = tensor._block
    return storage


def typed_storage(tensor):
    """`tensor.storage()`: the deprecated TypedStorage, over the storage above."""
    if not isinstance(tensor, EmulatedTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.storage(tensor)
    _typed_storage_removal_warning()
    return _typed_storage(tensor)


def shown_as_host(storage):
    """The storage without its GPU mark, as the CPU storage it is: for torch.multiprocessing, which shares a
    storage it takes for CUDA memory through CUDA IPC (course/cuda/sharing.py)."""
    storage.__dict__.pop("_course_shown_on", None)
    return storage


def _typed_storage(tensor):
    """`Tensor._typed_storage`, which `share_memory_()` and `is_shared()` read: for a GPU tensor, over the storage
    above, so that they do what they do for CUDA tensors (nothing, and True) rather than share the placeholder,
    which crashes the process."""
    if not isinstance(tensor, EmulatedTensor) or tensor._device_index == CPU or tensor._block is None:
        return _tensor_typed_storage(tensor)
    return torch.TypedStorage(wrap_storage=untyped_storage(tensor), dtype=tensor.dtype, _internal=True)


def _device(storage) -> torch.device:
    block = getattr(storage, "_course_shown_on", None)
    if block is None or saving():
        return _storage_device.__get__(storage)
    return torch.device(device_name(block.device))


def _is_shared(storage) -> bool:
    """A CUDA storage always counts as shared (PyTorch's `Tensor.is_shared`: "always True for CUDA tensors")."""
    return getattr(storage, "_course_shown_on", None) is not None or _storage_is_shared(storage)


def _clone(storage):
    """`storage.clone()`: a copy on the storage's device; for a GPU's, new memory there and a copy on its clock."""
    copy = host_copy(storage)
    block = getattr(storage, "_course_shown_on", None)
    if block is not None and not saving():
        emu = current_emulator("storage.clone")
        copy._course_shown_on = emu.memory.allocate(block.device, storage.nbytes())
        copy._course_shown_on.ready_ns = charge_copy(emu, block.device, block.device, storage.nbytes(), block.ready_ns)
    return copy


def _resize(storage, nbytes):
    """`storage.resize_(n)`: for a GPU's, its memory counts n bytes from now on (FSDP frees parameters this way)."""
    _storage_resize(storage, nbytes)
    block = getattr(storage, "_course_shown_on", None)
    if block is not None:
        current_emulator("storage.resize_").memory.resize(block, nbytes)
    return storage


_new_storage = torch._C.StorageBase.__new__


def _new(cls, *args, device=None, **kwargs):
    """`torch.UntypedStorage(n, device="cuda")` (and the TypedStorage and `torch.cuda.FloatStorage` built on it): the
    storage of a new tensor of n bytes, or of the bytes given, on the GPU; C++ knows no such device here."""
    if device is None or torch.device(device).type != "cuda":
        return _new_storage(cls, *args, **kwargs) if device is None else _new_storage(cls, *args, device=device,
                                                                                     **kwargs)
    data = args[0] if args else 0
    values = torch.empty(data, dtype=torch.uint8, device=device) if isinstance(data, int) else \
        torch.tensor(list(data), dtype=torch.uint8, device=device)
    return untyped_storage(values)


PATCHES = [(torch.UntypedStorage, {"device": property(_device), "clone": _clone, "is_shared": _is_shared,
                                   "resize_": _resize, "__new__": _new}),
           (torch.Tensor, {"_typed_storage": _typed_storage})]
