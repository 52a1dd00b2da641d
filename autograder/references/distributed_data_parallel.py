"""Reference answers for the distributed-data-parallel notebook (chapter 6; hidden from learners, see autograder/README.md).

Its hidden tests run these and the learner's answers in harnesses from the course package, which the learner's
kernel needs too: `course.lessons.ring.run_ring` and `course.lessons.ddp.train_data_parallel(..., hand_written=fn)`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course.lessons.ddp_timing import simulate_ddp_step


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum every gradient over the ranks with all_reduce and divide by the world size; skip missing gradients."""
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= world_size


def ring_all_reduce(tensor: torch.Tensor, rank: int, world_size: int, exchange) -> torch.Tensor:
    """Sum `tensor` over the ranks in place: n-1 reduce-scatter steps, then n-1 all-gather steps.

    `exchange(send_chunk, receive_into)` sends to rank + 1 and receives from rank - 1.
    """
    chunks = list(tensor.view(-1).tensor_split(world_size))
    for step in range(world_size - 1):
        send_index, receive_index = (rank - step) % world_size, (rank - step - 1) % world_size
        received = torch.empty_like(chunks[receive_index])
        exchange(chunks[send_index].clone(), received)
        chunks[receive_index] += received
    for step in range(world_size - 1):
        send_index, receive_index = (rank + 1 - step) % world_size, (rank - step) % world_size
        received = torch.empty_like(chunks[receive_index])
        exchange(chunks[send_index].clone(), received)
        chunks[receive_index].copy_(received)
    return tensor


def strong_scaling(make_model, global_batch: int, num_features: int, gpu_counts, link: str = "nvlink3",
                   **step_options) -> list[dict]:
    """Strong scaling of DDP: the global batch stays fixed and is split over the GPUs.

    The largest share, ceil(global_batch / n), sets every step's pace (the others wait for it in the
    all-reduce). One row per GPU count: gpus, per_gpu_batch, step_ms, speedup over one GPU, efficiency.
    `step_options` (the precision: autocast_dtype, reduce_dtype) go to every simulated step unchanged.
    """
    rows = []
    for num_gpus in gpu_counts:
        per_gpu = math.ceil(global_batch / num_gpus)
        step = simulate_ddp_step(make_model, (per_gpu, num_features), num_gpus, link=link, **step_options)
        rows.append({"gpus": num_gpus, "per_gpu_batch": per_gpu, "step_ms": step.step_ms})
    one_gpu_ms = simulate_ddp_step(make_model, (global_batch, num_features), 1, link=link, **step_options).step_ms
    for row in rows:
        row["speedup"] = one_gpu_ms / row["step_ms"]
        row["efficiency"] = row["speedup"] / row["gpus"]
    return rows


def first_divergence(calls_per_rank):
    """Where the ranks' collective sequences first differ: None if they never do, else (position, {call: ranks}).

    A rank whose list has ended makes no call there, recorded under the key None; each group's ranks ascend.
    """
    longest = max((len(calls) for calls in calls_per_rank), default=0)
    for position in range(longest):
        groups: dict = {}
        for rank, calls in enumerate(calls_per_rank):
            groups.setdefault(calls[position] if position < len(calls) else None, []).append(rank)
        if len(groups) > 1:
            return position, groups
    return None


def exposed_all_reduce(trace):
    """(first all-reduce on cuda:0 still running when backward's last kernel ends, ms from then to the last one's end).

    Backward's last kernel is the last one on cuda:0's compute stream (0) that starts before the last all-reduce
    ends: the optimizer's kernels wait for it, and the compress hook's casts back to fp32 run on another stream.
    """
    gpu0 = [e for e in trace if e.device == "cuda:0"]
    all_reduces = sorted((e for e in gpu0 if e.kind == "collective"), key=lambda e: e.start_ns)
    communication_end_ns = max(e.end_ns for e in all_reduces)
    backward_end_ns = max(e.end_ns for e in gpu0
                          if e.kind == "kernel" and e.stream == 0 and e.start_ns < communication_end_ns)
    first_bucket = next(index for index, e in enumerate(all_reduces) if e.end_ns > backward_end_ns)
    return first_bucket, (communication_end_ns - backward_end_ns) / 1e6
