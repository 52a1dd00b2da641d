"""Emulated GPU tensors inside torch.func transforms (vmap's batched tensors, grad's and jvp's wrappers).

A transform wraps a tensor in a C++ tensor whose device is the one C++ sees inside, the CPU for an emulated GPU
tensor: the tensor inside the wrappers says where the data lives. A random factory under
`vmap(..., randomness="different")` comes back batched from functorch's vmap mode (one draw per batch element):
the draw is unwrapped to live on the emulated GPU and batched again at the same levels.
"""
from __future__ import annotations

import torch

_functorch = torch._C._functorch


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a torch.func transform wrapped (jvp's dual, grad's, vmap's batched)."""
    while _functorch.is_functorch_wrapped_tensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return tensor


def unbatched(tensor: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A vmap-batched tensor's physical tensor, and its (batch dim, level) layers from the outermost."""
    layers = []
    while _functorch.is_batchedtensor(tensor):
        layers.append((_functorch.maybe_get_bdim(tensor), _functorch.maybe_get_level(tensor)))
        tensor = _functorch.get_unwrapped(tensor)
    return tensor, layers


def rebatched(tensor: torch.Tensor, layers: list[tuple[int, int]]) -> torch.Tensor:
    for bdim, level in reversed(layers):
        tensor = _functorch._add_batch_dim(tensor, bdim, level)
    return tensor
