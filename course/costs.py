"""The roofline cost model: how many simulated nanoseconds a kernel, a copy or a collective takes.

All results are integer nanoseconds so the same program always yields the same timeline.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry

from course.hardware import HOST_LAUNCH_OVERHEAD_US, GPU, Link

aten = torch.ops.aten

HOST_LAUNCH_NS = round(HOST_LAUNCH_OVERHEAD_US * 1000)

# torch's registry has no entry for the CPU flash-attention kernels, which are what SDPA dispatches to here.
# They take (query, key, value, ...) and (grad_out, query, key, value, ...) in (batch, heads, seq, dim)
# layout like the CUDA flash kernels, so the CUDA formulas apply unchanged.
_FLOP_FORMULAS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[aten._scaled_dot_product_flash_attention_backward],
}

# Every op with a FLOP formula is a matmul, convolution or attention; add the composite entry points.
_TENSOR_CORE_OPS = frozenset(_FLOP_FORMULAS) | {aten.matmul, aten.linear}

_DTYPE_KEYS = {torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _packet(func):
    return getattr(func, "_overloadpacket", func)


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten op call, counted exactly as FlopCounterMode counts them (0 for ops it ignores)."""
    formula = _FLOP_FORMULAS.get(_packet(func))
    if formula is None:
        return 0
    return int(formula(*args, **(kwargs or {}), out_val=out))


def uses_tensor_cores(func) -> bool:
    """Whether an op is matmul-like and so runs at tensor-core speed with the calibrated matmul efficiency."""
    return _packet(func) in _TENSOR_CORE_OPS


def peak_flops_per_s(gpu: GPU, dtype: torch.dtype, tensor_cores: bool, allow_tf32: bool) -> float:
    """Datasheet peak for this op: tensor-core rate for matmuls, CUDA-core rate for everything else.

    Elementwise ops in bf16/fp16 get the FP32 CUDA-core rate: they are memory-bound in practice and the
    datasheets only quote half-precision rates for the tensor cores.
    """
    key = _DTYPE_KEYS.get(dtype, "fp32")
    if key == "fp64":
        return gpu.peak_tflops["fp64"] * 1e12
    if not tensor_cores:
        return gpu.peak_tflops["fp32"] * 1e12
    if key == "fp32" and allow_tf32:
        key = "tf32"
    return gpu.peak_tflops[key] * 1e12


def kernel_ns(gpu: GPU, flops: int, bytes_moved: int, dtype: torch.dtype, tensor_cores: bool,
              allow_tf32: bool) -> int:
    """Roofline time of one kernel: compute and memory traffic overlap, so the slower one sets the pace.

    time = kernel_min_us + max(flops / (peak * matmul_efficiency), bytes / (bandwidth * memory_efficiency)),
    with matmul_efficiency only for tensor-core ops.
    """
    flops_per_s = peak_flops_per_s(gpu, dtype, tensor_cores, allow_tf32)
    if tensor_cores:
        flops_per_s *= gpu.matmul_efficiency
    compute_s = flops / flops_per_s
    memory_s = bytes_moved / (gpu.memory_bandwidth_gbps * 1e9 * gpu.memory_efficiency)
    return math.ceil(gpu.kernel_min_us * 1000 + max(compute_s, memory_s) * 1e9)


def copy_ns(link: Link, nbytes: int, pinned: bool = True) -> int:
    """One transfer over a link: fixed latency plus bytes at the reachable bandwidth.

    Pageable host memory is staged through a pinned buffer by the driver, hence its lower efficiency.
    """
    efficiency = link.efficiency if pinned else link.pageable_efficiency
    return math.ceil(link.latency_us * 1000 + nbytes / (link.bandwidth_gbps * efficiency))


def device_copy_ns(gpu: GPU, nbytes: int) -> int:
    """A copy within one GPU: nbytes read plus nbytes written through the same memory."""
    return math.ceil(gpu.kernel_min_us * 1000
                     + 2 * nbytes / (gpu.memory_bandwidth_gbps * gpu.memory_efficiency))


def _ring_ns(link: Link, steps: int, bytes_per_step: float) -> int:
    return math.ceil(steps * (link.latency_us * 1000 + bytes_per_step / (link.bandwidth_gbps * link.efficiency)))


def ring_allreduce_ns(link: Link, nbytes: int, num_gpus: int) -> int:
    """Ring all-reduce (alpha-beta model): a reduce-scatter then an all-gather.

    time = 2(n-1) * (latency + (nbytes/n) / (bandwidth * efficiency)). nccl-tests reports
    algbw = nbytes / time and "bus bandwidth" busbw = algbw * 2(n-1)/n, which tends to
    bandwidth * efficiency for large messages whatever n is.
    """
    if num_gpus == 1:
        return 0
    return _ring_ns(link, 2 * (num_gpus - 1), nbytes / num_gpus)


def ring_allgather_ns(link: Link, nbytes: int, num_gpus: int) -> int:
    """Ring all-gather of an nbytes output: (n-1) steps each passing one nbytes/n shard along.

    time = (n-1) * (latency + (nbytes/n) / (bandwidth * efficiency)); nccl-tests busbw = algbw * (n-1)/n.
    """
    if num_gpus == 1:
        return 0
    return _ring_ns(link, num_gpus - 1, nbytes / num_gpus)


def ring_reduce_scatter_ns(link: Link, nbytes: int, num_gpus: int) -> int:
    """Ring reduce-scatter of an nbytes input: the all-gather's mirror image, same (n-1) steps of nbytes/n.

    time = (n-1) * (latency + (nbytes/n) / (bandwidth * efficiency)); nccl-tests busbw = algbw * (n-1)/n.
    """
    if num_gpus == 1:
        return 0
    return _ring_ns(link, num_gpus - 1, nbytes / num_gpus)


def broadcast_ns(link: Link, nbytes: int, num_gpus: int) -> int:
    """Pipelined ring broadcast: the data streams down the chain once, each hop adds its latency.

    time = (n-1) * latency + nbytes / (bandwidth * efficiency); nccl-tests busbw = algbw.
    """
    if num_gpus == 1:
        return 0
    return math.ceil((num_gpus - 1) * link.latency_us * 1000 + nbytes / (link.bandwidth_gbps * link.efficiency))
