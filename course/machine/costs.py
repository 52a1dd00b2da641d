"""The roofline cost model: how many simulated nanoseconds a kernel, a copy or a collective takes.

All results are integer nanoseconds so the same program always yields the same timeline.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import conv_flop_count, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from course.machine.hardware import (CONV_NCHW_TRANSPOSE_PASSES, CONV_TENSOR_CORE_EFFICIENCY, GEMM_MMA_ROWS, GEMM_SKINNY_BELOW, GEMM_SKINNY_SPEED, GEMM_SPLIT_K_MIN, GEMM_TILE_STREAM_EFFICIENCY, GEMM_TILE_K_OVERHEAD, GEMM_TILES, HOST_GRAPH_LAUNCH_US, HOST_LAUNCH_OVERHEAD_US, HOST_MODULE_CALL_US, HOST_MODULE_OP_US, NVLINK2_BRICK_GBPS, NVLINK_P2P_COPY_EFFICIENCY, HOST_PIN_COPY_GBPS, HOST_VIEW_OP_US, NCCL_LAUNCH_US,
                             NCCL_RAMP_EXPONENT, NCCL_RAMP_FULL_S, STAGED_COPY_STALL_NS_PER_BYTE, GPU, Link, Machine)

aten = torch.ops.aten

HOST_LAUNCH_NS = round(HOST_LAUNCH_OVERHEAD_US * 1000)
HOST_GRAPH_LAUNCH_NS = round(HOST_GRAPH_LAUNCH_US * 1000)
HOST_VIEW_NS = round(HOST_VIEW_OP_US * 1000)
HOST_MODULE_CALL_NS = round(HOST_MODULE_CALL_US * 1000)
HOST_MODULE_OP_NS = round(HOST_MODULE_OP_US * 1000)

def _heads_first(*tensors):
    """The fused kernels' (batch, seq, heads, dim) tensors' shapes as (batch, heads, seq, dim)."""
    return [(t.shape[0], t.shape[2], t.shape[1], t.shape[3]) for t in tensors]


# torch's registry has no entry for the CPU flash-attention kernels, which are what SDPA dispatches to here.
# They take (query, key, value, ...) and (grad_out, query, key, value, ...) in (batch, heads, seq, dim)
# layout like the CUDA flash kernels, so the CUDA formulas apply unchanged.
_FLOP_FORMULAS = {
    **flop_registry,
    # torch's formulas for the flash and memory-efficient kernels called directly read their (batch, seq, heads, dim)
    # dense inputs as (batch, heads, seq, dim) (flop_counter.py, _unpack_flash_attention_nested_shapes); their
    # variable-length form (packed 3-D inputs, flash's only on the emulator: course/cuda/fused_attention_ops.py) they
    # read right.
    **{op: lambda q, k, v, *args, _op=op, **kwargs: flop_registry[_op](q, k, v, *args, **kwargs) if q.dim() == 3 else
       sdpa_flop_count(*_heads_first(q, k, v))
       for op in (aten._flash_attention_forward, aten._efficient_attention_forward)},
    **{op: lambda grad, q, k, v, *args, _op=op, **kwargs: flop_registry[_op](grad, q, k, v, *args, **kwargs)
       if q.dim() == 3 else sdpa_backward_flop_count(*_heads_first(grad, q, k, v))
       for op in (aten._flash_attention_backward, aten._efficient_attention_backward)},
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[aten._scaled_dot_product_flash_attention_backward],
    # FlopCounterMode counts float ops only and leaves out torch._int_mm; an int8 GEMM does 2mnk integer ops all the
    # same, which the datasheets' INT8 TOPS count.
    aten._int_mm: flop_registry[aten.mm],
    # cuDNN's own convolution ops take (input, weight, padding, ...): the registry reads cudnn_convolution's arguments
    # as convolution's, its `benchmark` flag as `transposed`, and has no entry for the transposed one.
    aten.cudnn_convolution: lambda x, w, *args, out_val, **kwargs: conv_flop_count(x.shape, w.shape, out_val.shape),
    aten.cudnn_convolution_transpose: lambda x, w, *args, out_val, **kwargs: conv_flop_count(
        x.shape, w.shape, out_val.shape, transposed=True),
}

# Every op with a FLOP formula is a matmul, convolution or attention; add the composite entry points.
_TENSOR_CORE_OPS = frozenset(_FLOP_FORMULAS) | {aten.matmul, aten.linear}

_DTYPE_KEYS = {torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8",
               torch.float8_e5m2: "fp8", torch.int8: "int8"}

# GEMMs whose tensor cores multiply another dtype than they return: float8 in, bf16 or fp32 out (torch._scaled_mm);
# int8 in, int32 out (torch._int_mm). Their rate is their inputs'.
_WIDENING_GEMMS = frozenset({aten._scaled_mm, aten._int_mm})


def _packet(func):
    return getattr(func, "_overloadpacket", func)


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten op call, counted exactly as FlopCounterMode counts them (0 for ops it ignores), and the
    integer ops of torch._int_mm."""
    formula = _FLOP_FORMULAS.get(_packet(func))
    if formula is None:
        return 0
    if _widens_to_out_dtype(func):  # torch's formulas take the default overload's arguments
        args = args[:-1]
    return int(formula(*args, **(kwargs or {}), out_val=out))


