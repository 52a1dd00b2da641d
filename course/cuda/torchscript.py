"""TorchScript with emulated GPUs: scripting and tracing run (their ops are the emulator's), saving and loading refuse.

Saving a scripted module that holds emulated tensors would have C++ serialise their storages, which are
placeholders: the process dies with a segmentation fault, or the file holds zeros. That includes parameters moved back
to the host while a scripted module held them (`model.cpu()` then goes by `param.data = ...`, which leaves an
emulated tensor on the host: course/cuda/interception.py `_set_data`). Loading onto a GPU needs CUDA in PyTorch's C++
("not linked with support for cuda devices"). Both are refused with an error that names them.
"""
from __future__ import annotations

import functools

import torch
import torch.jit._script

from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import EmulatedTensor

_ADVICE = ("script a model built on the CPU with the trained weights (load_state_dict), save that, load it with "
           "map_location='cpu', and move the inputs and outputs to the GPU around it")


def _holds_emulated_tensors(module) -> bool:
    return any(isinstance(t, EmulatedTensor) or t.is_cuda for t in list(module.parameters()) + list(module.buffers()))


def _refusing_save(original):
    @functools.wraps(original)
    def save(self, *args, **kwargs):
        if _holds_emulated_tensors(self):
            raise not_modelled("Saving a TorchScript module whose tensors are or were on emulated GPUs", _ADVICE)
        return original(self, *args, **kwargs)
    return save


def _load(original):
    @functools.wraps(original)
    def load(f, map_location=None, _extra_files=None, _restore_shapes=False):
        target = torch.device(map_location) if isinstance(map_location, (str, int, torch.device)) else None
        if target is not None and target.type == "cuda":
            raise not_modelled("torch.jit.load onto an emulated GPU", _ADVICE)
        return original(f, map_location, _extra_files, _restore_shapes)
    return load


_SAVES = ("save", "save_to_buffer", "_save_for_lite_interpreter", "_save_to_buffer_for_lite_interpreter")


def patches() -> list:
    """ScriptModule has its own copies of RecursiveScriptModule's methods (torch/jit/_script.py copies them), which
    traced modules use: both classes are patched."""
    classes = (torch.jit._script.RecursiveScriptModule, torch.jit.ScriptModule)
    return [(cls, {name: _refusing_save(vars(cls)[name]) for name in _SAVES}) for cls in classes] + [
        (torch.jit, {"load": _load(torch.jit.load)})]
