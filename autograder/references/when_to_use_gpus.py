"""Reference answers for chapter 0, "When are several GPUs worth it?" (hidden from learners; see autograder/README.md)."""
from __future__ import annotations

import numpy as np
import torch
from torch.autograd import DeviceType

import course
from course.lessons.timing import gpu_time_ms


def copy_share(averages) -> float:
    """Share of a profile's GPU time in copies: the CUDA rows only, since op rows repeat the time they launched."""
    gpu_rows = [row for row in averages if row.device_type == DeviceType.CUDA]
    copies = sum(row.self_device_time_total for row in gpu_rows if row.key.startswith(("copy", "Memcpy")))
    return copies / sum(row.self_device_time_total for row in gpu_rows)


def fit_parallel_fraction(times_ms: dict) -> float:
    """Amdahl's p fitted with T1 by least squares on the times: T(n) = s + q / n is linear in s = T1 (1 - p), q = T1 p."""
    counts = np.array(list(times_ms), dtype=float)
    times = np.array(list(times_ms.values()), dtype=float)
    (serial_ms, parallel_ms), *_ = np.linalg.lstsq(np.stack([np.ones_like(counts), 1 / counts], axis=1), times,
                                                   rcond=None)
    return float(parallel_ms / (serial_ms + parallel_ms))


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
