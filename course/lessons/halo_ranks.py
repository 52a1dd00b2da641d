"""Tile parallelism as a real spatial-parallel program runs it: one rank per GPU (rank threads on the emulated
NCCL), each holding only its tile, either with a wide halo taken once (overlap recompute) or exchanging a thin
halo with its neighbours before every convolution (`dist.isend`/`irecv`). Returns what the trace shows.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist

from course.cuda.emulator import emulate
from course.lessons.ranks import run_threads
from course.lessons.tiles import downsampling_factor, forward_with_exchange, tile_box


class TileRun(NamedTuple):
    """What one tiled forward pass on rank threads produced and what it cost, read from the trace."""

    outputs: list           # each rank's output tile, on the CPU, row-major
    trace: list             # the emulator's trace from the moment every rank was ready
    start_ms: float         # when every rank had its model and started (simulated)
    end_ms: float           # when the last rank finished
    host_bytes: int         # bytes copied from the host to the GPUs
    sent: list              # (from rank, to rank, bytes) of every point-to-point send

    @property
    def elapsed_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def bytes_between_gpus(self) -> int:
        return sum(nbytes for _, _, nbytes in self.sent)


def _sends(trace) -> list[tuple[int, int, int]]:
    """(source rank, destination rank, bytes) of each emulated NCCL send; rank r runs on cuda:r here."""
    return [(int(e.device.split(":")[1]), int(e.name.rsplit(" ", 1)[1]), e.bytes)
            for e in trace if e.kind == "collective" and e.name.startswith("nccl:send to ")]


def _rank_main(rank, world_size, model, image, grid, halo, exchange):
    torch.cuda.set_device(rank)
    replica = copy.deepcopy(model).to(f"cuda:{rank}")
    height, width = image.shape[-2:]
    top, bottom, left, right = tile_box(height, width, grid, rank)
    if exchange is None:  # overlap recompute: a box `halo` wider on every side, clipped to the image
        top, bottom, left, right = max(0, top - halo), min(height, bottom + halo), max(0, left - halo), \
            min(width, right + halo)
    dist.barrier(device_ids=[rank])  # the GPU this rank drives, as on a GPU box (else PyTorch warns it guesses)
    torch.cuda.synchronize()
    start_ms = _now_ms()
    with torch.no_grad():
        x = image[..., top:bottom, left:right].to(f"cuda:{rank}")
        if exchange is None:
            factor = downsampling_factor(list(model))
            own = tile_box(height, width, grid, rank)
            out = replica(x)[..., (own[0] - top) // factor:(own[1] - top) // factor,
                             (own[2] - left) // factor:(own[3] - left) // factor]
        else:
            out = forward_with_exchange(replica, x, grid, exchange)
    torch.cuda.synchronize()
    return out.cpu(), start_ms, _now_ms()


def _now_ms() -> float:
    from course.cuda import devices

    return devices.active.now_ms()


def tiled_forward_on_ranks(model, image, grid, *, halo: int | None = None, exchange=None, **machine) -> TileRun:
    """`model` on `image` cut into a row-major `grid` of tiles, tile r on rank r (cuda:r), each rank its own
    thread, on a fresh emulated machine (`machine`: course.emulate's keywords). Give either `halo` (overlap
    recompute) or `exchange` (a function `exchange(tile, grid, width)` run by every rank before each conv)."""
    if (halo is None) == (exchange is None):
        raise ValueError("give either halo=... (overlap recompute) or exchange=... (halo exchange per layer)")
    factor = downsampling_factor(list(model))
    rows, cols = grid
    if any(size % (parts * factor) for size, parts in zip(image.shape[-2:], grid)):
        raise ValueError(f"the image's {tuple(image.shape[-2:])} pixels must cut into {rows} x {cols} tiles "
                         f"whose sides are multiples of the pooling factor {factor}")
    with emulate(gpus=rows * cols, force=True, **machine) as emu:
        results = run_threads(_rank_main, rows * cols, model, image, grid, halo, exchange, backend="nccl")
        start_ms = max(start for _, start, _ in results)
        trace = [e for e in emu.trace if e.start_ns >= start_ms * 1e6]
    return TileRun([out for out, _, _ in results], trace, start_ms, max(end for _, _, end in results),
                   sum(e.bytes for e in trace if e.kind == "copy" and e.name.startswith("copy cpu->")),
                   _sends(trace))


def _exchange_main(rank, world_size, image, grid, width, exchange):
    torch.cuda.set_device(rank)
    top, bottom, left, right = tile_box(image.shape[-2], image.shape[-1], grid, rank)
    tile = image[..., top:bottom, left:right].to(f"cuda:{rank}")
    dist.barrier(device_ids=[rank])  # the GPU this rank drives, as on a GPU box (else PyTorch warns it guesses)
    torch.cuda.synchronize()
    start_ms = _now_ms()
    padded = exchange(tile, grid, width)
    if not isinstance(padded, torch.Tensor):
        raise TypeError(f"exchange should return the padded tile as a tensor; rank {rank} got {type(padded).__name__}")
    torch.cuda.synchronize()
    return padded.cpu(), str(padded.device), start_ms


def exchange_on_ranks(exchange, image, grid, width: int, **machine):
    """Every rank r (its own thread, cuda:r) holds tile r of `image` and calls `exchange(tile, grid, width)`.

    Returns the padded tiles (on the CPU, row-major), the device each came back on, and the (from rank, to
    rank, bytes) of every send the exchange made."""
    rows, cols = grid
    with emulate(gpus=rows * cols, force=True, **machine) as emu:
        results = run_threads(_exchange_main, rows * cols, image, grid, width, exchange, backend="nccl",
                              timeout_s=20)
        start_ms = max(start for _, _, start in results)
        sent = _sends([e for e in emu.trace if e.start_ns >= start_ms * 1e6])
    return [padded for padded, _, _ in results], [device for _, device, _ in results], sent
