"""Reference answers for chapter 0, "When are several GPUs worth it?" (hidden from learners; see autograder/README.md)."""
from __future__ import annotations

import torch

import course
from course.timing import gpu_time_ms


def amdahl_speedup(parallel_fraction: float, num_gpus: int) -> float:
    """Amdahl's law: the serial part (1 - p) keeps its time, the parallel part p is split num_gpus ways."""
    return 1.0 / ((1.0 - parallel_fraction) + parallel_fraction / num_gpus)


def matmul_ms(size: int, gpu: str = "A100-80GB", dtype=torch.float32) -> float:
    """Simulated milliseconds of one size x size matmul on one GPU, measured with CUDA events."""
    with course.emulate(force=True, gpus=1, gpu=gpu, materialize=False):
        a = torch.randn(size, size, device="cuda:0", dtype=dtype)
        ms, _ = gpu_time_ms(torch.matmul, a, a)
    return ms


def break_even_size(time_ms, sizes, num_gpus: int = 2):
    """The first size in `sizes` at which `num_gpus` GPUs take less time than 1; None if there is none."""
    for size in sizes:
        if time_ms(size, num_gpus) < time_ms(size, 1):
            return size
    return None


def gpus_to_request(times_ms: dict, min_efficiency: float = 0.75) -> int:
    """The largest GPU count whose parallel efficiency t1 / (n * tn) is at least min_efficiency; 1 if none."""
    single = times_ms[1]
    return max([n for n, t in times_ms.items() if single / (n * t) >= min_efficiency] + [1])
