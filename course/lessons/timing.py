"""Timing GPU work the right way: CUDA events around the work, then wait for the end event.

Works unchanged on real GPUs (real milliseconds) and under `course.emulate` (simulated ones).
"""
from __future__ import annotations

import torch


def gpu_time_ms(fn, *args, **kwargs) -> tuple[float, object]:
    """Milliseconds of GPU time `fn(*args, **kwargs)` takes on the current stream, and its result.

    Synchronises first so earlier work is not counted, and after, since the end event is only
    known once the GPU has reached it.
    """
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = fn(*args, **kwargs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), result
