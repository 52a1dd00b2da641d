"""`torch.save` and `torch.load` of tensors on emulated GPUs: files are the checkpoints a CUDA box writes.

PyTorch saves every storage with a location tag ('cpu', 'cuda:1') asked of the taggers in
`torch.serialization._package_registry`; on loading, it hands each storage (read into CPU memory) and its
tag, remapped by `map_location`, to the deserializers of the same registry. While the emulator runs:

- inside `torch.save`, an `EmulatedTensor` pickles as a plain tensor on its inner CPU storage (what
  `Tensor.__reduce_ex__` gives for a CUDA tensor), and the emulator's tagger, first in the registry, tags that
  storage 'cuda:i'; the copy of each storage to the host is charged;
- its deserializer, first too, takes 'cuda' and 'cuda:i' locations: it checks the index as PyTorch checks
  real GPUs (`validate_cuda_device`, so the errors read like CUDA's), counts the storage's memory on that
  GPU, charges the host-to-GPU copy and marks the storage with the GPU's `Block`;
- `UntypedStorage.to`/`.cuda()`/`.cpu()` do the same for `map_location=lambda storage, loc: storage.cuda(i)`;
- a tensor rebuilt on a marked storage becomes an `EmulatedTensor` on that GPU, tensors sharing a storage
  sharing its block (the hook is `torch._utils._restore_device_fake_mode`, which every rebuild ends with).

So `map_location` (None, a device string or `torch.device`, a dict, a callable) and `weights_only=True` work
as on a GPU box, and outside the emulator torch.load asks for `map_location="cpu"`, as a CPU-only machine
does. Other pickling (torch.multiprocessing, object collectives) sends a CPU copy and the device (`reduce_ex`).
"""
from __future__ import annotations

import collections
import functools
import re
import threading

import torch
import torch._utils
import torch.serialization

from course.cuda import devices
from course.cuda.devices import CPU, EmulatedTensor, current_emulator, parse_device, wrap
from course.cuda.transfers import charge_copy, move, to_host_copy

_original_restore_device = torch._utils._restore_device_fake_mode
_original_storage_to = torch.UntypedStorage.to
_original_storage_cpu = torch.UntypedStorage.cpu
_CUDA_LOCATION = re.compile(r"cuda(:|[0-9]+|$)")  # what torch.serialization._deserialize takes as 'cuda'

# Per thread, while torch.save runs: storage (by `_cdata`, as torch.save keys them) -> (storage, GPU index).
_saving = threading.local()
# Per thread, while torch.load runs (its storages must keep showing the CPU, see _storage_to).
_loading = threading.local()


def saving() -> bool:
    """Whether this thread is inside torch.save (rather than other pickling, such as torch.multiprocessing)."""
    return getattr(_saving, "storages", None) is not None


def _during_save(save):
    @functools.wraps(save)
    def wrapper(*args, **kwargs):
        outer = getattr(_saving, "storages", None)
        _saving.storages = {}
        try:
            return save(*args, **kwargs)
        finally:
            _saving.storages = outer
    return wrapper


def reduce_ex(tensor: EmulatedTensor):
    """`EmulatedTensor.__reduce_ex__`: inside torch.save, what a CUDA tensor saves as; other pickling
    (torch.multiprocessing, object collectives) sends a CPU copy plus the device, rebuilt there."""
    if saving():
        return reduce_for_save(tensor)
    return (_rebuild_emulated, (to_host_copy(tensor), tensor._device_index, tensor.requires_grad))


def _rebuild_emulated(host_tensor: torch.Tensor, device_index: int, requires_grad: bool):
    """Unpickling inside an emulator gives the tensor back on its fake GPU; outside, on the CPU."""
    if devices.active is None or device_index == CPU:
        return host_tensor.requires_grad_(requires_grad)
    return move(host_tensor, device_index).requires_grad_(requires_grad)


torch.serialization.add_safe_globals([_rebuild_emulated])


def reduce_for_save(tensor: EmulatedTensor):
    """What an `EmulatedTensor` pickles as inside torch.save: what `Tensor.__reduce_ex__` gives a CUDA tensor."""
    emu = current_emulator("torch.save")
    inner = tensor._inner
    if inner.is_meta:
        raise RuntimeError(
            "torch.save needs values, but this tensor is shape-only (course.emulate(materialize=False) computes "
            "shapes, times and memory, not numbers). Use materialize=True to save checkpoints.")
    if inner.layout is not torch.strided:  # saved as its parts, each a CUDA tensor (Tensor._reduce_ex_internal)
        if inner.layout is torch.sparse_coo:
            return torch._utils._rebuild_sparse_tensor, (
                inner.layout, (tensor._indices(), tensor._values(), tensor.size(), tensor.is_coalesced()))
        compressed, plain = (getattr(tensor, name)() for name in devices.COMPRESSED_PARTS[inner.layout])
        return torch._utils._rebuild_sparse_tensor, (inner.layout, (compressed, plain, tensor.values(), tensor.size()))
    hooks = collections.OrderedDict()
    if getattr(tensor, "_is_param", False):  # nn.Parameter around a tensor subclass
        return torch._utils._rebuild_parameter, (tensor.detach(), tensor.requires_grad, hooks)
    storage = inner.untyped_storage()
    if tensor._device_index != CPU:
        storages = _saving.storages
        if storage._cdata not in storages:  # each storage is written (copied to the host) once
            storages[storage._cdata] = (storage, tensor._device_index)
            charge_copy(emu, tensor._device_index, CPU, storage.nbytes(), tensor.ready_ns)
    args = (inner.storage_offset(), tuple(inner.size()), inner.stride(), tensor.requires_grad, hooks)
    if tensor.dtype in torch.storage._new_dtypes():
        rebuild, args = torch._utils._rebuild_tensor_v3, (storage,) + args + (tensor.dtype,)
    else:
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=tensor.dtype, _internal=True)
        rebuild, args = torch._utils._rebuild_tensor_v2, (typed,) + args
    metadata = torch._utils.get_tensor_metadata(inner)
    return rebuild, args + ((metadata,) if metadata else ())