def _widens_to_out_dtype(func) -> bool:
    """mm, bmm, addmm, baddbmm with `out_dtype` (their `.dtype` overloads): the ScalarType is the last positional."""
    return getattr(func, "_overloadname", None) == "dtype"


def uses_tensor_cores(func) -> bool:
    """Whether an op is matmul-like and so runs at tensor-core speed with the calibrated matmul efficiency."""
    return _packet(func) in _TENSOR_CORE_OPS


def operand_dtype(func, args, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype a matmul-like op's tensor cores multiply: its inputs' for the widening GEMMs, else its output's."""
    return args[0].dtype if _packet(func) in _WIDENING_GEMMS or _widens_to_out_dtype(func) else out_dtype


def peak_flops_per_s(gpu: GPU, dtype: torch.dtype, tensor_cores: bool, allow_tf32: bool) -> float:
    """Datasheet peak for this op: tensor-core rate for matmuls, CUDA-core rate for everything else.

    Elementwise ops in bf16/fp16 get the FP32 CUDA-core rate: they are memory-bound in practice and the
    datasheets only quote half-precision rates for the tensor cores. A matmul in a dtype whose rate the preset's
    datasheet does not quote (int8 on a V100, which has no INT8 tensor cores) falls back to the FP32 rate.
    """
    key = _DTYPE_KEYS.get(dtype, "fp32")
    if key == "fp64":
        return gpu.peak_tflops["fp64"] * 1e12
    if not tensor_cores:
        return gpu.peak_tflops["fp32"] * 1e12
    if key == "fp32" and allow_tf32:
        key = "tf32"
    return gpu.peak_tflops.get(key, gpu.peak_tflops["fp32"]) * 1e12


def gemm_shape(func, args, kwargs=None, out=None) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul-like aten op (mm, addmm, bmm, baddbmm, _scaled_mm, _int_mm), None for anything
    else."""
    try:
        packet = _packet(func)
        if packet is aten.mm or packet in _WIDENING_GEMMS:
            a, b = args[0], args[1]
        elif packet is aten.addmm:
            a, b = args[1], args[2]
        elif packet is aten.bmm:
            a, b = args[0], args[1]
        elif packet is aten.baddbmm:
            a, b = args[1], args[2]
        else:
            return None
        if a.dim() == 2:
            return 1, int(a.shape[0]), int(b.shape[1]), int(a.shape[1])
        return int(a.shape[0]), int(a.shape[1]), int(b.shape[2]), int(a.shape[2])
    except (AttributeError, IndexError, TypeError):
        return None


def gemm_shape_efficiency(gpu: GPU, batch: int, m: int, n: int, k: int) -> float:
    """Fraction of a large GEMM's FLOP rate that a (batch x) m x n x k GEMM reaches: wave and tile quantization.

    For each tile (tm x tn, relative speed s) the output needs batch * ceil(m/tm) * ceil(n/tn) tiles, run in
    ceil(tiles / SMs) waves; the useful fraction is batch*m*n / (waves * SMs * tm*tn), times s, times
    k / (k + fixed cost of a tile). When the tiles do not fill one wave and k is long, k is split into slices
    of at least GEMM_SPLIT_K_MIN (split-K), each slice a block of its own. The best choice wins, as cuBLAS's
    heuristics pick one. A skinny GEMM (fewer than GEMM_SKINNY_BELOW rows or columns) runs narrow tiles split
    along k (see course/machine/hardware.py).
    """
    if min(batch, m, n, k) <= 0:
        return 1.0
    narrow = min(m, n)
    if narrow < GEMM_SKINNY_BELOW:  # narrow tiles with split-K: padding to the MMA's rows, no partial waves
        return GEMM_SKINNY_SPEED * narrow / (-(-narrow // GEMM_MMA_ROWS) * GEMM_MMA_ROWS)
    sms = gpu.multi_processor_count
    best = 0.0
    for tm, tn, speed in GEMM_TILES:
        tiles = batch * -(-m // tm) * -(-n // tn)
        splits = range(1, max(1, k // GEMM_SPLIT_K_MIN) + 1) if tiles < sms else (1,)
        fill = max(tiles * s / (-(-(tiles * s) // sms) * sms) for s in splits)  # busy fraction of the waves
        best = max(best, speed * fill * m * n / (-(-m // tm) * tm * -(-n // tn) * tn))
    return best * k / (k + GEMM_TILE_K_OVERHEAD)


def kernel_ns(gpu: GPU, flops: int, bytes_moved: int, dtype: torch.dtype, tensor_cores: bool,
              allow_tf32: bool, gemm: tuple[int, int, int, int] | None = None, conv: bool = False,
              channels_last: bool = True) -> int:
    """Roofline time of one kernel: compute and memory traffic overlap, so the slower one sets the pace.

    time = kernel_min_us + max(flops / (peak * matmul_efficiency * shape), bytes / (bandwidth * memory_efficiency)),
    with matmul_efficiency only for tensor-core ops, and shape = gemm_shape_efficiency(...) when the op's
    GEMM shape (batch, m, n, k) is given (1 otherwise); such a GEMM with at least two rows and columns moves its
    bytes at GEMM_TILE_STREAM_EFFICIENCY of the bandwidth (a GEMV keeps all of it). A convolution (`conv`) that
    runs on tensor cores reaches CONV_TENSOR_CORE_EFFICIENCY of that rate, and on channels-first tensors (not
    `channels_last`) pays the transposes to NHWC and back on top: they are separate passes, so their time adds.
    """
    flops_per_s = peak_flops_per_s(gpu, dtype, tensor_cores, allow_tf32)
    bandwidth = gpu.memory_bandwidth_gbps * 1e9 * gpu.memory_efficiency
    transpose_s = 0.0
    if tensor_cores:
        if conv and flops_per_s > gpu.peak_tflops["fp32"] * 1e12:  # this dtype has tensor cores on this GPU
            flops_per_s *= CONV_TENSOR_CORE_EFFICIENCY
            if not channels_last:
                transpose_s = CONV_NCHW_TRANSPOSE_PASSES * 2 * bytes_moved / bandwidth
        flops_per_s *= gpu.matmul_efficiency
        if gemm is not None:
            flops_per_s *= gemm_shape_efficiency(gpu, *gemm)
    compute_s = flops / flops_per_s
    memory_s = bytes_moved / bandwidth
    if tensor_cores and gemm is not None and min(gemm[1], gemm[2]) > 1:
        memory_s /= GEMM_TILE_STREAM_EFFICIENCY  # tiles stream their operands slower than a copy
    return math.ceil(gpu.kernel_min_us * 1000 + (max(compute_s, memory_s) + transpose_s) * 1e9)


def copy_ns(link: Link, nbytes: int, pinned: bool = True) -> int:
    """One transfer over a link: fixed latency plus bytes at the reachable bandwidth.

    Pageable host memory is staged through a pinned buffer by the driver, hence its lower efficiency.
    """
    efficiency = link.efficiency if pinned else link.pageable_efficiency
    return math.ceil(link.latency_us * 1000 + nbytes / (link.bandwidth_gbps * efficiency))


def peer_copy_ns(machine: Machine, link: Link, host_link: Link, src: int, dst: int, nbytes: int) -> int:
    """A copy between two GPUs of a machine preset, over what joins that pair.

    A switch (`every_pair_direct`) gives the pair the whole link; k NVLink bricks carry k x NVLINK2_BRICK_GBPS. A
    copy over NVLink runs on the copy engines at NVLINK_P2P_COPY_EFFICIENCY, not at the efficiency NCCL's
    all-reduce reaches (the link's); over PCIe, the link's efficiency is already that of a copy. A pair with neither
    goes through host memory, up one PCIe link and down another, in chunks the host hands from one GPU to the other:
    the host link's rate, twice its latency, and STAGED_COPY_STALL_NS_PER_BYTE for the handoffs.
    """
    if machine.every_pair_direct:
        if not link.key.startswith("nvlink"):
            return copy_ns(link, nbytes, pinned=True)
        return math.ceil(link.latency_us * 1000 + nbytes / (link.bandwidth_gbps * NVLINK_P2P_COPY_EFFICIENCY))
    bricks = machine.bricks_between(src, dst)
    if bricks == 0:
        return (copy_ns(host_link, nbytes, pinned=True) + math.ceil(host_link.latency_us * 1000)
                + math.ceil(nbytes * STAGED_COPY_STALL_NS_PER_BYTE))
    return math.ceil(link.latency_us * 1000 + nbytes / (bricks * NVLINK2_BRICK_GBPS * NVLINK_P2P_COPY_EFFICIENCY))


def host_copy_ns(nbytes: int) -> int:
    """A memcpy on the host into pinned memory (`Tensor.pin_memory()`), at `HOST_PIN_COPY_GBPS`."""
    return math.ceil(nbytes / HOST_PIN_COPY_GBPS)


def device_copy_ns(gpu: GPU, nbytes: int) -> int:
    """A copy within one GPU: nbytes read plus nbytes written through the same memory."""
    return math.ceil(gpu.kernel_min_us * 1000
                     + 2 * nbytes / (gpu.memory_bandwidth_gbps * gpu.memory_efficiency))


def bus_bandwidth_gbps(link: Link, bus_bytes: float, all_reduce: bool = False) -> float:
    """The bus bandwidth (GB/s, as nccl-tests reports it) one collective reaches with `bus_bytes` of bus traffic.

    busbw(x) = busbw_max * min(1, (x / (busbw_max * NCCL_RAMP_FULL_S)) ** NCCL_RAMP_EXPONENT): small messages
    do not fill NCCL's pipeline. busbw_max is bandwidth * efficiency on a ring, or nvls_busbw_gbps for an
    all-reduce on an NVSwitch link with NVLink SHARP (the switch reduces).
    """
    busbw = link.bandwidth_gbps * link.efficiency
    if all_reduce and link.nvls_busbw_gbps:
        busbw = link.nvls_busbw_gbps
    full = busbw * 1e9 * NCCL_RAMP_FULL_S
    return busbw * (min(1.0, (bus_bytes / full) ** NCCL_RAMP_EXPONENT) if bus_bytes > 0 else 1.0)


def collective_ns(link: Link, nbytes: int, num_gpus: int, steps: int, bus_bytes: float,
                  all_reduce: bool = False, launches: int = 1) -> int:
    """NCCL-like time of one collective call.

    time = launches * NCCL_LAUNCH_US + hops * hop_latency_us + bus_bytes / bus_bandwidth_gbps(bus_bytes), where
    bus_bytes is what nccl-tests divides by the time to get its "busbw" (nbytes * steps / n for ring collectives).
    `launches` is how many GPUs' kernels one host thread launches one after another before the last GPU joins: every
    GPU for `torch.cuda.nccl` and nccl-tests' -g n, one for a rank that drives its own GPU. An all-reduce with NVLink
    SHARP takes two hops (up to the switch and back) instead of 2(n-1).
    """
    if num_gpus == 1:
        return 0
    hops = 2 if all_reduce and link.nvls_busbw_gbps else steps
    seconds = bus_bytes / (bus_bandwidth_gbps(link, bus_bytes, all_reduce) * 1e9) if bus_bytes > 0 else 0.0
    return math.ceil((launches * NCCL_LAUNCH_US + hops * link.hop_latency_us) * 1000 + seconds * 1e9)


def ring_allreduce_ns(link: Link, nbytes: int, num_gpus: int, launches: int = 1) -> int:
    """All-reduce: a reduce-scatter then an all-gather, 2(n-1) steps (NVLS in the switch where the link has it).

    nccl-tests reports algbw = nbytes / time and busbw = algbw * 2(n-1)/n, which tends to
    bandwidth * efficiency (or nvls_busbw_gbps) for large messages whatever n is; see `collective_ns`.
    """
    steps = 2 * (num_gpus - 1)
    return collective_ns(link, nbytes, num_gpus, steps, nbytes * steps / max(num_gpus, 1), all_reduce=True,
                         launches=launches)


def ring_allgather_ns(link: Link, nbytes: int, num_gpus: int, launches: int = 1) -> int:
    """Ring all-gather of an nbytes output: (n-1) steps each passing one nbytes/n shard along.

    nccl-tests busbw = algbw * (n-1)/n; see `collective_ns`.
    """
    steps = num_gpus - 1
    return collective_ns(link, nbytes, num_gpus, steps, nbytes * steps / max(num_gpus, 1), launches=launches)


def ring_reduce_scatter_ns(link: Link, nbytes: int, num_gpus: int, launches: int = 1) -> int:
    """Ring reduce-scatter of an nbytes input: the all-gather's mirror image, same (n-1) steps of nbytes/n.

    nccl-tests busbw = algbw * (n-1)/n; see `collective_ns`.
    """
    steps = num_gpus - 1
    return collective_ns(link, nbytes, num_gpus, steps, nbytes * steps / max(num_gpus, 1), launches=launches)


def broadcast_ns(link: Link, nbytes: int, num_gpus: int, launches: int = 1) -> int:
    """Pipelined ring broadcast: the data streams down the chain once, each hop adds its latency.

    nccl-tests busbw = algbw; see `collective_ns`.
    """
    return collective_ns(link, nbytes, num_gpus, num_gpus - 1, nbytes, launches=launches)
