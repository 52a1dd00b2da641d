"""Reference answers for the model-parallelism chapter's exercises (hidden from learners; see autograder/README.md)."""
from __future__ import annotations

import torch


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a stage's parameters live."""
    return next(module.parameters()).device


def two_stage_forward(x, stage1, stage2):
    """x through stage1 on its GPU, the activation moved once to stage2's GPU, through stage2."""
    hidden = stage1(x.to(device_of(stage1)))
    return stage2(hidden.to(device_of(stage2)))


def pipelined_forward(x, stage1, stage2, micro_batches):
    """GPipe forward: split the batch with tensor_split, issue every micro-batch stage by stage, concatenate."""
    first, second = device_of(stage1), device_of(stage2)
    outputs = [stage2(stage1(chunk.to(first)).to(second)) for chunk in x.tensor_split(micro_batches)]
    return torch.cat(outputs)


def bubble_fraction(stages, micro_batches):
    """Idle share of the GPipe schedule: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def place_layers(layer_bytes, capacity_bytes, num_gpus):
    """Greedy: fill GPU 0 with consecutive layers while they fit, then GPU 1, ...; ValueError if impossible."""
    placement, device, used = [], 0, 0
    for index, nbytes in enumerate(layer_bytes):
        if nbytes > capacity_bytes:
            raise ValueError(f"layer {index} alone needs {nbytes} bytes, more than one GPU's {capacity_bytes}")
        if used + nbytes > capacity_bytes:
            device, used = device + 1, 0
        if device >= num_gpus:
            raise ValueError(f"layer {index} does not fit: {num_gpus} GPUs are full")
        placement.append(device)
        used += nbytes
    return placement