def _during_load(load):
    @functools.wraps(load)
    def wrapper(*args, **kwargs):
        outer = getattr(_loading, "active", False)
        _loading.active = True
        try:
            return load(*args, **kwargs)
        finally:
            _loading.active = outer
    return wrapper


def _tag(storage) -> str | None:
    """Location tag of a storage torch.save is writing: 'cuda:i' for an emulated GPU's."""
    storages = getattr(_saving, "storages", None)
    entry = storages.get(getattr(storage, "_cdata", None)) if storages else None
    return None if entry is None else f"cuda:{entry[1]}"


def host_copy(storage):
    """A host copy of a storage's bytes (PyTorch's `clone` would make it on `.device`, which a CPU build cannot):
    what the emulator's own storage moves start from, and mark."""
    return torch.UntypedStorage(storage.nbytes()).copy_(storage)


def _block(storage):
    """The emulated GPU memory a (CPU) storage stands for, if any."""
    return getattr(storage, "_course_block", None)


def _to_gpu(storage, index: int, non_blocking: bool = False):
    """A copy of the storage on emulated GPU `index`: its bytes counted there, the copy charged.

    Always a copy, as on a GPU: a storage torch.load(mmap=True) hands over maps the file itself, which the
    next torch.save to the same path would pull from under the loaded tensors."""
    emu = current_emulator(f"copy to cuda:{index}")
    block = _block(storage)
    if block is not None and block.device == index:
        return storage
    nbytes = storage.nbytes()
    new_block = emu.memory.allocate(index, nbytes)  # out of memory before anything is copied
    moved = host_copy(storage)
    source, ready_ns = (CPU, 0) if block is None else (block.device, block.ready_ns)
    new_block.ready_ns = charge_copy(emu, source, index, nbytes, ready_ns, non_blocking=non_blocking)
    moved._course_block = new_block
    return moved


def _restore(storage, location: str):
    """Deserializer for 'cuda' locations: the index checked as PyTorch checks real GPUs, then to that GPU."""
    if not _CUDA_LOCATION.match(location):
        return None
    return _to_gpu(storage, torch.serialization.validate_cuda_device(location))


def _restore_device(tensor):
    """The end of every tensor rebuild: a tensor on a storage restored to an emulated GPU goes there."""
    tensor = _original_restore_device(tensor)
    if type(tensor) is not torch.Tensor:
        return tensor
    block = _block(tensor.untyped_storage())
    if block is None:
        return tensor
    inner = tensor.detach()
    if not current_emulator("torch.load").materialize:
        with torch._C.DisableTorchFunction():
            inner = inner.to("meta")
    return wrap(inner, block.device, block, tensor.requires_grad)


def _storage_to(self, *, device, non_blocking=False):
    """`storage.to(device)` and `storage.cuda(i)`, as in `map_location=lambda storage, loc: storage.cuda(i)`."""
    device = torch.device(device)
    if device.type == "cuda":
        moved = _to_gpu(self, parse_device(device), non_blocking=non_blocking)
        if not getattr(_loading, "active", False):  # a program's own storage.cuda(): its .device says so
            moved._course_shown_on = moved._course_block
        return moved
    block = _block(self)
    if device.type == "cpu" and block is not None:
        emu = current_emulator("copy to cpu")
        charge_copy(emu, block.device, CPU, self.nbytes(), block.ready_ns)
        return host_copy(self)
    return _original_storage_to(self, device=device, non_blocking=non_blocking)


# Named as PyTorch's, so a wrong call (`storage.to("cuda:0")`: the device is keyword-only) fails alike.
_storage_to.__name__, _storage_to.__qualname__ = "to", "_StorageBase.to"


def _storage_cpu(self):
    return _storage_to(self, device="cpu") if _block(self) is not None else _original_storage_cpu(self)


def patches() -> list[tuple[object, dict]]:
    """What the emulator puts in place while it runs: the 'cuda' tagger and deserializer first in line."""
    registry = [(0, _tag, _restore)] + torch.serialization._package_registry
    return [(torch.serialization, {"_package_registry": registry,
                                   "_save": _during_save(torch.serialization._save),
                                   "_legacy_save": _during_save(torch.serialization._legacy_save),
                                   "_load": _during_load(torch.serialization._load),
                                   "_legacy_load": _during_load(torch.serialization._legacy_load)}),
            (torch._utils, {"_restore_device_fake_mode": _restore_device}),
            (torch.UntypedStorage, {"to": _storage_to, "cpu": _storage_cpu})]
