"""`torch.as_tensor` and `torch.asarray` on emulated GPUs: when the result shares memory with its data.

On a GPU box a tensor these make on a GPU from host data (a NumPy array, a CPU tensor) owns GPU memory; given a GPU
tensor they return it (or a view of it) on its own device and a copy on another, and `asarray(..., copy=False)`
refuses to cross devices. The emulator keeps a GPU tensor's values on the host, where these functions alias their
data: without these rules `torch.as_tensor(array, device="cuda")` would share the array's memory, and a later write
to the array would silently change the "GPU" tensor.
"""
from __future__ import annotations

import torch

from course.cuda.devices import CPU, EmulatedTensor, device_name, parse_device

ALIASING = (torch.as_tensor, torch.asarray)


def _refuse_crossing(func, source: int, target: int, kwargs) -> None:
    """ATen's `asarray` (torch/csrc/utils/tensor_new.cpp): no alias across devices, a ValueError."""
    if func is torch.asarray and kwargs.get("copy") is False and source != target:
        raise ValueError(f"can't alias tensor from device '{device_name(source)}' to '{device_name(target)}'.")


def from_gpu_tensor(func, tensor: EmulatedTensor, kwargs: dict):
    """`as_tensor(gpu_x, device=...)` / `asarray(gpu_x, device=...)`: a copy to another device, `gpu_x` itself
    (or the op C++ runs for a dtype or a copy) on its own; C++ would compare `device` with the wrapper's CPU one."""
    kwargs = dict(kwargs)
    target = parse_device(kwargs.pop("device"))
    _refuse_crossing(func, tensor._device_index, target, kwargs)
    if target != tensor._device_index:
        tensor = tensor.to(device_name(target))
    return func(tensor, **kwargs)


def refuse_host_alias(func, args, kwargs, index: int) -> None:
    """`asarray(host_tensor_or_array, device="cuda", copy=False)`: refused before the factory runs on meta (whose
    own refusal would name the meta device)."""
    source = args[0] if args else kwargs.get("obj")
    if isinstance(source, torch.Tensor) or hasattr(source, "__array_interface__"):
        _refuse_crossing(func, CPU, index, kwargs)
