"""PyTorch functions written in Python that make a tensor on their input's device partway through.

Such a function runs its body with torch-function handling switched off (the protocol that lets the emulator see
the call at all), so a `torch.arange(..., device=input.device)` inside it reaches a CPU build's C++ and is refused.
For the common ones, the tensor is made here, on the emulated GPU (`new_tensor`, which the emulator sees as a method of
the input), and the rest is PyTorch's own code:

- `F.embedding_bag` with a 2-D input (fixed-length bags, the text-classification idiom) makes its offsets;
- `torch.unravel_index` makes its strides and sizes.

Others (`nn.MultiheadAttention(add_zero_attn=True)`, `F.fractional_max_pool2d` without samples) still raise an
error that names them.
"""
from __future__ import annotations

import inspect
import itertools
import operator

import torch
import torch.nn.functional as F

from course.cuda.devices import CPU, EmulatedTensor

_embedding_bag = F.embedding_bag
_EMBEDDING_BAG = inspect.signature(_embedding_bag)
_unravel_index = torch.unravel_index


def _on_gpu(tensor) -> bool:
    return isinstance(tensor, EmulatedTensor) and tensor._device_index != CPU


def embedding_bag(*args, **kwargs):
    """`F.embedding_bag`: a 2-D input on a GPU becomes bags of its rows, the offsets made on that GPU."""
    call = _EMBEDDING_BAG.bind(*args, **kwargs)
    bags = call.arguments["input"]
    if _on_gpu(bags) and bags.dim() == 2 and call.arguments.get("offsets") is None:
        call.arguments["offsets"] = bags.new_tensor(range(0, bags.numel(), bags.size(1)))
        call.arguments["input"] = bags.reshape(-1)
        weights = call.arguments.get("per_sample_weights")
        if weights is not None:
            call.arguments["per_sample_weights"] = weights.reshape(-1)
        return _embedding_bag(*call.args, **call.kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return _embedding_bag(*args, **kwargs)


def unravel_index(indices, shape):
    """`torch.unravel_index`: coordinates of flat indices, computed on the indices' GPU as PyTorch computes them."""
    if not _on_gpu(indices) or isinstance(shape, (int, torch.SymInt)) or indices.is_floating_point():
        with torch._C.DisableTorchFunctionSubclass():
            return _unravel_index(indices, shape)
    shape = torch.Size(shape)
    strides = list(reversed(list(itertools.accumulate(reversed(shape[1:] + torch.Size([1])), func=operator.mul))))
    coordinates = indices.unsqueeze(-1).floor_divide(indices.new_tensor(strides, dtype=torch.int64))
    return (coordinates % indices.new_tensor(shape, dtype=torch.int64)).unbind(-1)
