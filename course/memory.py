"""Per-device memory bookkeeping: the statistics the CUDA caching allocator reports, for the emulated GPUs.

The emulator allocates nothing on a GPU, so it counts: every tensor storage made on a fake device
is a `Block`; when the last tensor using a block dies, its bytes are given back. The counts are kept
the way PyTorch's allocator keeps them (`torch.cuda.memory_stats()`: current, peak, allocated and freed
for the small pool, blocks of 1 MiB or less, and the large pool), so `memory_summary()` prints a real
table. Nothing is cached: each block is its own segment, so reserved equals allocated, which is what a
real GPU shows after `torch.cuda.empty_cache()`.
"""
from __future__ import annotations

import threading

import torch

# The CUDA caching allocator hands out blocks in multiples of 512 bytes, so
# torch.cuda.memory_allocated() reports sizes rounded up to that.
ALLOCATION_GRANULARITY_BYTES = 512
SMALL_POOL_MAX_BYTES = 2**20  # kSmallSize in CUDACachingAllocator: larger requests go to the large pool
_POOLS = ("all", "small_pool", "large_pool")
_ADDRESS_BASE = 0x7F0000000000  # made-up device addresses for memory_snapshot(), 1 TiB apart per GPU


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

    __slots__ = ("memory", "device", "nbytes", "requested", "ready_ns")

    def __init__(self, memory: "DeviceMemory", device: int, nbytes: int, requested: int, ready_ns: int = 0):
        self.memory = memory
        self.device = device
        self.nbytes = nbytes
        self.requested = requested
        self.ready_ns = ready_ns

    def __del__(self):
        self.memory.free(self)


class Stat:
    """One allocator statistic: its current value, its peak, and the totals added and taken away."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self):
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def remove(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount

    def as_dict(self) -> dict:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class _DeviceStats:
    """The counted statistics of one GPU, each for all pools, the small pool and the large pool."""

    def __init__(self):
        self.blocks = [Stat() for _ in _POOLS]
        self.bytes = [Stat() for _ in _POOLS]
        self.requested = [Stat() for _ in _POOLS]
        self.num_ooms = 0

    def all_stats(self):
        return (*self.blocks, *self.bytes, *self.requested)


class DeviceMemory:
    """Live and peak bytes for every fake GPU, with the preset's capacity (or a set fraction of it) enforced."""

    def __init__(self, num_gpus: int, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.fraction = [1.0] * num_gpus  # torch.cuda.set_per_process_memory_fraction
        self._stats = [_DeviceStats() for _ in range(num_gpus)]
        self._live: dict[int, tuple] = {}  # id(block) -> (device, address, nbytes, requested), for snapshots
        self._next_address = [_ADDRESS_BASE + device * 2**40 for device in range(num_gpus)]
        self._lock = threading.RLock()

    @property
    def allocated(self) -> list[int]:
        return [stats.bytes[0].current for stats in self._stats]

    @property
    def peak(self) -> list[int]:
        return [stats.bytes[0].peak for stats in self._stats]

    def limit(self, device: int) -> int:
        return int(self.capacity_bytes * self.fraction[device])

    def check_fits(self, device: int, nbytes: int) -> None:
        """Raise torch.cuda.OutOfMemoryError, worded like the real one, if nbytes would not fit."""
        nbytes = _round_up(nbytes)
        allocated = self._stats[device].bytes[0].current
        if allocated + nbytes <= self.limit(device):
            return
        self._stats[device].num_ooms += 1
        free = self.capacity_bytes - allocated
        allowed = f"{format_bytes(self.limit(device))} allowed; " if self.fraction[device] < 1.0 else ""
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_bytes(nbytes)}. GPU {device} has a total "
            f"capacity of {format_bytes(self.capacity_bytes)} of which {format_bytes(free)} is free. "
            f"{allowed}Of the allocated memory {format_bytes(allocated)} is allocated by PyTorch, "
            f"and 0 bytes is reserved by PyTorch but unallocated. (emulated GPU: free tensors with "
            f"`del`, use a smaller batch, or spread the model over more GPUs)"
        )

    def allocate(self, device: int, nbytes: int, ready_ns: int = 0) -> Block:
        """Count a new storage and return the block whose death gives the bytes back."""
        rounded = _round_up(nbytes)
        pool = 1 if rounded <= SMALL_POOL_MAX_BYTES else 2
        with self._lock:
            self.check_fits(device, nbytes)
            stats = self._stats[device]
            for index in (0, pool):
                stats.blocks[index].add(1)
                stats.bytes[index].add(rounded)
                stats.requested[index].add(nbytes)
            block = Block(self, device, rounded, nbytes, ready_ns)
            self._live[id(block)] = (device, self._next_address[device], rounded, nbytes)
            self._next_address[device] += rounded
        return block

    def free(self, block: Block) -> None:
        pool = 1 if block.nbytes <= SMALL_POOL_MAX_BYTES else 2
        with self._lock:
            stats = self._stats[block.device]
            for index in (0, pool):
                stats.blocks[index].remove(1)
                stats.bytes[index].remove(block.nbytes)
                stats.requested[index].remove(block.requested)
            self._live.pop(id(block), None)

    def reset_peak(self, device: int) -> None:
        with self._lock:
            for stat in self._stats[device].all_stats():
                stat.peak = stat.current

    def reset_accumulated(self, device: int) -> None:
        with self._lock:
            stats = self._stats[device]
            for stat in stats.all_stats():
                stat.allocated = stat.freed = 0
            stats.num_ooms = 0

    def stats(self, device: int) -> dict:
        """`torch._C._cuda_memoryStats(device)`: the nested dict `torch.cuda.memory_stats` flattens."""
        with self._lock:
            stats = self._stats[device]
            blocks = {pool: stat.as_dict() for pool, stat in zip(_POOLS, stats.blocks)}
            nbytes = {pool: stat.as_dict() for pool, stat in zip(_POOLS, stats.bytes)}
            requested = {pool: stat.as_dict() for pool, stat in zip(_POOLS, stats.requested)}
            zeros = {pool: Stat().as_dict() for pool in _POOLS}
            return {
                "num_alloc_retries": 0,  # nothing is cached, so there is never a cache to flush and retry
                "num_ooms": stats.num_ooms,
                "max_split_size": -1,  # PYTORCH_CUDA_ALLOC_CONF max_split_size_mb unset
                "num_sync_all_streams": 0,
                "num_device_alloc": blocks["all"]["allocated"],  # one cudaMalloc per block
                "num_device_free": blocks["all"]["freed"],
                "allocation": blocks, "segment": blocks, "active": blocks,
                "allocated_bytes": nbytes, "reserved_bytes": nbytes, "active_bytes": nbytes,
                "requested_bytes": requested,
                "inactive_split": zeros, "inactive_split_bytes": zeros,
                "oversize_allocations": Stat().as_dict(), "oversize_segments": Stat().as_dict(),
            }

    def snapshot(self) -> list[dict]:
        """`torch.cuda.memory_snapshot()`: one segment per live block (nothing is cached), no stack frames."""
        with self._lock:
            live = sorted(self._live.values())
        return [{"device": device, "address": address, "total_size": nbytes, "allocated_size": nbytes,
                 "active_size": nbytes, "requested_size": requested, "stream": 0,
                 "segment_type": "small" if nbytes <= SMALL_POOL_MAX_BYTES else "large",
                 "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                 "blocks": [{"address": address, "size": nbytes, "requested_size": requested,
                             "state": "active_allocated", "frames": []}]}
                for device, address, nbytes, requested in live]
