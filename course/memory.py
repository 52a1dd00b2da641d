"""Per-device memory bookkeeping: live bytes, peak bytes and the capacity of the emulated GPU.

The emulator allocates nothing on a GPU, so it counts: every tensor storage made on a fake device
is a `Block`; when the last tensor using a block dies, its bytes are given back, as the CUDA
caching allocator would report them through `torch.cuda.memory_allocated`.
"""
from __future__ import annotations

import threading

import torch

# The CUDA caching allocator hands out blocks in multiples of 512 bytes, so
# torch.cuda.memory_allocated() reports sizes rounded up to that.
ALLOCATION_GRANULARITY_BYTES = 512


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_GRANULARITY_BYTES) * ALLOCATION_GRANULARITY_BYTES


def format_bytes(nbytes: float) -> str:
    """Bytes the way PyTorch's out-of-memory message writes them (GiB, MiB, KiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} bytes"


class Block:
    """One storage on one fake GPU; views of it share the block, and its death frees the bytes.

    `ready_ns` is when the last kernel that wrote it finishes, so readers can wait for it.
    """

    __slots__ = ("memory", "device", "nbytes", "ready_ns")

    def __init__(self, memory: "DeviceMemory", device: int, nbytes: int, ready_ns: int = 0):
        self.memory = memory
        self.device = device
        self.nbytes = nbytes
        self.ready_ns = ready_ns

    def __del__(self):
        self.memory.free(self.device, self.nbytes)


class DeviceMemory:
    """Live and peak bytes for every fake GPU, with the preset's capacity enforced."""

    def __init__(self, num_gpus: int, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.allocated = [0] * num_gpus
        self.peak = [0] * num_gpus
        self._lock = threading.RLock()

    def check_fits(self, device: int, nbytes: int) -> None:
        """Raise torch.cuda.OutOfMemoryError, worded like the real one, if nbytes would not fit."""
        nbytes = _round_up(nbytes)
        if self.allocated[device] + nbytes <= self.capacity_bytes:
            return
        free = self.capacity_bytes - self.allocated[device]
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_bytes(nbytes)}. GPU {device} has a total "
            f"capacity of {format_bytes(self.capacity_bytes)} of which {format_bytes(free)} is free. "
            f"Of the allocated memory {format_bytes(self.allocated[device])} is allocated by PyTorch, "
            f"and 0 bytes is reserved by PyTorch but unallocated. (emulated GPU: free tensors with "
            f"`del`, use a smaller batch, or spread the model over more GPUs)"
        )

    def allocate(self, device: int, nbytes: int, ready_ns: int = 0) -> Block:
        """Count a new storage and return the block whose death gives the bytes back."""
        rounded = _round_up(nbytes)
        with self._lock:
            self.check_fits(device, nbytes)
            self.allocated[device] += rounded
            self.peak[device] = max(self.peak[device], self.allocated[device])
        return Block(self, device, rounded, ready_ns)

    def free(self, device: int, nbytes: int) -> None:
        with self._lock:
            self.allocated[device] -= nbytes

    def reset_peak(self, device: int) -> None:
        with self._lock:
            self.peak[device] = self.allocated[device]
