"""Reference answers for the tiled-parallelism chapter's exercises (hidden from learners; see autograder/README.md)."""
from __future__ import annotations

import torch
import torch.nn as nn

from course.tiles import downsampling_factor, split_bounds


def stitch_tiles(outputs, grid):
    """Row-major tiles (all on one device) back into one image: columns joined along dim 3, rows along dim 2."""
    rows, cols = grid
    return torch.cat([torch.cat(outputs[r * cols:(r + 1) * cols], dim=3) for r in range(rows)], dim=2)


def halo_width(layers):
    """Smallest halo that makes tiles exact: walking back from the output, a k x k conv adds
    dilation * (k - 1) // 2, a pool of stride s multiplies by s; then round up to a multiple of the
    total pooling factor so every tile's pooling windows line up with the whole image's."""
    need, factor = 0, 1
    for layer in reversed(list(layers)):
        if isinstance(layer, nn.Conv2d):
            need += layer.dilation[0] * (layer.kernel_size[0] - 1) // 2
        elif isinstance(layer, (nn.MaxPool2d, nn.AvgPool2d)):
            stride = layer.stride if isinstance(layer.stride, int) else layer.stride[0]
            need *= stride
            factor *= stride
    return -(-need // factor) * factor


def tile_boxes(height, width, grid, halo, factor):
    """For each tile (row-major): the haloed input box (top, bottom, left, right) and the output box it owns."""
    rows, cols = grid
    boxes = []
    for a, b in split_bounds(height // factor, rows):
        for c, d in split_bounds(width // factor, cols):
            top, bottom = max(0, a * factor - halo), min(height, b * factor + halo)
            left, right = max(0, c * factor - halo), min(width, d * factor + halo)
            boxes.append(((top, bottom, left, right), (a, b, c, d)))
    return boxes


def tiled_forward(replicas, image, grid, halo):
    """The model (replicas[i] on GPU i, row-major tiles) on a haloed tile each; cropped, stitched on replicas[0]'s device."""
    factor = downsampling_factor(list(replicas[0]))
    height, width = image.shape[-2:]
    home = next(replicas[0].parameters()).device
    outputs = []
    for replica, ((top, bottom, left, right), (a, b, c, d)) in zip(
            replicas, tile_boxes(height, width, grid, halo, factor)):
        device = next(replica.parameters()).device
        out = replica(image[..., top:bottom, left:right].to(device))
        row0, col0 = top // factor, left // factor
        outputs.append(out[..., a - row0:b - row0, c - col0:d - col0].to(home))
    return stitch_tiles(outputs, grid)

