"""Reference answers for the tiled-parallelism chapter's exercises (hidden from learners; see autograder/README.md)."""
from __future__ import annotations

import torch
import torch.nn as nn

from course.lessons.tiles import downsampling_factor, split_bounds


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



def exchange_halo(tile, grid, width):
    """This rank's tile padded by `width` pixels of its neighbours' (zeros at the image's border), in two
    rounds of isend/irecv: rows with the tiles above and below, then columns, whole padded height, with the
    tiles left and right (which carries the corners from the diagonal neighbours)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    rows, cols = grid
    rank = dist.get_rank()
    row, col = divmod(rank, cols)
    w = width
    padded = F.pad(tile, (w, w, w, w))
    if w == 0:
        return padded
    rounds = [[(row > 0, rank - cols, padded[..., w:2 * w, w:-w], padded[..., :w, w:-w]),
               (row < rows - 1, rank + cols, padded[..., -2 * w:-w, w:-w], padded[..., -w:, w:-w])],
              [(col > 0, rank - 1, padded[..., :, w:2 * w], padded[..., :, :w]),
               (col < cols - 1, rank + 1, padded[..., :, -2 * w:-w], padded[..., :, -w:])]]
    for pairs in rounds:
        ops, landing = [], []
        for present, peer, outgoing, incoming in pairs:
            if present:
                buffer = torch.empty_like(incoming)
                ops += [dist.P2POp(dist.isend, outgoing.contiguous(), peer), dist.P2POp(dist.irecv, buffer, peer)]
                landing.append((incoming, buffer))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for incoming, buffer in landing:
            incoming.copy_(buffer)
    return padded


def halo_pixels_per_exchange(height, width, grid):
    """Pixels per channel one two-round exchange of width 1 sends (exchange_halo's): a row of the image's width
    each way across every horizontal cut, then a column of the row-padded height (the image's height plus two
    rows per tile in that column) each way across every vertical cut."""
    rows, cols = grid
    return 2 * ((rows - 1) * width + (cols - 1) * (height + 2 * rows))


def best_tile_grid(height, width, num_gpus):
    """The (rows, cols) with rows * cols = num_gpus, every tile at least a pixel, that sends the fewest halo
    pixels per exchange; ties go to fewer rows."""
    grids = [(rows, num_gpus // rows) for rows in range(1, num_gpus + 1)
             if num_gpus % rows == 0 and rows <= height and num_gpus // rows <= width]
    if not grids:
        raise ValueError(f"{num_gpus} GPUs cannot each get a tile of a {height} x {width} image")
    return min(grids, key=lambda grid: (halo_pixels_per_exchange(height, width, grid), grid[0]))
