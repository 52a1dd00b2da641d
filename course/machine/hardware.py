"""The GPUs and links the emulator can pretend to be: datasheet peaks, and the fraction real kernels reach.

Every peak figure cites its public datasheet; every efficiency says which measurement it is calibrated on.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
MiB = 2**20

# ---- the host side of eager PyTorch (charged by course/machine/clock.py as the host issues work) ----
# Every op that launches a kernel or a copy costs the host Python, the dispatcher and cudaLaunchKernel. The
# CUDA Graphs blog (https://developer.nvidia.com/blog/cuda-graphs/) times short kernels launched back to back
# at a few microseconds each before PyTorch's Python + dispatcher path adds to that. The calibration row
# "fp16 matmul 512^3 on an RTX 4090" of benchmarks/fidelity.py bounds it from above: a loop of bare `a @ b`
# reached 46.9 TFLOP/s there, 5.7 us per matmul, host included. 5 us per launching op.
HOST_LAUNCH_OVERHEAD_US = 5.0
# A view or metadata op (view, transpose, select, split, detach, ...) launches nothing but still goes through
# Python and the dispatcher: PyTorch's operator micro-benchmark times `split` on CUDA tensors at 2.3-3.4 us
# from Python (https://github.com/pytorch/pytorch/pull/32194), and the dispatcher alone at ~0.27 us for an
# empty op called from C++ (https://github.com/pytorch/pytorch/pull/51165, "empty framework overhead
# benchmark"), as `linear` calls `t` and `view`. Eager transformer code issues about as many views as kernels.
# This takes the top of the measured range; the Python of model code around each op is HOST_MODULE_OP_US below.
HOST_VIEW_OP_US = 3.4
# Model code pays Python that a bare loop of ops does not (course/cuda/module_calls.py). Each `nn.Module` call goes
# through `__call__` and its hook checks and the forward's frame: PyTorch's own measurement
# (https://github.com/pytorch/pytorch/pull/50431, Chillee, 2021-02-21) puts the module abstraction at ~2.2 us for a
# module that does nothing (3.08 us against 0.91 us for its one op).
HOST_MODULE_CALL_US = 2.2
# Every op issued inside a module's forward also pays the Python of the line around it (attribute lookups of
# parameters and submodules, argument unpacking, indexing, the interpreter's bytecode), on top of its dispatch and
# launch above: gpt-fast's eager decode step (below) comes to ~9.5 us per op (39 ms over the ~4,100 launches and
# views its replica issues) where a bare `a @ b` loop (the RTX 4090 row) runs at 5.7 us. No direct measurement
# of the Python part exists; fitted on the calibration half of
# benchmarks/fidelity.py only, the one eager row there (gpt-fast's eager Llama-2-7B decode on an A100, 25.5 tok/s,
# run op for op by benchmarks/decode_replicas.py): 5.3 us. Checked on held-out rows it was not fitted to (Hugging
# Face Qwen-2.5-7B decode on an H100 and an L4).
HOST_MODULE_OP_US = 5.3

# `CUDAGraph.replay()` queues a whole captured graph with one cudaGraphLaunch on the current stream (PyTorch's
# aten/src/ATen/cuda/CUDAGraph.cpp), in place of a host launch per kernel: "these overhead costs can be paid once for
# the entire graph during instantiation, and the graph itself can then be launched repeatedly with very little
# overhead" (CUDA Programming Guide, CUDA Graphs, https://docs.nvidia.com/cuda/cuda-programming-guide/04-special-topics/
# cuda-graphs.html). CUDA.jl's documentation measures it (https://cuda.juliagpu.org/dev/usage/graphs/): 10 RK4 steps of
# a small ODE, 80 broadcast kernels, take 260 us launched one by one and 70 us as one graph, "with only 3.5 us of CPU
# time". The Python call into `replay()` is not counted in that (assumption: it is small beside the launch itself).
HOST_GRAPH_LAUNCH_US = 3.5

# `Tensor.pin_memory()` copies a pageable tensor into page-locked memory: a memcpy on the host, before any
# transfer starts. PyTorch's tutorial on pinned memory (https://docs.pytorch.org/tutorials/intermediate/
# pinmem_nonblock.html) measures `t.pin_memory().to(device, non_blocking=True)` up to twice as slow as a plain
# `t.to(device)`, because of that copy. Its rate is the one the driver's own pageable path reaches, which is
# the same memcpy into a pinned staging buffer: 10.0 GB/s on a DGX A100 (the bandwidthTest cited under the
# links below). One CPU thread's memcpy; it depends on the CPU and its memory (assumption: same for every preset).
HOST_PIN_COPY_GBPS = 10.0

# Shortest time a kernel occupies a GPU. The CUDA Graphs blog above times its small elementwise example
# kernel at about 2.9 us; 2 us for a kernel doing almost nothing is an estimate below that, for every preset.
_KERNEL_MIN_US = 2.0

# Fraction of datasheet memory bandwidth a large copy reaches, calibrated on the H100 measurement below
# (3.0 of 3.35 TB/s). GPUs without a workplace measurement reuse it (assumption).
_H100_MEMORY_EFFICIENCY = 3.0 / 3.35


# ---- shape-aware GEMM efficiency (course/machine/costs.py `gemm_shape_efficiency`) ----
# A GEMM runs as output tiles, one per SM at a time, in waves over the SMs; a partial last wave and tiles
# hanging over the matrix edge do no useful work, so 1024^3 and skinny shapes are slower per FLOP than
# large square ones. Threadblock tiles (output rows x columns) are those CUTLASS generates for sm_80
# tensor-core GEMMs (tools/library/scripts/generator.py, GenerateSM80_TensorOp_16816, e.g. 256x128,
# 128x256, 256x64, 128x128 ..., https://github.com/NVIDIA/cutlass); cuBLAS chooses among similar tiles, and
# the model takes the best one. The same set is used for every tensor-core architecture here (sm_70 to
# sm_90: an assumption beyond sm_80). The relative speed of the smaller tiles (they re-read more operand
# bytes per FLOP) and the fixed cost of a tile (prologue + epilogue, as extra k) are fitted on the
# calibration half of benchmarks/fidelity.py only (Azure ND A100 v4 fp16 1024^3, 4096^3, 16384^3,
# 6144x12288x12288; RTX 4090 512^3 and 8192^3).
# Grid search over the smaller tiles' speeds (0.2-1.0) and the k overhead (0-256) minimising the squared log
# error on those rows (each preset's matmul_efficiency refitted to its anchor row at every point) chose:
# every tile smaller than 256x128 at 0.8 of its speed, and no k overhead.
GEMM_TILES = ((256, 128, 1.0), (128, 256, 1.0), (256, 64, 0.8), (64, 256, 0.8), (128, 128, 0.8),
              (128, 64, 0.8), (64, 128, 0.8), (64, 64, 0.8))
# The held-out fp16 802816x192x768 GEMM on an A100 was predicted 35% fast at a copy's bandwidth (see
# GEMM_TILE_STREAM_EFFICIENCY below for what moving operands through tiles costs). It does 154 FLOP per byte
# of its minimal traffic (A read once, C written once), just under the A100's ridge point (268 TFLOP/s over
# 1.61 TB/s = 166 FLOP/B), so compute (1.10 ms at the 256x64 tile's speed) and memory (0.96 ms) both bind and the
# roofline's max() is most optimistic there; the measured 1.50 ms lies between their max and their sum. A soft
# roofline, time = (compute^p + memory^p)^(1/p), would give +2.4% at p = 2, but fitted on the calibration half
# (GEMM, convolution and decode rows, conv efficiency refitted with it) it is worst at p = 2 (squared log error
# 0.105) and best with no blending (0.100: the RTX 4090 512^3 row goes from -15% to -19% at p = 2), so it is not
# used. Re-reading A once per column tile (256x64 tiles: three times) would make it slower still (2.5 ms).
# Re-reading A from L2 once per column tile was tried as a tile speed set by operand traffic (a tm x tn tile does
# tm*tn/(tm+tn) multiply-adds per element it loads; full speed above a threshold, proportionally slower below): the
# calibration GEMM rows' squared log error is 0.11 at a threshold of 40 and grows to 0.54 at 85 (0.097 with the fixed
# speeds below), because the RTX 4090's 512^3 row needs narrow tiles fast and the A100's 1024^3 row needs them slow;
# at 80 (where 128x128 keeps its 0.8) the skinny row would be +25%. Not used. A serial epilogue (writing C after
# the k loop, not under it) acts as a k overhead of about 166 on the A100 (its FLOP rate over its bandwidth), which
# the grid search above rejected (it chose none).
GEMM_TILE_K_OVERHEAD = 0
# Skinny GEMMs (fewer than 64 rows or columns: decode steps, small micro-batches) do not use those tiles:
# cuBLAS has narrow-tile and split-K kernels for them (split-K cuts k into slices so that a handful of output
# tiles still fills every SM: https://github.com/NVIDIA/cutlass/blob/main/media/docs/efficient_gemm.md,
# "Parallelized Reductions"), so there is no wave quantization, and the narrow side is padded only to the
# 16 rows of a tensor-core MMA (mma.sync m16n8k16, PTX ISA "Warp-level matrix multiply-accumulate
# instructions", https://docs.nvidia.com/cuda/parallel-thread-execution/). Speed as the small tiles above
# (0.8). An assumption checked only in that such GEMMs come out memory-bound, as published decode
# measurements are (benchmarks/fidelity.py has no skinny row below 64 to fit on).
GEMM_SKINNY_BELOW = 64
# Split-K for shapes whose output tiles do not fill one wave (same CUTLASS reference): each slice keeps at
# least this much of k, so the partial sums it writes and reduces stay small next to its work (assumption; it
# leaves every fitted row of benchmarks/fidelity.py as it was: none has k >= 2048 and fewer tiles than SMs).
GEMM_SPLIT_K_MIN = 1024
GEMM_MMA_ROWS = 16
GEMM_SKINNY_SPEED = 0.8
# A tensor-core GEMM streams A and B through its tiles' pipelined loads (cp.async or TMA into a few shared-memory
# stages), which keep fewer bytes in flight than a copy or a GEMV kernel, so where it is memory-bound it reads
# memory slower: on a T4, fp16 [M, 896] @ [896, 4864] reaches 0.83x the bandwidth of M = 1 (a cuBLAS GEMV) at M = 2,
# 4 and 8 (https://github.com/pytorch/pytorch/issues/195716); on an H100 the best CUTLASS kernels of a streaming-only
# skinny GEMM peak at ~2.2 TB/s where a copy reaches 3.0 ("always peaking at ~70% of memory b/w",
# https://github.com/NVIDIA/cutlass/issues/1139). So a GEMM with at least two rows and columns moves its bytes at
# this fraction of the copy bandwidth; a GEMV (one row or column, batch-1 decode) keeps the copy's. Fitted on the
# calibration row "fp16 [8, 896] @ [896, 4864] bandwidth over the same at M = 1" of benchmarks/fidelity.py (the
# T4's 0.83x, kernel minimum included); the same for every GPU (assumption: the H100 figure says 0.73).
GEMM_TILE_STREAM_EFFICIENCY = 0.826

# ---- convolutions on tensor cores (course/machine/costs.py `kernel_ns`, conv=True) ----
# cuDNN runs a convolution as an implicit GEMM that gathers its operands from the image as it goes; with few
# channels (64 in ResNet-50's first stages) and its weight- and data-gradient kernels it reaches a smaller share
# of the tensor cores' peak than a cuBLAS GEMM. Fitted on the calibration half of benchmarks/fidelity.py only:
# NVIDIA's ResNet-50 v1.5 training throughput with AMP (fp16, channels-last) on one A100 80GB (2470 img/s) and
# one V100 32GB (1156 img/s) (https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/
# ConvNets/resnet50v1.5, "Training performance results"). A grid over 0.40-0.50 put the squared log error of
# those two rows lowest at 0.45-0.46 (A100 +4%, V100 -4% at 0.45). Convolutions that do not use tensor cores
# (fp32 on V100, where cuDNN has fast native kernels) keep matmul_efficiency alone.
CONV_TENSOR_CORE_EFFICIENCY = 0.45
# Tensor cores convolve channels-last (NHWC) data; given channels-first (NCHW) tensors, cuDNN transposes them to
# NHWC and the result back, an extra pass that reads and writes every tensor the convolution touches (PyTorch's
# channels-last tutorial, https://docs.pytorch.org/tutorials/intermediate/memory_format_tutorial.html, and
# NVIDIA's convolution performance guide, https://docs.nvidia.com/deeplearning/performance/
# dl-performance-convolutional/index.html, "Tensor Layouts In Memory: NCHW vs NHWC").
CONV_NCHW_TRANSPOSE_PASSES = 1


# FP32 multiply-adds per clock per SM, by compute capability: CUDA C++ Programming Guide, "Arithmetic
# Instructions" throughput table (https://docs.nvidia.com/cuda/cuda-c-programming-guide/#arithmetic-instructions),
# row "32-bit floating-point add, multiply, multiply-add".
FP32_LANES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 9): 128, (9, 0): 128}


# What `torch.cuda.get_device_properties` reports of an SM, by compute capability: CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability" table
# (https://docs.nvidia.com/cuda/cuda-c-programming-guide/#features-and-technical-specifications-technical-specifications-per-compute-capability):
# maximum resident threads per SM, 32-bit registers per SM, shared memory per SM, and the most one block may opt in
# to (bytes). The same table gives every one of these a warp of 32 threads, at most 1,024 threads per block and
# 48 KB of shared memory per block without opting in.
SM_LIMITS = {(7, 0): (2048, 65536, 96 * 1024, 96 * 1024),
             (7, 5): (1024, 65536, 64 * 1024, 64 * 1024),
             (8, 0): (2048, 65536, 164 * 1024, 163 * 1024),
             (8, 6): (1536, 65536, 100 * 1024, 99 * 1024),
             (8, 9): (1536, 65536, 100 * 1024, 99 * 1024),
             (9, 0): (2048, 65536, 228 * 1024, 227 * 1024)}
WARP_SIZE, MAX_THREADS_PER_BLOCK, SHARED_MEMORY_PER_BLOCK = 32, 1024, 48 * 1024

# L2 cache (bytes) and memory bus width (bits) of each preset's chip, from NVIDIA's architecture whitepapers:
# V100 6,144 KB and 4,096-bit HBM2 (Volta whitepaper, cited at the V100 preset); A100 40 MB and 5,120-bit
# (https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf);
# H100 SXM5 50 MB and 5,120-bit, five of the full GH100's six HBM stacks, whose twelve 512-bit memory controllers
# the H200 enables all of: 6,144-bit (Hopper whitepaper, cited at the H100 preset); RTX 4090 (AD102) 72 MB and
# 384-bit, L4 (AD104) 48 MB and 192-bit (Ada whitepaper, cited at the RTX 4090 preset); T4 (TU104) 4,096 KB and
# 256-bit (Turing whitepaper, cited at the T4 preset).
CHIP_MEMORY = {"V100": (6 * MiB, 4096), "A100-40GB": (40 * MiB, 5120), "A100-80GB": (40 * MiB, 5120),
               "H100": (50 * MiB, 5120), "H200": (50 * MiB, 6144), "RTX4090": (72 * MiB, 384),
               "L4": (48 * MiB, 192), "T4": (4 * MiB, 256)}


@dataclass(frozen=True)
class GPU:
    """One GPU model: what torch reports about it, and what its kernels can reach."""

    key: str
    name: str
    memory_bytes: int
    multi_processor_count: int
    compute_capability: tuple[int, int]
    peak_tflops: dict[str, float]
    memory_bandwidth_gbps: float
    matmul_efficiency: float
    memory_efficiency: float
    kernel_min_us: float

    @property
    def boost_clock_ghz(self) -> float:
        """The SM clock that the FP32 peak is quoted at: peak = 2 FLOPs per FMA x FP32 lanes per SM x SMs x clock.
        Gives the datasheet boost clocks (A100 1.41, V100 1.53, H100 SXM 1.98, RTX 4090 2.52 GHz)."""
        lanes = FP32_LANES_PER_SM[self.compute_capability]
        return self.peak_tflops["fp32"] * 1e3 / (2 * lanes * self.multi_processor_count)


@dataclass(frozen=True)
class Link:
    """One interconnect, per direction: what the spec promises and what a large copy gets."""

    key: str
    name: str
    bandwidth_gbps: float
    efficiency: float
    pageable_efficiency: float
    latency_us: float
    # NCCL's per-hop latency on this kind of link (see NCCL_HOP_LATENCY_US below).
    hop_latency_us: float = 0.0
    # Bus bandwidth of an all-reduce with NVLink SHARP (NVLS), on machines whose NVSwitches reduce in the
    # switch; 0 where there is none, and the all-reduce is a ring at bandwidth_gbps * efficiency.
    nvls_busbw_gbps: float = 0.0


# peak_tflops holds the datasheet's dense rates by dtype; "fp8" (torch._scaled_mm) and "int8" (torch._int_mm, TOPS)
# only where the datasheet quotes them. Their GEMMs reuse the preset's matmul_efficiency and GEMM_TILES, which were
# calibrated on fp16/bf16 GEMMs: an assumption, as benchmarks/fidelity.py has no float8 or int8 row.
_GPU_LIST = [
    # V100 SXM2 32GB, https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    # : FP64 7.8, FP32 15.7, Tensor (FP16) 125 TFLOPS, 32 GB HBM2 at 900 GB/s. 80 SMs, sm_70 (Volta whitepaper,
    # https://images.nvidia.com/content/volta-architecture/pdf/volta-architecture-whitepaper.pdf).
    # Volta has no TF32 and no BF16 tensor cores: fp32 matmuls with allow_tf32 and bf16 matmuls both run on
    # the CUDA cores, so "tf32" and "bf16" hold the FP32 peak. No FP8 (torch._scaled_mm refuses sm_70) and no INT8
    # tensor cores; the datasheet quotes no INT8 rate, so torch._int_mm falls back to the FP32 peak
    # (costs.peak_flops_per_s).
    # matmul_efficiency 0.80: no measurement; assumed like the H100/H200 calibration below.
    GPU("V100", "Tesla V100-SXM2-32GB", 32 * GiB, 80, (7, 0),
        {"fp64": 7.8, "fp32": 15.7, "tf32": 15.7, "bf16": 15.7, "fp16": 125.0},
        900.0, 0.80, _H100_MEMORY_EFFICIENCY, _KERNEL_MIN_US),
    # A100 SXM4, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # : FP64 9.7, FP32 19.5, TF32 156, BF16 312, FP16 312 TFLOPS, INT8 624 TOPS (dense); 40GB HBM2 1,555 GB/s,
    # 80GB HBM2e 2,039 GB/s. 108 SMs, sm_80. No FP8: Ampere's tensor cores have none, and torch._scaled_mm refuses
    # sm_80 (`_scaled_mm_allowed_device` in aten/src/ATen/native/cuda/Blas.cpp; course/cuda/cuda_only_ops.py).
    # matmul_efficiency: 267.9 of 312 TFLOPS bf16 measured with mamf-finder on
    # A100 SXM, CUDA 12.1 (https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md,
    # "Maximum Achievable Matmul FLOPS comparison table"). memory_efficiency: 1.61 of 2.039 TB/s, the STREAM
    # Copy (bytes read + written) of an A100-SXM4-80GB in Azure's ND A100 v4 results
    # (https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/ND_A100_v4_results.md); the
    # A100 reaches a smaller fraction of its datasheet bandwidth than the H100, so the H100 figure is not reused.
    # The 40GB model has no measurement of its own and shares the 80GB fraction (assumption).
    # With the shape model (GEMM_TILES), 267.9 TFLOP/s on that 6912x16384x2048 shape (whole waves of 256x128
    # tiles on 108 SMs: shape efficiency 1) and 2 us kernel minimum fit matmul_efficiency = 0.8599.
    GPU("A100-40GB", "NVIDIA A100-SXM4-40GB", 40 * GiB, 108, (8, 0),
        {"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0},
        1555.0, 0.8599, 1.61 / 2.039, _KERNEL_MIN_US),
    GPU("A100-80GB", "NVIDIA A100-SXM4-80GB", 80 * GiB, 108, (8, 0),
        {"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0},
        2039.0, 0.8599, 1.61 / 2.039, _KERNEL_MIN_US),
    # H100 SXM5 80GB, https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    # : FP64 34, FP32 67, TF32 989 / BF16 1,979 / FP16 1,979 / FP8 3,958 TFLOPS and INT8 3,958 TOPS *with sparsity*
    # (halved here for dense: the Hopper whitepaper's dense 494.7, 989.4 and 1,978.9), 80 GB HBM3 at 3.35 TB/s.
    # 132 SMs, sm_90 (Hopper whitepaper,
    # https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper).
    # Calibrated in this workplace: an 8192^3 bf16 matmul ran at 798 TFLOP/s, a device-to-device copy at
    # 3.0 TB/s counting bytes read + written. With the shape model, 8192^3 is 2048 256x128 tiles in 16 waves
    # over 132 SMs (shape efficiency 0.970), so 798 TFLOP/s fits matmul_efficiency = 0.8333.
    GPU("H100", "NVIDIA H100 80GB HBM3", 80 * GiB, 132, (9, 0),
        {"fp64": 34.0, "fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9},
        3350.0, 0.8333, _H100_MEMORY_EFFICIENCY, _KERNEL_MIN_US),
    # H200 SXM 141GB, https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446
    # : same compute as H100 SXM (FP64 34, FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958*, INT8 3,958* TOPS,
    # *with sparsity), 141 GB HBM3e
    # at 4.8 TB/s. Same GH100 die: 132 SMs, sm_90. memory_bytes uses the advertised 141 as GiB.
    # Calibrated in this workplace: 788 TFLOP/s on an 8192^3 bf16 matmul (matmul_efficiency 0.8228 with the
    # shape model, as for the H100), 4.3 TB/s read + written on a copy.
    GPU("H200", "NVIDIA H200", 141 * GiB, 132, (9, 0),
        {"fp64": 34.0, "fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9},
        4800.0, 0.8228, 4.3 / 4.8, _KERNEL_MIN_US),
    # GeForce RTX 4090, Ada whitepaper appendix,
    # https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf
    # : 128 SMs, FP32 82.6 TFLOPS, tensor FP16/BF16 with FP32 accumulate 165.2 (dense), TF32 82.6, 24 GB
    # GDDR6X at 1,008 GB/s, sm_89. FP64 runs at 1/64 of FP32 on Ada (same whitepaper): 1.3 TFLOPS. FP8 330.3 dense
    # with FP32 accumulate (660.6 with FP16 accumulate): torch._scaled_mm accumulates in FP32 (`scaled_gemm` in
    # aten/src/ATen/cuda/CUDABlas.cpp sets CUBLAS_COMPUTE_32F). INT8 660.6 TOPS dense.
    # matmul_efficiency 0.9604: fitted on the calibration row "fp16 8192^3 at 158.596 TFLOP/s" of an RTX 4090
    # (https://github.com/mli/transformers-benchmarks/issues/4, first post; shape efficiency 1 on 128 SMs).
    GPU("RTX4090", "NVIDIA GeForce RTX 4090", 24 * GiB, 128, (8, 9),
        {"fp64": 1.3, "fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "int8": 660.6},
        1008.0, 0.9604, _H100_MEMORY_EFFICIENCY, _KERNEL_MIN_US),
    # L4, https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet : FP32 30.3, TF32 120*,
    # FP16/BF16 242*, FP8 485* TFLOPS, INT8 485* TOPS (*with sparsity, halved here for dense), 24 GB GDDR6 at
    # 300 GB/s, 72 W, PCIe 4.0 x16.
    # AD104 with 7,424 CUDA cores = 58 SMs of 128, sm_89 (Ada whitepaper above); FP64 1/64 of FP32.
    # matmul_efficiency 0.70: no measurement; the 72 W card throttles under tensor-core load like the T4
    # (assumption).
    GPU("L4", "NVIDIA L4", 24 * GiB, 58, (8, 9),
        {"fp64": 0.47, "fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "int8": 242.5},
        300.0, 0.70, _H100_MEMORY_EFFICIENCY, _KERNEL_MIN_US),
    # T4, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
    # : FP32 8.1, mixed FP16/FP32 tensor 65 TFLOPS, INT8 130 TOPS (Turing has no sparsity: dense), 16 GB GDDR6 at
    # 320 GB/s, 2,560 CUDA cores = 40 SMs, sm_75. No FP8 (torch._scaled_mm refuses sm_75).
    # FP64 is 1/32 of FP32 on Turing (Turing whitepaper,
    # https://images.nvidia.com/aem-dam/en-zz/Solutions/design-visualization/technologies/turing-architecture/NVIDIA-Turing-Architecture-Whitepaper.pdf).
    # No TF32/BF16 tensor cores: "tf32" and "bf16" fall back to the FP32 peak, as on V100.
    # matmul_efficiency 0.70: no measurement; set below the others because the 70 W card throttles its
    # clock under sustained tensor-core load (assumption).
    GPU("T4", "Tesla T4", 16 * GiB, 40, (7, 5),
        {"fp64": 0.25, "fp32": 8.1, "tf32": 8.1, "bf16": 8.1, "fp16": 65.0, "int8": 130.0},
        320.0, 0.70, _H100_MEMORY_EFFICIENCY, _KERNEL_MIN_US),
]

# ---- NCCL-like collective model (course/machine/costs.py `collective_ns`) ----
# Per-hop latency by link type: NCCL's own tuning model (src/graph/tuning.cc, `hwLat`, Ring/LL column,
# https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc): NVLink 0.47 us, PCI 1.0 us per step.
NCCL_HOP_LATENCY_US = {"nvlink": 0.47, "pci": 1.0}
# Each GPU's NCCL kernel has to be launched before that GPU joins the collective: one host thread driving every GPU
# (`torch.cuda.nccl`, `nn.DataParallel`, nccl-tests' -g n, which is how Azure's tables below were run: `all_reduce_perf
# -b 8 -e 8G -f 2 -g <GPUs>` in
# https://github.com/Azure/AI-benchmarking-guide/blob/main/Benchmarks/NVIDIA/NCCLBandwidth.py) launches them one after
# another, so a small collective costs NCCL_LAUNCH_US per GPU on top of the host's own launch (HOST_LAUNCH_OVERHEAD_US)
# and the hops; a rank driving its own GPU pays one. NCCL_LAUNCH_US was fitted by a grid search (0-5 us, then 0.1 us
# steps around the best, with a fixed cost per call of 0-27 us beside it; the fixed cost came out 0) minimising the
# squared log error on the calibration collective rows of benchmarks/fidelity.py only: Azure's 8-GPU ND A100 v4 (1 KiB,
# 64 KiB, 16 MiB, 1 GiB) and ND H200 v5 (1 KiB, 1 MiB, 1 GiB) all-reduces
# (https://github.com/Azure/AI-benchmarking-guide/tree/main/Azure_Results), 4x RTX 4090 at 256 MiB
# (https://github.com/tinygrad/open-gpu-kernel-modules/issues/36) and 2x RTX 2080 Ti at 32 KiB
# (https://github.com/NVIDIA/nccl-tests/issues/44, the row with another GPU count that tells the per-GPU cost from a
# per-call one). It replaces a fixed 27 us per call fitted on the 8-GPU rows alone, which priced a 2-GPU all-reduce at
# 33 us against 10 us measured (held-out, https://github.com/NVIDIA/nccl/issues/583). A check, not a fit: one rank's
# small all-reduce on 8 NVLink GPUs comes to 5 + 3.3 + 14 x 0.47 = 15 us, NCCL's own estimate for Ring/LL (tuning.cc
# above: baseLat 6.6 us + 14 x 0.6 us).
NCCL_LAUNCH_US = 3.3
# The growth of bus bandwidth with message size (busbw(x) = busbw_max * min(1, (x / n_full)^NCCL_RAMP_EXPONENT),
# n_full = busbw_max * NCCL_RAMP_FULL_S: small messages do not fill NCCL's pipeline, and slower links fill with
# smaller messages) and nvlink4's NVLS bus bandwidth were fitted together with a fixed cost per call (since replaced
# by NCCL_LAUNCH_US above), by a grid search minimising the squared log error on the 8-GPU and 4-GPU calibration
# rows named above.
NCCL_RAMP_EXPONENT = 0.11
NCCL_RAMP_FULL_S = 8.0e-3
_NVLINK4_NVLS_BUSBW_GBPS = 505.0

_LINK_LIST = [
    # PCIe x16 per direction: 8/16/32 GT/s per lane with 128b/130b encoding gives 15.75/31.5/63 GB/s
    # (PCI-SIG, https://pcisig.com/specifications/pciexpress/). Pinned copies in CUDA's bandwidthTest reach
    # ~80-85% of that (checked, not fitted, by benchmarks/fidelity.py). Pageable copies go through a staging
    # buffer (https://developer.nvidia.com/blog/how-optimize-data-transfers-cuda-cc/): calibrated on a DGX A100
    # bandwidthTest, 10.0 GB/s pageable vs 25.7 GB/s pinned host-to-device on PCIe 4
    # (https://github.com/gengwg/gpu/blob/main/nvda_gpu_benchmark.md), i.e. 0.317 of the link, 0.39 of
    # pinned; PCIe 3 and 5 keep that pageable/pinned ratio (assumption: no published pageable numbers found).
    # Pageable speed depends a lot on the host CPU and memory. The 5 us per-transfer latency is an estimate
    # of cudaMemcpy's fixed cost.
    Link("pcie3", "PCIe 3.0 x16", 15.75, 0.80, 0.80 * 10.0 / 25.7, 5.0, NCCL_HOP_LATENCY_US["pci"]),
    Link("pcie4", "PCIe 4.0 x16", 31.5, 0.82, 10.0 / 31.5, 5.0, NCCL_HOP_LATENCY_US["pci"]),
    Link("pcie5", "PCIe 5.0 x16", 63.0, 0.85, 0.85 * 10.0 / 25.7, 5.0, NCCL_HOP_LATENCY_US["pci"]),
    # NVLink per GPU, per direction = half the datasheet's bidirectional total: V100 300 GB/s, A100 600 GB/s,
    # H100 900 GB/s (datasheets above). Efficiency from nccl-tests all-reduce bus bandwidth on 8-GPU NVLink
    # nodes: A100 reports ~200-235 of 300 GB/s (https://github.com/NVIDIA/nccl-tests/issues/149,
    # https://github.com/NVIDIA/nccl-tests/issues/100). H100: NCCL's maintainer gives 370 of 450 GB/s as the
    # ring bus bandwidth on 8 GPUs (https://github.com/NVIDIA/nccl-tests/issues/212); the model is a ring, so
    # 370 GB/s is what every collective but the all-reduce reaches. The all-reduce uses NVLink SHARP (NVLS)
    # on NVSwitch machines: the maintainer gives ~480 GB/s busbw on 8 GPUs in the same thread; nvls_busbw_gbps
    # (the asymptote, reached above 4 GB of bus traffic) is fitted with the ramp above.
    # V100 is taken as ~0.8 (assumption, same order). The 2 us latency_us is an estimate of one peer copy's
    # fixed cost; collectives use NCCL's per-hop latency (hop_latency_us) instead.
    Link("nvlink2", "NVLink 2 (V100)", 150.0, 0.80, 0.80, 2.0, NCCL_HOP_LATENCY_US["nvlink"]),
    Link("nvlink3", "NVLink 3 (A100)", 300.0, 0.77, 0.77, 2.0, NCCL_HOP_LATENCY_US["nvlink"]),
    Link("nvlink4", "NVLink 4 (H100)", 450.0, 370 / 450, 370 / 450, 2.0, NCCL_HOP_LATENCY_US["nvlink"],
         _NVLINK4_NVLS_BUSBW_GBPS),
]

# ---- machines people rent: NVLinks between GPU pairs, GPUs sharing a PCIe switch (course/machine/topology.py) ----
# One NVLink 2 brick carries 25 GB/s per direction; a V100-SXM2 has six (the nvlink2 Link above is all six).
NVLINK2_BRICK_GBPS = 25.0
# A copy between two GPUs of a machine preset over NVLink (k bricks, or a switch's whole link) runs on the copy
# engines and reaches this fraction of the NVLink bandwidth, apart from the all-reduce-fitted efficiency of the
# links above (without a machine preset, peer copies keep the link's efficiency). Fitted on the calibration row
# "P2P unidirectional, 2 NVLinks" of benchmarks/fidelity.py (Dell EMC PowerEdge C4130 configuration K, four
# V100-SXM2 with two bricks between every pair: p2pBandwidthLatencyTest 47.88 of 50 GB/s, Dell EMC Ready
# Solutions for AI Deep Learning with NVIDIA reference guide v1.0, section 3.1, Table 3).
NVLINK_P2P_COPY_EFFICIENCY = 47.88 / 50.0

# A copy engine copying host memory to its GPU reads it: its read requests go up the GPU's PCIe link, where they
# queue behind the posted writes of a device-to-host copy filling that direction, so a host-to-device copy gets
# about half its rate while the same GPU also copies to the host (the device-to-host copy keeps its own). Fitted on
# the calibration row "H2D pinned while a D2H runs" of benchmarks/fidelity.py: nvbandwidth's
# host_to_device_bidirectional_memcpy_ce on an A100 on PCIe 4, 12-13 GB/s against 25-26 GB/s alone
# (https://github.com/NVIDIA/nvbandwidth/issues/11).
PCIE_READ_UNDER_WRITE = 12.5 / 25.8

# A peer copy between GPUs that cannot reach each other's memory (no peer access) is staged through host memory:
# the driver moves it in chunks through a pinned staging buffer, the source GPU's copy engine writing each chunk
# up to host memory and the destination's reading it back down, and the host hands every chunk from one copy engine to
# the other (such copies are host-driven, not asynchronous: the Nsight trace in
# https://forums.developer.nvidia.com/t/queueing-device-to-device-peer-memcpy-stalls-concurrent-copy-operations/295894).
# The two legs overlap across chunks, so the host link's rate sets the pace, but each handoff is a stall that
# overlaps nothing: a fixed cost per chunk, hence per byte, whatever the link's speed. Fitted on the calibration
# row "P2P=Disabled unidirectional GPU0->GPU2" of benchmarks/fidelity.py (https://github.com/NVIDIA/nccl/issues/814:
# 22.16 GB/s through PCIe 4 where a pinned host copy reaches ~25.8): 6.32 ns per KB.
STAGED_COPY_STALL_NS_PER_BYTE = 6.32e-3


@dataclass(frozen=True)
class Machine:
    """A machine preset: its GPU, how many, its host link, and how each pair of GPUs reaches the other.

    A switch (NVSwitch, or a PCIe switch with peer-to-peer) gives every pair the whole `link`
    (`every_pair_direct`); a cube mesh joins some pairs by NVLink bricks (`nvlink_bricks`). Pairs with neither copy
    through host memory, down one PCIe link and up another (CUDA stages a peer copy through the host when the GPUs
    cannot access each other's memory directly). GPUs listed together in `pcie_switches` share one PCIe uplink to
    the host; copies that cross the same link direction at once share its bandwidth (course/machine/topology.py).
    """

    key: str
    gpu: str
    num_gpus: int
    link: str
    host_link: str
    nvlink_bricks: tuple[tuple[int, int, int], ...] = ()
    every_pair_direct: bool = False
    # GPUs behind one PCIe switch, whose single uplink to the CPU they share (course/machine/topology.py).
    pcie_switches: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        """Refuse presets the cost model would price wrongly, before any copy is timed with them."""
        if self.every_pair_direct and self.nvlink_bricks:
            raise ValueError(f"machine {self.key!r}: a switch gives every pair the whole link, so it has no NVLink "
                             "bricks between pairs; give either every_pair_direct=True or nvlink_bricks, not both")
        if self.nvlink_bricks and self.link != "nvlink2":
            raise ValueError(f"machine {self.key!r}: NVLink bricks are costed at NVLINK2_BRICK_GBPS (NVLink 2), but "
                             f"its link is {self.link!r}; add that link's per-brick bandwidth before using bricks")

    def bricks_between(self, a: int, b: int) -> int:
        for i, j, count in self.nvlink_bricks:
            if {i, j} == {a, b}:
                return count
        return 0


_MACHINE_LIST = [
    # DGX-1 with V100 (hybrid cube mesh): NCCL's topology dump of a DGX-1V in https://github.com/NVIDIA/nccl/
    # issues/671 lists each GPU's NVLink targets and counts (GPU0: GPU1 x1, GPU2 x1, GPU3 x2, GPU4 x2; six bricks
    # per GPU), and "Evaluating Modern GPU Interconnect" (arXiv 1903.04611, DGX-1 figure) draws the same cube
    # mesh for GPUs 4-7; the other pairs (e.g. GPU0-GPU5) have none. Host: PCIe 3 x16 per GPU, two GPUs behind
    # each of four PCIe switches, each switch with one x16 uplink to a CPU (DGX-1 V100 system architecture
    # whitepaper, https://images.nvidia.com/content/pdf/dgx1-v100-system-architecture-whitepaper.pdf, DGX-1 topology
    # figure, which draws two GPUs per switch without numbering them: taken as GPUs 0-1, 2-3, 4-5, 6-7, assumption).
    Machine("DGX-1V", "V100", 8, "nvlink2", "pcie3", (
        (0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 4, 2), (1, 2, 2), (1, 3, 1), (1, 5, 2), (2, 3, 2), (2, 6, 1),
        (3, 7, 1), (4, 5, 1), (4, 6, 1), (4, 7, 2), (5, 6, 2), (5, 7, 1), (6, 7, 2)),
        pcie_switches=((0, 1), (2, 3), (4, 5), (6, 7))),
    # DGX A100 640GB: eight A100-SXM4-80GB joined by six NVSwitches, 600 GB/s bidirectional between any two GPUs,
    # i.e. every pair gets all twelve NVLink 3 links, the nvlink3 Link above (DGX A100 User Guide, "Hardware
    # Overview", https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html). Host: PCIe 4; each
    # of four PCIe 4 switches serves two GPUs (and two NICs) and has one x16 uplink to the CPU (NVIDIA's "DGX A100
    # System Architecture" technical whitepaper, system topology figure; NVIDIA's GPUDirect Storage guide shows the
    # DGX A100's GPUs and NICs under shared switches, https://docs.nvidia.com/ai-enterprise/deployment/bare-metal/
    # latest/gds-appendix-pci-validation.html); which two share one is taken as GPUs 0-1, 2-3, 4-5, 6-7 (assumption).
    # Two GPUs of a switch copying to or from the host at once share that uplink.
    Machine("DGX-A100", "A100-80GB", 8, "nvlink3", "pcie4", every_pair_direct=True,
            pcie_switches=((0, 1), (2, 3), (4, 5), (6, 7))),
    # DGX H100: eight H100 SXM5 80GB joined by four third-generation NVSwitches, 900 GB/s bidirectional between
    # any two GPUs (all eighteen NVLink 4 links, the nvlink4 Link above); GPUs on PCIe 5 (DGX H100 User Guide,
    # "Hardware Overview", https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html). Each GPU's
    # host copies get a whole pcie5 link; how the GPUs share PCIe switches and their uplinks is not modelled.
    Machine("DGX-H100", "H100", 8, "nvlink4", "pcie5", every_pair_direct=True),
    # 8x L4, as Google Cloud's g2-standard-96 rents it (https://cloud.google.com/compute/docs/gpus, "L4 GPUs"): no
    # NVLink (the L4 datasheet above lists PCIe 4.0 x16 as its only interconnect); peers copy over PCIe 4, GPU to
    # GPU through the PCIe switch (data-center GPUs support GPUDirect peer-to-peer over PCIe,
    # https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#peer-to-peer-memory-access). Assumption: the
    # host allows peer access; where a hypervisor or the platform's ACS settings forbid it, copies go through host
    # memory as on the RTX 4090 box below. How the VM's GPUs sit behind PCIe switches is not published, so no
    # uplink is shared (pcie_switches empty): each GPU's own link is still one resource per direction.
    Machine("8xL4", "L4", 8, "pcie4", "pcie4", every_pair_direct=True),
    # 4x RTX 4090 on PCIe 4: GeForce cards have no GPUDirect peer-to-peer, so a peer copy goes back to the CPU and
    # out again (NCCL's maintainer, https://github.com/NVIDIA/nccl/issues/1309; tiny corp's patched driver README,
    # https://github.com/tinygrad/open-gpu-kernel-modules, on why stock drivers refuse P2P on the 4090). No NVLink
    # on Ada GeForce (Ada whitepaper above). Modelled like the DGX-1V's pairs without NVLink: through host memory,
    # each GPU on a root port of its own. NCCL's rings go through host shared memory too (course/machine/topology.py
    # `collective_link`): the host link's rate per direction, one PCI hop's latency per step.
    Machine("4xRTX4090", "RTX4090", 4, "pcie4", "pcie4"),
]

GPUS: dict[str, GPU] = {g.key: g for g in _GPU_LIST}
LINKS: dict[str, Link] = {ln.key: ln for ln in _LINK_LIST}
MACHINES: dict[str, Machine] = {m.key: m for m in _MACHINE_LIST}


def _lookup(kind: str, presets: dict, key: str):
    """Case-insensitive preset lookup whose error lists every valid name, so a typo is fixed in one step."""
    for name, preset in presets.items():
        if name.lower() == key.lower():
            return preset
    raise ValueError(f"unknown {kind} preset {key!r}; choose one of: {', '.join(presets)}")


def gpu(key: str | GPU) -> GPU:
    """The GPU preset named key (a GPU passes through, so callers can take either)."""
    return key if isinstance(key, GPU) else _lookup("GPU", GPUS, key)


def machine(key: str | Machine) -> Machine:
    """The Machine preset named key (a Machine passes through)."""
    return key if isinstance(key, Machine) else _lookup("machine", MACHINES, key)


def link(key: str | Link) -> Link:
    """The Link preset named key (a Link passes through, so callers can take either)."""
    return key if isinstance(key, Link) else _lookup("link", LINKS, key)
