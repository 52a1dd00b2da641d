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
ONE_EXABYTE = 2**60  # c10/cuda/CUDACachingAllocator.cpp, one_exa_bytes
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


class _CountedElsewhere:
    """The memory of a block whose counts another block took over, or that holds none since a resize to zero bytes
    (DeviceMemory.resize): its death frees nothing."""

    @staticmethod
    def free(block: Block) -> None:
        return None


_COUNTED_ELSEWHERE = _CountedElsewhere()


class _Pool:
    """One pool's counts (blocks, bytes, bytes requested), updated in place on every allocation and free.

    Every op that makes a tensor passes here, so a pool keeps only what changes per op: current values, totals
    allocated and peaks. What was freed is worked out when asked (allocated - current + the current value at the
    last reset of the totals), and the "all" pool from the two real ones, except its peaks, which are kept."""

    __slots__ = ("blocks", "bytes", "requested", "blocks_allocated", "bytes_allocated", "requested_allocated",
                 "blocks_peak", "bytes_peak", "requested_peak", "base")

    def __init__(self):
        self.blocks = self.bytes = self.requested = 0
        self.blocks_allocated = self.bytes_allocated = self.requested_allocated = 0
        self.blocks_peak = self.bytes_peak = self.requested_peak = 0
        self.base = (0, 0, 0)  # (blocks, bytes, requested) current when the totals were last reset


class _DeviceStats:
    """One GPU's small pool (blocks of 1 MiB or less) and large pool, and the peaks of both together."""

    __slots__ = ("pools", "blocks_peak", "bytes_peak", "requested_peak", "num_ooms", "num_sync_all_streams")

    def __init__(self):
        self.pools = (_Pool(), _Pool())
        self.blocks_peak = self.bytes_peak = self.requested_peak = 0
        self.num_ooms = self.num_sync_all_streams = 0

    @property
    def allocated_bytes(self) -> int:
        return self.pools[0].bytes + self.pools[1].bytes

    def as_dicts(self) -> dict:
        """PyTorch's nested statistics: for blocks, bytes and requested bytes, each of "all" and both pools."""
        small, large = self.pools
        result = {}
        for index, kind in enumerate(("blocks", "bytes", "requested")):
            per_pool = {}
            for name, pool in (("small_pool", small), ("large_pool", large)):
                per_pool[name] = _stat(getattr(pool, kind), getattr(pool, kind + "_peak"),
                                       getattr(pool, kind + "_allocated"), pool.base[index])
            per_pool["all"] = _stat(sum(getattr(p, kind) for p in self.pools), getattr(self, kind + "_peak"),
                                    sum(getattr(p, kind + "_allocated") for p in self.pools),
                                    sum(p.base[index] for p in self.pools))
            result[kind] = {name: per_pool[name] for name in _POOLS}
        return result


def _stat(current: int, peak: int, allocated: int, base: int) -> dict:
    return {"current": current, "peak": peak, "allocated": allocated, "freed": allocated - current + base}


