"""Cutting images into tiles for tile parallelism: where the tiles start and end, how much the layers
shrink them, and a picture of where a tiled result differs from the whole-image one.
"""
from __future__ import annotations

import torch.nn as nn

_POOLS = (nn.MaxPool2d, nn.AvgPool2d)


def split_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """(start, stop) of `parts` consecutive pieces of range(size), sizes differing by at most one,
    the same pieces `torch.tensor_split(x, parts)` makes."""
    if not 1 <= parts <= size:
        raise ValueError(f"cannot cut {size} rows or columns into {parts} non-empty pieces")
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def downsampling_factor(layers) -> int:
    """How many input pixels one output pixel steps over: the product of the pooling strides.

    Assumes what the chapter's models use: pools whose kernel equals their stride, and
    convolutions with stride 1.
    """
    factor = 1
    for layer in layers:
        if isinstance(layer, _POOLS):
            stride = layer.stride if isinstance(layer.stride, int) else layer.stride[0]
            factor *= stride
    return factor


def plot_difference(whole, tiled, ax=None, title=None):
    """Show |whole - tiled| for the first image, largest over channels; bright lines are wrong pixels.

    Both are (batch, channels, height, width) CPU tensors. Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    difference = (whole - tiled).abs()[0].amax(dim=0).detach()
    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 4), layout="constrained")
    image = ax.imshow(difference.numpy(), cmap="magma", vmin=0)
    ax.figure.colorbar(image, ax=ax, label="|whole - tiled| (largest over channels)")
    ax.set_xlabel("output column (pixels)")
    ax.set_ylabel("output row (pixels)")
    ax.set_title(title or f"largest error {difference.max().item():.2g}")
    return ax.figure
