"""How right is the emulator's clock? Published measurements of real GPUs next to what the emulator predicts.

Every prediction runs the same work under `course.emulate(..., materialize=False)` and times it with
`torch.cuda.Event`, exactly as a notebook would. Calibration lives in course/hardware.py, never here: this
script only runs the emulator and compares. Rows whose measurement a preset was fitted to are marked
"calibrated-on: yes"; they are not independent evidence, so the summary also gives the error over the others.
Run: PYTHONPATH=. python benchmarks/fidelity.py
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import course

GB = 1e9
WORKPLACE = "measured in this workplace (course design notes)"


def _timed_ms(work: Callable[[], None]) -> float:
    """Simulated milliseconds of `work`, between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def matmul_tflops(gpu: str, m: int, n: int, k: int, dtype=torch.bfloat16, allow_tf32=False) -> float:
    """TFLOP/s of one (m x k) @ (k x n) matmul."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        with course.emulate(gpus=1, gpu=gpu, materialize=False, force=True):
            a = torch.empty(m, k, device="cuda:0", dtype=dtype)
            b = torch.empty(k, n, device="cuda:0", dtype=dtype)
            ms = _timed_ms(lambda: a @ b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return 2 * m * n * k / (ms / 1e3) / 1e12


def device_copy_tbps(gpu: str, nbytes: int) -> float:
    """TB/s of `src.clone()` within one GPU, counting bytes read + written (as bandwidthTest does)."""
    with course.emulate(gpus=1, gpu=gpu, materialize=False, force=True):
        src = torch.empty(nbytes, device="cuda:0", dtype=torch.uint8)
        ms = _timed_ms(lambda: src.clone())
    return 2 * nbytes / (ms / 1e3) / 1e12


def host_to_device_gbps(host_link: str, nbytes: int, pinned: bool) -> float:
    """GB/s of one host-to-device copy of a pinned or pageable CPU tensor."""
    with course.emulate(gpus=1, gpu="A100-80GB", host_link=host_link, materialize=False, force=True):
        host = torch.empty(nbytes, dtype=torch.uint8)
        if pinned:
            host = host.pin_memory()
        ms = _timed_ms(lambda: host.to("cuda:0", non_blocking=pinned))
    return nbytes / (ms / 1e3) / GB


def allreduce_busbw_gbps(gpu: str, link: str, num_gpus: int, nbytes: int) -> float:
    """nccl-tests bus bandwidth of `torch.cuda.nccl.all_reduce`: algbw * 2(n-1)/n."""
    with course.emulate(gpus=num_gpus, gpu=gpu, link=link, materialize=False, force=True):
        tensors = [torch.empty(nbytes // 4, device=f"cuda:{i}") for i in range(num_gpus)]
        ms = _timed_ms(lambda: torch.cuda.nccl.all_reduce(tensors))
    return nbytes / (ms / 1e3) * 2 * (num_gpus - 1) / num_gpus / GB


def _bert_large_like(layers=24, width=1024, ffn=4096):
    """BERT-large-shaped stack (24 layers, hidden 1024, FFN 4096: ~300M parameters) as plain linears."""
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 3 * width), nn.Linear(3 * width, width),  # attention projections
                   nn.Linear(width, ffn), nn.GELU(), nn.Linear(ffn, width)]
    return nn.Sequential(*blocks)


def ddp_weak_scaling(gpu: str, link: str, num_gpus: int, batch_shape) -> float:
    """Throughput on num_gpus over throughput on 1 GPU, same per-GPU batch (DDP weak scaling)."""
    from course.ddp import simulate_ddp_step

    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the published run is TF32
    try:
        one = simulate_ddp_step(_bert_large_like, batch_shape, 1, gpu=gpu, link=link).step_ms
        many = simulate_ddp_step(_bert_large_like, batch_shape, num_gpus, gpu=gpu, link=link).step_ms
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return num_gpus * one / many


@dataclass
class Row:
    what: str
    hardware: str
    published: float
    unit: str
    calibrated: bool
    source: str
    predict: Callable[[], float]
    predicted: float = float("nan")

    @property
    def error_pct(self) -> float:
        return 100 * (self.predicted - self.published) / self.published


AZURE_A100 = "https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/ND_A100_v4_results.md"
AZURE_H200 = "https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/ND_H200_v5_results.md"
MAMF = ("https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md "
        "(MAMF table, CUDA 12.1)")
TF32_DOCS = ("https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices "
             "(10240^3 matmul on GA100)")


def _rows() -> list[Row]:
    n10k = 10240
    return [
        # ---- matmuls (TFLOP/s) ----
        Row("bf16 matmul 8192^3", "H100 SXM", 798, "TFLOP/s", True, WORKPLACE,
            lambda: matmul_tflops("H100", 8192, 8192, 8192)),
        Row("bf16 matmul 8192^3", "H200 SXM", 788, "TFLOP/s", True, WORKPLACE,
            lambda: matmul_tflops("H200", 8192, 8192, 8192)),
        Row("bf16 matmul 6144x17920x2816", "H100 SXM", 792.1, "TFLOP/s", False, MAMF,
            lambda: matmul_tflops("H100", 6144, 17920, 2816)),
        Row("bf16 matmul 6912x16384x2048", "A100 SXM", 267.9, "TFLOP/s", True, MAMF,
            lambda: matmul_tflops("A100-80GB", 6912, 16384, 2048)),
        Row("fp16 matmul 8192^3 (cuBLASLt)", "A100 SXM 80GB", 253.7, "TFLOP/s", False, AZURE_A100,
            lambda: matmul_tflops("A100-80GB", 8192, 8192, 8192, torch.float16)),
        Row("fp32 matmul 10240^3, TF32 off (0.11 s)", "A100", 2 * n10k**3 / 0.11 / 1e12, "TFLOP/s", False,
            TF32_DOCS, lambda: matmul_tflops("A100-80GB", n10k, n10k, n10k, torch.float32, allow_tf32=False)),
        Row("fp32 matmul 10240^3, TF32 on (0.016 s)", "A100", 2 * n10k**3 / 0.016 / 1e12, "TFLOP/s", False,
            TF32_DOCS, lambda: matmul_tflops("A100-80GB", n10k, n10k, n10k, torch.float32, allow_tf32=True)),
        # ---- copies within one GPU (TB/s, bytes read + written) ----
        Row("device-to-device copy", "H100 SXM", 3.0, "TB/s", True, WORKPLACE,
            lambda: device_copy_tbps("H100", 2**30)),
        Row("device-to-device copy", "H200 SXM", 4.3, "TB/s", True, WORKPLACE,
            lambda: device_copy_tbps("H200", 2**30)),
        Row("STREAM Copy", "H200 SXM", 4.01, "TB/s", False, AZURE_H200,
            lambda: device_copy_tbps("H200", 2**30)),
        Row("STREAM Copy", "A100 SXM 80GB", 1.61, "TB/s", True, AZURE_A100,
            lambda: device_copy_tbps("A100-80GB", 2**30)),
        Row("copy of 0.38 GB (theirs: copy_, ours: clone)", "A100 80GB", 1.49, "TB/s", False,
            "https://github.com/chsasank/device-benchmarks (README table; benchmark.py counts 2x bytes)",
            lambda: device_copy_tbps("A100-80GB", 379_625_060)),
        # ---- host to device (GB/s) ----
        Row("H2D pinned, 1 GB (bandwidthTest)", "PCIe 3 x16 (P100 host)", 12.4, "GB/s", False,
            "https://github.com/jdh4/della-gpu-A100 (README, TIGER node)",
            lambda: host_to_device_gbps("pcie3", 10**9, pinned=True)),
        Row("H2D pinned, 1 GB (bandwidthTest)", "PCIe 4 x16 (A100 PCIe)", 25.9, "GB/s", False,
            "https://github.com/jdh4/della-gpu-A100 (README, DELLA node)",
            lambda: host_to_device_gbps("pcie4", 10**9, pinned=True)),
        Row("H2D pinned, 32 MB (bandwidthTest)", "PCIe 4 x16 (DGX A100)", 25.7, "GB/s", False,
            "https://github.com/gengwg/gpu/blob/main/nvda_gpu_benchmark.md",
            lambda: host_to_device_gbps("pcie4", 32_000_000, pinned=True)),
        Row("H2D pageable, 32 MB (bandwidthTest)", "PCIe 4 x16 (DGX A100)", 10.0, "GB/s", True,
            "https://github.com/gengwg/gpu/blob/main/nvda_gpu_benchmark.md",
            lambda: host_to_device_gbps("pcie4", 32_000_000, pinned=False)),
        Row("H2D pinned (nvbandwidth CE)", "PCIe 4 x16 (ND A100 v4)", 26.28, "GB/s", False, AZURE_A100,
            lambda: host_to_device_gbps("pcie4", 2**29, pinned=True)),
        Row("H2D pinned (nvbandwidth CE)", "PCIe 5 x16 (ND H200 v5)", 52.0, "GB/s", False, AZURE_H200,
            lambda: host_to_device_gbps("pcie5", 2**29, pinned=True)),
        # ---- NCCL all-reduce bus bandwidth, 8 GPUs over NVLink (GB/s) ----
        Row("all-reduce busbw, 8 GPUs, 8 GB", "8x A100 SXM, NVLink 3", 231.58, "GB/s", False, AZURE_A100,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 8 * 2**30)),
        Row("all-reduce busbw, 8 GPUs, ring", "8x H100 SXM, NVLink 4", 370, "GB/s", True,
            "https://github.com/NVIDIA/nccl-tests/issues/212 (NCCL maintainer)",
            lambda: allreduce_busbw_gbps("H100", "nvlink4", 8, 8 * 2**30)),
        Row("all-reduce busbw, 8 GPUs, NVLS", "8x H200 SXM, NVLink 4", 479.98, "GB/s", False, AZURE_H200,
            lambda: allreduce_busbw_gbps("H200", "nvlink4", 8, 8 * 2**30)),
        # ---- DDP ----
        Row("DDP weak scaling 1->8 GPUs, BERT-large, TF32", "8x A100 80GB (DGX A100)", 7.90, "x", False,
            "NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT README (pre-training, seq 128)",
            lambda: ddp_weak_scaling("A100-80GB", "nvlink3", 8, (16384, 1024))),
    ]


def rows() -> list[Row]:
    """Every row with its prediction filled in."""
    result = _rows()
    for row in result:
        row.predicted = row.predict()
    return result


def summary(result: list[Row]) -> dict:
    errors = [abs(r.error_pct) for r in result]
    independent = [abs(r.error_pct) for r in result if not r.calibrated]
    return {"median": statistics.median(errors), "worst": max(errors),
            "independent_median": statistics.median(independent), "independent_worst": max(independent)}


def main() -> None:
    result = rows()
    header = ("what", "hardware", "published", "predicted", "unit", "error %", "calibrated-on", "source")
    table = [header] + [(r.what, r.hardware, f"{r.published:.4g}", f"{r.predicted:.4g}", r.unit,
                         f"{r.error_pct:+.1f}", "yes" if r.calibrated else "no", r.source) for r in result]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    right = {2, 3, 5}
    for line in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        print("  ".join(cells + [line[-1]]))
    s = summary(result)
    print(f"median error {s['median']:.1f}%  worst error {s['worst']:.1f}%  "
          f"(independent rows: median {s['independent_median']:.1f}%, worst {s['independent_worst']:.1f}%)")


if __name__ == "__main__":
    main()
