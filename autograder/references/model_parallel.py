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


def balance_stages(layer_ms, layer_bytes, num_gpus, capacity_bytes):
    """Consecutive layers on at most num_gpus GPUs, each GPU's bytes within capacity_bytes, the slowest stage's time
    as small as possible; ValueError if no placement fits.

    Dynamic programming over prefixes: best[k][j] is the smallest slowest-stage time for the first j layers on k
    GPUs, each GPU non-empty.
    """
    n = len(layer_ms)
    if len(layer_bytes) != n:
        raise ValueError(f"{n} layer times but {len(layer_bytes)} layer sizes: give one of each per layer")
    if n == 0 or num_gpus < 1:
        raise ValueError(f"need at least one layer and one GPU; got {n} layers and {num_gpus} GPUs")
    time_prefix, bytes_prefix = [0.0], [0]
    for ms, nbytes in zip(layer_ms, layer_bytes):
        time_prefix.append(time_prefix[-1] + ms)
        bytes_prefix.append(bytes_prefix[-1] + nbytes)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_gpus + 1)]
    cut = [[0] * (n + 1) for _ in range(num_gpus + 1)]
    best[0][0] = 0.0
    for k in range(1, num_gpus + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or bytes_prefix[j] - bytes_prefix[i] > capacity_bytes:
                    continue
                slowest = max(best[k - 1][i], time_prefix[j] - time_prefix[i])
                if slowest < best[k][j]:
                    best[k][j], cut[k][j] = slowest, i
    gpus = min(range(1, num_gpus + 1), key=lambda k: (best[k][n], k))
    if best[gpus][n] == inf:
        raise ValueError(f"the {n} layers ({bytes_prefix[n]} bytes) cannot be split into consecutive stages on "
                         f"{num_gpus} GPUs of {capacity_bytes} bytes each")
    placement, j = [0] * n, n
    for k in range(gpus, 0, -1):
        i = cut[k][j]
        placement[i:j] = [k - 1] * (j - i)
        j = i
    return placement
