"""TorchScript with emulated GPUs: scripting and tracing run (their ops are the emulator's); saving writes the values.

C++ serialises a scripted module's tensors from their storages, which for emulated tensors are placeholders: the
process died with a segmentation fault, or the file held zeros (parameters moved back to the host while a scripted
module held them stay emulated tensors: course/cuda/interception.py `_set_data`). So while a module saves, each
emulated parameter and buffer in its C++ slots is replaced by the host tensor holding its values, and put back after.
The file then records those tensors on the CPU where a GPU box records cuda, so it also carries an extra file
naming each one's GPU: loading it without a map_location puts them back there, as a GPU box would (a GPU box ignores
the extra file). Loading onto a GPU (map_location="cuda:1") needs CUDA in PyTorch's C++, so the module is loaded on
the host and its parameters and buffers are then moved into its C++ slots on the emulated GPU.
"""
from __future__ import annotations

import functools
import json

import torch
import torch.jit._script

from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import EmulatedTensor


DEVICES_FILE = "course_emulator_devices.json"


def _swap_in_host_values(module, swapped: list, devices: dict, prefix: str = "") -> None:
    """Every emulated tensor in the C++ slots of `module` and its submodules replaced by its host values; `devices`
    gets each one's GPU by qualified name."""
    for name in list(module._parameters.keys()) + list(module._buffers.keys()):
        value = getattr(module, name)
        if isinstance(value, EmulatedTensor):
            if value._inner.is_meta:
                raise not_modelled("Saving a TorchScript module in shape-only mode (materialize=False)",
                                   "emulate with materialize=True to save values")
            swapped.append((module._c, name, value))
            devices[prefix + name] = str(value.device)
            module._c.setattr(name, value._inner.detach())
    for child_name, child in module.named_children():
        _swap_in_host_values(child, swapped, devices, f"{prefix}{child_name}.")


def _saving_host_values(original):
    @functools.wraps(original)
    def save(self, *args, **kwargs):
        module = self.__dict__.get("_actual_script_module", self)  # a traced module's scripted one
        swapped: list = []
        devices: dict = {}
        try:
            _swap_in_host_values(module, swapped, devices)
            if devices:
                kwargs["_extra_files"] = {**(kwargs.get("_extra_files") or {}), DEVICES_FILE: json.dumps(devices)}
            return original(self, *args, **kwargs)
        finally:
            for slots, name, value in reversed(swapped):
                slots.setattr(name, value)
    return save


def _move_slots(module, device, devices: dict | None = None, prefix: str = "") -> None:
    """Parameters and buffers moved into the C++ slots on `device`, or on the one `devices` names for each."""
    for name in list(module._parameters.keys()) + list(module._buffers.keys()):
        value = getattr(module, name)
        target = device if devices is None else devices.get(prefix + name)
        if value is not None and target is not None:
            module._c.setattr(name, value.detach().to(target).requires_grad_(value.requires_grad))
    for child_name, child in module.named_children():
        _move_slots(child, device, devices, f"{prefix}{child_name}.")


def _load(original):
    @functools.wraps(original)
    def load(f, map_location=None, _extra_files=None, _restore_shapes=False):
        target = torch.device(map_location) if isinstance(map_location, (str, torch.device)) else None
        if isinstance(map_location, int):
            target = torch.device("cuda", map_location)
        if map_location is None:
            extra = {**(_extra_files or {}), DEVICES_FILE: ""}
            module = original(f, None, extra, _restore_shapes)
            for key in _extra_files or {}:
                _extra_files[key] = extra[key]
            if extra[DEVICES_FILE]:
                _move_slots(module, None, json.loads(extra[DEVICES_FILE]))
            return module
        if target is None or target.type != "cuda":
            return original(f, map_location, _extra_files, _restore_shapes)
        module = original(f, "cpu", _extra_files, _restore_shapes)
        _move_slots(module, target)
        return module
    return load


_SAVES = ("save", "save_to_buffer", "_save_for_lite_interpreter", "_save_to_buffer_for_lite_interpreter")


def patches() -> list:
    """ScriptModule has its own copies of RecursiveScriptModule's methods (torch/jit/_script.py copies them), which
    traced modules use: both classes are patched."""
    classes = (torch.jit._script.RecursiveScriptModule, torch.jit.ScriptModule)
    return [(cls, {name: _saving_host_values(vars(cls)[name]) for name in _SAVES}) for cls in classes] + [
        (torch.jit, {"load": _load(torch.jit.load)})]
