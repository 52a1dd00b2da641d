"""`torch.cuda.get_device_properties`: every field torch 2.13's `_CudaDeviceProperties` has, from the GPU preset.

The fields are those torch/csrc/cuda/Module.cpp binds from `cudaDeviceProp` and torch's own Python reads (the
profiler's trace export reads max_threads_per_block, regs_per_multiprocessor and warp_size; inductor's heuristics
the register and shared-memory limits). Figures come from course/machine/hardware.py, each cited there.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from course.machine import hardware

# A fixed namespace, so an emulated GPU's UUID is the same in every run and process, and differs between GPUs.
_UUID_NAMESPACE = uuid.UUID("6f1c3a52-7a43-4b8e-9c1d-2f6a0e5b8d37")


@dataclass(frozen=True)
class DeviceUUID:
    """`props.uuid`, PyTorch's `_CUuuid`: 16 `bytes`, printed as the hex groups nvidia-smi shows after "GPU-"."""

    value: uuid.UUID

    @property
    def bytes(self) -> list[int]:
        return list(self.value.bytes)

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class DeviceProperties:
    """What `torch.cuda.get_device_properties` returns, filled from the GPU preset."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    uuid: DeviceUUID
    L2_cache_size: int
    clock_rate: int  # kHz, as cudaDeviceProp.clockRate
    memory_clock_rate: int  # kHz, as cudaDeviceProp.memoryClockRate
    memory_bus_width: int  # bits
    max_threads_per_multi_processor: int
    regs_per_multiprocessor: int
    shared_memory_per_multiprocessor: int
    shared_memory_per_block_optin: int
    warp_size: int = hardware.WARP_SIZE
    max_threads_per_block: int = hardware.MAX_THREADS_PER_BLOCK
    shared_memory_per_block: int = hardware.SHARED_MEMORY_PER_BLOCK
    is_integrated: int = 0
    is_multi_gpu_board: int = 0

    @property
    def gcnArchName(self) -> str:  # noqa: N802 (PyTorch's name) a ROCm field; CUDA builds bind the device name to it
        return self.name

    def __repr__(self):
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, "
                f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
                f"L2_cache_size={self.L2_cache_size // 2**20}MB)")


def of(gpu: hardware.GPU, index: int) -> DeviceProperties:
    """The properties of emulated GPU `index`, a `gpu`.

    clock_rate is the boost clock the FP32 peak is quoted at (hardware.GPU.boost_clock_ghz). memory_clock_rate is
    what makes CUDA's own peak-bandwidth formula, 2 x memoryClockRate x memoryBusWidth / 8 (the CUDA samples'
    deviceQuery and https://developer.nvidia.com/blog/how-implement-performance-metrics-cuda-cc/), give the
    datasheet bandwidth: the double data rate's base clock, as cudaDeviceProp reports it."""
    threads, registers, shared, optin = hardware.SM_LIMITS[gpu.compute_capability]
    l2_bytes, bus_bits = hardware.CHIP_MEMORY[gpu.key]
    return DeviceProperties(
        gpu.name, *gpu.compute_capability, gpu.memory_bytes, gpu.multi_processor_count,
        uuid=DeviceUUID(uuid.uuid5(_UUID_NAMESPACE, f"{gpu.key}/{index}")), L2_cache_size=l2_bytes,
        clock_rate=round(gpu.boost_clock_ghz * 1e6),
        memory_clock_rate=round(gpu.memory_bandwidth_gbps * 1e6 / (2 * bus_bits / 8)), memory_bus_width=bus_bits,
        max_threads_per_multi_processor=threads, regs_per_multiprocessor=registers,
        shared_memory_per_multiprocessor=shared, shared_memory_per_block_optin=optin)
