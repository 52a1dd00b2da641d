"""Reference answers for the sharded data parallel notebook (ZeRO and FSDP; hidden from learners, see autograder/README.md).

ZeRO stage 1 must train exactly like plain Adam on every rank's data (the ZeRO paper, Rajbhandari et al. 2020,
arXiv:1910.02054, section 5.1: the update is the same, only who stores and computes it changes) and communicate like
a ring reduce-scatter plus all-gather of the padded flat parameter vector (section 7.2).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

ZERO1_COLLECTIVES = ["nccl:reduce_scatter", "nccl:all_gather"]  # per step, in this order


def one_gpu_adam(base_model, rank_batches, lr: float = 0.01) -> list[torch.Tensor]:
    """Weights after plain Adam in one process, one step per step's batches of all ranks concatenated."""
    model = copy.deepcopy(base_model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step_batches in zip(*rank_batches):
        inputs = torch.cat([inputs for inputs, _ in step_batches])
        targets = torch.cat([targets for _, targets in step_batches])
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def zero1_bytes_sent(num_params: int, world_size: int, element_size: int) -> int:
    """Bytes one GPU sends per ZeRO-1 step: a ring reduce-scatter and a ring all-gather of the vector padded to
    world_size * ceil(num_params / world_size) elements, each sending (N-1)/N of it."""
    padded = math.ceil(num_params / world_size) * world_size
    return 2 * padded * element_size * (world_size - 1) // world_size


def ring_bytes_sent_per_step(num_params: int, world_size: int, stage: int, element_size: int = 2) -> int:
    """Bytes one GPU sends per step under ZeRO `stage` with ring collectives: DDP all-reduces the unpadded
    gradients (2(N-1)/N of them); stages 1-2 reduce-scatter and all-gather the padded vector; stage 3
    all-gathers it twice (forward and backward) and reduce-scatters it once."""
    if stage == 0:
        return 2 * num_params * element_size * (world_size - 1) // world_size
    shard = math.ceil(num_params / world_size)
    passes = 3 if stage == 3 else 2
    return passes * shard * (world_size - 1) * element_size


def choose_zero_stage(num_params: int, world_size: int, activation_bytes: int, gpu: str, measure):
    """The smallest stage whose step fits, measured (`measure(stage, num_params, world_size, gpu, extra_bytes)`
    is None when the emulated GPU runs out of memory), and its bf16 bytes sent per GPU per step; None if none fits."""
    for stage in range(4):
        if measure(stage, num_params, world_size, gpu, activation_bytes) is not None:
            return [stage, ring_bytes_sent_per_step(num_params, world_size, stage)]
    return None


def all_gather_waits(events, num_blocks: int) -> list[tuple[str, int, float]]:
    """(phase, block, wait_ms) for every all-gather of one GPU's FSDP2 step, in the order they ran.

    FSDP2 gathers a block's weights before its forward (blocks 0, 1, ...) and again for its backward, which needs the
    last block first; one NCCL stream runs the all-gathers in the order they were issued, so the k-th is known
    whatever the GPU times. wait_ms is the part of the all-gather during which the compute stream (stream 0) runs no
    kernel: the exposed communication, counted as profilers count communication not overlapped with compute."""
    busy: list[list[int]] = []
    for start, end in sorted((e.start_ns, e.end_ns) for e in events if e.kind == "kernel" and e.stream == 0):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    gathers = sorted((e for e in events if e.kind == "collective" and e.name == "nccl:all_gather"),
                     key=lambda e: e.start_ns)
    waits = []
    for k, gather in enumerate(gathers):
        phase, block = ("forward", k) if k < num_blocks else ("backward", 2 * num_blocks - 1 - k)
        covered_ns = sum(max(0, min(end, gather.end_ns) - max(start, gather.start_ns)) for start, end in busy)
        waits.append((phase, block, (gather.end_ns - gather.start_ns - covered_ns) / 1e6))
    return waits
