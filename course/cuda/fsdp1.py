"""FSDP1 (`FullyShardedDataParallel`) on emulated GPUs: every sharding strategy, with the memory it saves.

FSDP1 keeps each wrapped module's parameters in one `FlatParameter` (torch/distributed/fsdp/_flat_param.py). To
shard it, `FlatParamHandle.shard` frees the whole flat parameter's storage (`_typed_storage()._resize_(0)`) and
re-points it at its shard with `Tensor.set_`; every all-gather then grows the padded unsharded buffer's storage
(`_alloc_storage`) and frees it after use (`_free_storage`), and the handle tells "allocated" from "freed" by
the storage's size and address (`_same_storage_size`, `_same_storage`, ...). An emulated tensor is a wrapper
whose Python storage is a placeholder, so these module-level helpers are replaced, in that module only, by ones
that act on the CPU storage inside and give the bytes back to (or take them from) the emulated GPU's memory count
(course/cuda/fsdp2.py does the same for FSDP2), and `shard` swaps the flat parameter with `.data =`, which an
emulated tensor follows (interception._set_data), where `set_` would leave the wrapper its unsharded shape.

`FSDP(cpu_model, device_id=...)` moves the module's CPU parameters with `param.data = param.to(device)`
(_init_utils._move_states_to_device), which cannot turn a CPU tensor into an emulated one: on an emulated GPU
they are swapped for their moved copies instead (fsdp2.move_states_to_device, which FSDP2 needs too), so
every reference to a parameter still sees it.

The emulator puts this handling in place when an emulated NCCL group is made or used with FSDP1 imported, and,
for a program that imports FSDP only after making its group, as soon as the import ends (`PatchOnImport`).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

import torch

from course.cuda import fsdp2
from course.cuda.devices import EmulatedTensor

FLAT_PARAM_MODULE = "torch.distributed.fsdp._flat_param"
INIT_MODULE = "torch.distributed.fsdp._init_utils"


def _inner(tensor):
    """The CPU tensor an emulated tensor (or a DTensor's emulated local shard) keeps its values in, else None."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    return tensor._inner if isinstance(tensor, EmulatedTensor) else None


def _shard(original):
    @functools.wraps(original)
    def shard(self):
        flat_param = self.flat_param
        if not (self.uses_sharded_strategy and isinstance(flat_param, EmulatedTensor)):
            return original(self)
        with torch.no_grad():
            sharded, numel_padded = type(self)._get_shard(flat_param, self.rank, self.world_size)
            fsdp2.free_storage(flat_param)  # the views the module still holds share it, as on a GPU
            flat_param.data = sharded
            start = sharded.numel() * self.rank
            self._init_shard_metadata(numel_padded, start, start + sharded.numel() - 1)
        if self._use_orig_params:
            self._use_sharded_views()
    shard.course_emulated = True
    return shard


def _alloc_storage(original):
    def alloc_storage(tensor, size):
        return fsdp2.alloc_storage(tensor) if isinstance(tensor, EmulatedTensor) else original(tensor, size)
    return alloc_storage


def _free_storage(original):
    def free_storage(tensor):
        return fsdp2.free_storage(tensor) if isinstance(tensor, EmulatedTensor) else original(tensor)
    return free_storage


def _on_inner(original, storage_test):
    """A storage test of FSDP's, asked of the CPU tensors inside when the tensors are emulated."""
    def test(*args):
        inner = [_inner(a) if isinstance(a, torch.Tensor) else a for a in args]
        if any(isinstance(a, torch.Tensor) and i is None for a, i in zip(args, inner)):
            return original(*args)
        return storage_test(*inner)
    return test


_STORAGE_TESTS = {
    "_same_storage": lambda a, b: a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(),
    "_same_storage_size": lambda a, numel: a.untyped_storage().size() // a.element_size() == numel,
    "_storage_size_allocated": lambda a: a.untyped_storage().size() > 0,
    "_data_ptr_allocated": lambda a: a.untyped_storage().data_ptr() > 0,
}


def patches() -> list:
    """(module, replacements) for FSDP1's flat-parameter module once it is imported and not yet patched."""
    module = sys.modules.get(FLAT_PARAM_MODULE)
    handle = getattr(module, "FlatParamHandle", None)
    init = sys.modules.get(INIT_MODULE)  # imported after _flat_param: until then, its import hook comes later
    if handle is None or init is None or getattr(handle.shard, "course_emulated", False):
        return []
    helpers = {"_alloc_storage": _alloc_storage(module._alloc_storage),
               "_free_storage": _free_storage(module._free_storage)}
    helpers.update({name: _on_inner(getattr(module, name), test) for name, test in _STORAGE_TESTS.items()})
    return [(handle, {"shard": _shard(handle.shard)}), (module, helpers),
            (init, {"_move_states_to_device": fsdp2.move_states_to_device(init._move_states_to_device)})]


class PatchOnImport(importlib.abc.MetaPathFinder):
    """An import hook, on `sys.meta_path` while the emulator runs: once one of `names` (FSDP1's `_init_utils`, which
    imports `_flat_param`, by default) has run, `install` puts the replacements in place, before any wrapper is made."""

    def __init__(self, install, names=(INIT_MODULE,)):
        self._install = install
        self._names = names

    def find_spec(self, name, path=None, target=None):
        if name not in self._names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            self._install()
        spec.loader.exec_module = exec_then_patch
        return spec
