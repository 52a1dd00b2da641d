"""Reference answers for the capstone notebook (chapter 10; hidden from learners, see autograder/README.md)."""
from __future__ import annotations

from course import planning


def largest_batch(spec, strategy, num_gpus, gpu, limit=4096):
    """The largest global batch (1..limit) whose memory fits one GPU of the preset under `strategy`; 0 if none."""
    best = 0
    for batch in range(1, limit + 1):
        if not planning.fits(spec, strategy, num_gpus, batch, gpu):
            break
        best = batch
    return best


def plan_job(spec, num_gpus, global_batch, gpu, link):
    """The fitting strategy with the smallest simulated step: {"strategy", "step_ms", "memory_gib"}, or None."""
    best = None
    for strategy in planning.STRATEGIES:
        if not planning.fits(spec, strategy, num_gpus, global_batch, gpu):
            continue
        step_ms = planning.simulate_step(spec, strategy, num_gpus, global_batch, gpu=gpu, link=link).step_ms
        if best is None or step_ms < best["step_ms"]:
            memory = planning.memory_per_gpu(spec, strategy, num_gpus, global_batch)["total"] / planning.GiB
            best = {"strategy": strategy, "step_ms": step_ms, "memory_gib": memory}
    return best