class DeviceMemory:
    """Live and peak bytes for every fake GPU, with the preset's capacity (or a set fraction of it) enforced."""

    def __init__(self, num_gpus: int, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.fraction = [1.0] * num_gpus  # torch.cuda.set_per_process_memory_fraction
        self._stats = [_DeviceStats() for _ in range(num_gpus)]
        self._live: dict[int, tuple] = {}  # id(block) -> (device, address, nbytes, requested), for snapshots
        self._next_address = [_ADDRESS_BASE + device * 2**40 for device in range(num_gpus)]
        self._raw: dict[int, Block] = {}  # address -> block, for torch.cuda.caching_allocator_alloc / _delete
        self._lock = threading.RLock()
        # Told of every allocation and free, `observer(action, device, address, nbytes)` with action "alloc" or
        # "free", while torch.cuda.memory._record_memory_history records (course/cuda/memory_history.py).
        self.observer = None

    @property
    def allocated(self) -> list[int]:
        return [stats.allocated_bytes for stats in self._stats]

    @property
    def peak(self) -> list[int]:
        return [stats.bytes_peak for stats in self._stats]

    def limit(self, device: int) -> int:
        return int(self.capacity_bytes * self.fraction[device])

    def check_fits(self, device: int, nbytes: int) -> None:
        """Raise torch.cuda.OutOfMemoryError, worded like the real one, if nbytes would not fit."""
        nbytes = _round_up(nbytes)
        allocated = self._stats[device].allocated_bytes
        if allocated + nbytes <= self.limit(device):
            return
        self._stats[device].num_ooms += 1
        if nbytes >= ONE_EXABYTE:  # CUDACachingAllocator::allocate refuses these before looking at the GPU
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.")
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
        rounded = -(-nbytes // ALLOCATION_GRANULARITY_BYTES) * ALLOCATION_GRANULARITY_BYTES
        with self._lock:
            stats = self._stats[device]
            small, large = stats.pools
            total = small.bytes + large.bytes + rounded
            if total > self.capacity_bytes * self.fraction[device]:
                self.check_fits(device, nbytes)
            pool = small if rounded <= SMALL_POOL_MAX_BYTES else large
            pool.blocks += 1
            pool.bytes += rounded
            pool.requested += nbytes
            pool.blocks_allocated += 1
            pool.bytes_allocated += rounded
            pool.requested_allocated += nbytes
            if pool.bytes > pool.bytes_peak:
                pool.bytes_peak = pool.bytes
            if pool.blocks > pool.blocks_peak:
                pool.blocks_peak = pool.blocks
            if pool.requested > pool.requested_peak:
                pool.requested_peak = pool.requested
            if total > stats.bytes_peak:
                stats.bytes_peak = total
            blocks = small.blocks + large.blocks
            if blocks > stats.blocks_peak:
                stats.blocks_peak = blocks
            requested = small.requested + large.requested
            if requested > stats.requested_peak:
                stats.requested_peak = requested
            block = Block(self, device, rounded, nbytes, ready_ns)
            address = self._next_address[device]
            self._live[id(block)] = (device, address, rounded, nbytes)
            self._next_address[device] = address + rounded
        if self.observer is not None:
            self.observer("alloc", device, address, rounded)
        return block

    def resize(self, block: Block, nbytes: int) -> None:
        """`storage.resize_(nbytes)` of a GPU storage (FSDP and ZeRO-3 free a parameter's memory with resize_(0) and
        take it back later): the block now counts `nbytes`, as if freed and allocated again. Resized to zero bytes
        it holds no memory, as the allocator frees it: no block in the counts or in `memory_snapshot()`."""
        if block.requested == nbytes:
            return
        if nbytes == 0:
            self.free(block)
            block.nbytes = block.requested = 0
            block.memory = _COUNTED_ELSEWHERE
            return
        fresh = self.allocate(block.device, nbytes)  # first, so that a resize that does not fit changes nothing
        if block.memory is self:
            self.free(block)
        with self._lock:
            self._live[id(block)] = self._live.pop(id(fresh))
        block.nbytes, block.requested, block.memory = fresh.nbytes, fresh.requested, self
        fresh.memory = _COUNTED_ELSEWHERE

    def free(self, block: Block) -> None:
        rounded = block.nbytes
        with self._lock:
            pool = self._stats[block.device].pools[rounded > SMALL_POOL_MAX_BYTES]
            pool.blocks -= 1
            pool.bytes -= rounded
            pool.requested -= block.requested
            live = self._live.pop(id(block), None)
        if self.observer is not None and live is not None:
            self.observer("free", live[0], live[1], rounded)

    def allocate_raw(self, device: int, nbytes: int) -> int:
        """`torch.cuda.caching_allocator_alloc`: a block held until `free_raw` of the address it returns."""
        block = self.allocate(device, nbytes)
        with self._lock:
            address = self._live[id(block)][1]
            self._raw[address] = block
        return address

    def free_raw(self, address: int) -> None:
        """`torch.cuda.caching_allocator_delete`: an address not from `allocate_raw` is refused as CUDA does."""
        with self._lock:
            if address not in self._raw:
                raise RuntimeError(f"invalid device pointer: {hex(address)}")
            del self._raw[address]

    def reset_peak(self, device: int) -> None:
        with self._lock:
            stats = self._stats[device]
            for pool in stats.pools:
                pool.blocks_peak, pool.bytes_peak, pool.requested_peak = pool.blocks, pool.bytes, pool.requested
            stats.blocks_peak = sum(pool.blocks for pool in stats.pools)
            stats.bytes_peak = stats.allocated_bytes
            stats.requested_peak = sum(pool.requested for pool in stats.pools)

    def reset_accumulated(self, device: int) -> None:
        with self._lock:
            stats = self._stats[device]
            for pool in stats.pools:
                pool.blocks_allocated = pool.bytes_allocated = pool.requested_allocated = 0
                pool.base = (pool.blocks, pool.bytes, pool.requested)
            stats.num_ooms = stats.num_sync_all_streams = 0

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: nothing is cached to release, but each GPU's allocator synchronizes all
        its streams first, and counts it (`num_sync_all_streams`)."""
        with self._lock:
            for stats in self._stats:
                stats.num_sync_all_streams += 1

    def stats(self, device: int) -> dict:
        """`torch._C._cuda_memoryStats(device)`: the nested dict `torch.cuda.memory_stats` flattens."""
        with self._lock:
            stats = self._stats[device]
            counted = stats.as_dicts()
        blocks, nbytes = counted["blocks"], counted["bytes"]
        zeros = {pool: _stat(0, 0, 0, 0) for pool in _POOLS}
        return {
            "num_alloc_retries": 0,  # nothing is cached, so there is never a cache to flush and retry
            "num_ooms": stats.num_ooms,
            "max_split_size": -1,  # PYTORCH_CUDA_ALLOC_CONF max_split_size_mb unset
            "num_sync_all_streams": stats.num_sync_all_streams,
            "num_device_alloc": blocks["all"]["allocated"],  # one cudaMalloc per block
            "num_device_free": blocks["all"]["freed"],
            "allocation": blocks, "segment": blocks, "active": blocks,
            "allocated_bytes": nbytes, "reserved_bytes": nbytes, "active_bytes": nbytes,
            "requested_bytes": counted["requested"],
            "inactive_split": zeros, "inactive_split_bytes": zeros,
            "oversize_allocations": _stat(0, 0, 0, 0), "oversize_segments": _stat(0, 0, 0, 0),
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
