"""Scaling studies: time some work for several problem sizes and GPU counts, then draw times and speedups.

The work is any `time_ms(size, num_gpus) -> milliseconds` function, so the same sweep and plots serve a
sharded matmul, a DataParallel step or a what-if at real scale in shape-only mode.
"""
from __future__ import annotations


def amdahl_speedup(parallel_fraction: float, num_gpus: int) -> float:
    """Amdahl's law: the serial part (1 - p) of the one-GPU time stays, the parallel part p splits num_gpus ways."""
    return 1.0 / ((1.0 - parallel_fraction) + parallel_fraction / num_gpus)


def sweep(time_ms, sizes, gpu_counts) -> dict[int, list[float]]:
    """`{num_gpus: [time_ms(size, num_gpus) for size in sizes]}`: one row of timings per GPU count."""
    return {num_gpus: [time_ms(size, num_gpus) for size in sizes] for num_gpus in gpu_counts}


def speedups(times_ms: dict[int, list[float]], baseline_gpus: int = 1) -> dict[int, list[float]]:
    """Speedup of every row of a `sweep` over the `baseline_gpus` row: above 1 means faster than it."""
    baseline = times_ms[baseline_gpus]
    return {num_gpus: [base / t for base, t in zip(baseline, row)] for num_gpus, row in times_ms.items()}


def plot_times(sizes, times_ms: dict[int, list[float]], ax=None, title=None, size_label="problem size"):
    """Time against problem size, one line per GPU count, both axes logarithmic. Returns the Axes."""
    import matplotlib.pyplot as plt  # here, not at the top: pyplot takes a second to import

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for num_gpus, row in times_ms.items():
        ax.plot(sizes, row, marker="o", label=f"{num_gpus} GPU" + ("s" if num_gpus > 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(size_label)
    ax.set_ylabel("time (ms, simulated)")
    ax.set_title(title or "Time against problem size")
    ax.legend()
    return ax


def plot_speedups(sizes, times_ms: dict[int, list[float]], ax=None, title=None, size_label="problem size"):
    """Speedup over one GPU against problem size, one line per GPU count; below the line y=1 is a loss."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for num_gpus, row in speedups(times_ms).items():
        if num_gpus != 1:
            ax.plot(sizes, row, marker="o", label=f"{num_gpus} GPUs")
    ax.axhline(1.0, color="gray", linestyle="--", label="as fast as 1 GPU")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(size_label)
    ax.set_ylabel("speedup over 1 GPU (x)")
    ax.set_title(title or "Speedup against problem size")
    ax.legend()
    return ax
