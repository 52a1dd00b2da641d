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


def tile_box(height: int, width: int, grid, index: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of tile `index` (row-major) when a height x width image is cut into a
    `grid = (rows, cols)` of tiles with `split_bounds`."""
    rows, cols = grid
    if not 0 <= index < rows * cols:
        raise ValueError(f"a {rows} x {cols} grid has tiles 0 to {rows * cols - 1}; got tile {index}")
    (top, bottom), (left, right) = split_bounds(height, rows)[index // cols], split_bounds(width, cols)[index % cols]
    return top, bottom, left, right


def forward_with_exchange(layers, tile, grid, exchange):
    """This rank's part of `layers` (an nn.Sequential) on its own tile only: before every convolution the
    tile is padded with its neighbours' pixels by `exchange(tile, grid, width)`, so the convolution runs
    unpadded (padding=0) and gives exactly the whole image's values for the tile's pixels.

    Pools must have kernel = stride and tiles must start on the pooling grid, so pools need no halo."""
    import torch.nn.functional as F

    for layer in layers:
        if isinstance(layer, nn.Conv2d):
            if layer.stride != (1, 1) or layer.padding_mode != "zeros" or layer.padding != tuple(
                    d * (k - 1) // 2 for d, k in zip(layer.dilation, layer.kernel_size)):
                raise ValueError(f"{layer}: forward_with_exchange needs stride 1 and 'same' zero padding")
            padded = exchange(tile, grid, layer.padding[0])
            tile = F.conv2d(padded, layer.weight, layer.bias, dilation=layer.dilation, groups=layer.groups)
        else:
            tile = layer(tile)
    return tile
