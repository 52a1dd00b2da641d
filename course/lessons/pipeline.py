"""Measuring model-parallel and pipelined runs: timing across every GPU, the GPipe schedule, and bubbles.

The chapter on model parallelism uses these to time a forward pass that spans several GPUs, to draw the
idealised GPipe schedule, and to measure from the emulator's trace how much of the time the stages idle.
"""
from __future__ import annotations

import time

import torch

from course.cuda import devices
from course.machine.trace import merge_intervals


def synchronize_all() -> None:
    """Wait for every GPU. `torch.cuda.synchronize()` alone waits only for the *current* device."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


def _now_ms() -> float:
    emu = devices.active
    return emu.now_ms() if emu is not None else time.perf_counter() * 1e3


def elapsed_ms(fn, *args, **kwargs) -> tuple[float, object]:
    """Milliseconds `fn(*args, **kwargs)` takes until every GPU has finished it, and its result.

    CUDA events cannot time work that spans GPUs (both events must be on one device), so this
    synchronises all GPUs before and after and reads the host clock: the emulator's simulated clock,
    or the wall clock on real GPUs.
    """
    synchronize_all()
    start = _now_ms()
    result = fn(*args, **kwargs)
    synchronize_all()
    return _now_ms() - start, result


def gpipe_schedule(stages: int, micro_batches: int) -> list[tuple[int, int, int]]:
    """The idealised GPipe forward schedule as (stage, micro_batch, time_slot) triples.

    Every stage takes one time slot per micro-batch; stage s can work on micro-batch i once stage
    s-1 has finished it (slot s + i) and it has finished micro-batch i-1 itself.
    """
    return [(s, i, s + i) for s in range(stages) for i in range(micro_batches)]


def plot_schedule(stages: int, micro_batches: int, ax=None):
    """Draw `gpipe_schedule` as a grid: one row per stage (GPU), one column per time slot.

    Coloured cells are work (labelled with the micro-batch), grey hatched cells are the bubble.
    The title gives the idle share counted from the grid. Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    slots = stages + micro_batches - 1
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12, max(6.5, 1.5 + 0.5 * slots)), 1.2 + 0.5 * stages), layout="constrained")
    colours = plt.get_cmap("tab20")
    busy = {(s, t) for s, _, t in gpipe_schedule(stages, micro_batches)}
    for s, i, t in gpipe_schedule(stages, micro_batches):
        ax.broken_barh([(t, 1)], (s - 0.4, 0.8), facecolors=colours(i % 20), edgecolor="white")
        if slots <= 30:
            ax.text(t + 0.5, s, str(i), ha="center", va="center", fontsize=8)
    idle = [(s, t) for s in range(stages) for t in range(slots) if (s, t) not in busy]
    for s, t in idle:
        ax.broken_barh([(t, 1)], (s - 0.4, 0.8), facecolors="whitesmoke", edgecolor="lightgrey", hatch="//")
    ax.set_yticks(range(stages), [f"stage {s} (cuda:{s})" for s in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_xlim(0, slots)
    ax.set_xlabel("time slot (one micro-batch through one stage)")
    ax.set_title(f"GPipe forward, {stages} stages x {micro_batches} micro-batches:\n"
                 f"{len(idle)} of {stages * slots} cells idle ({100 * len(idle) / (stages * slots):.1f}%)")
    return ax.figure


def _busy_intervals(trace, device: str) -> list[tuple[int, int]]:
    """Merged (start, end) intervals in which `device` runs a kernel, copy or collective."""
    return merge_intervals((e.start_ns, e.end_ns) for e in trace if e.device == device and e.kind != "host")


def measured_bubble(trace, devices_used: list[str]) -> float:
    """Share of time the GPUs in `devices_used` sat idle, between the first and the last thing any of them did.

    1 - (sum of each GPU's busy time) / (number of GPUs x span). Copies count as busy: the GPU's
    stream is held by them.
    """
    intervals = {d: _busy_intervals(trace, d) for d in devices_used}
    everything = [iv for ivs in intervals.values() for iv in ivs]
    if not everything:
        raise ValueError(f"nothing ran on {devices_used} in this trace")
    span = max(end for _, end in everything) - min(start for start, _ in everything)
    busy = sum(end - start for start, end in everything)
    return 1 - busy / (len(devices_used) * span)


def overlap_ns(trace, device_a: str, device_b: str, kind: str = "kernel") -> int:
    """Nanoseconds during which `device_a` and `device_b` both run an event of `kind` at the same time."""
    def merged(device):
        return _busy_intervals([e for e in trace if e.kind == kind], device)

    total, b_intervals = 0, merged(device_b)
    for a_start, a_end in merged(device_a):
        for b_start, b_end in b_intervals:
            total += max(0, min(a_end, b_end) - max(a_start, b_start))
    return total
