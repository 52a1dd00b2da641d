"""Reference answers for the nn.DataParallel notebook's exercises (hidden from learners; see autograder/README.md)."""
from __future__ import annotations

import torch.nn as nn


def chunk_sizes(batch, num_gpus):
    """Rows per GPU as nn.parallel.scatter (torch.chunk) splits a batch: ceil(batch / num_gpus) each, the last
    one smaller, and fewer chunks than GPUs when the batch runs out first (5 on 4 GPUs: 2, 2, 1)."""
    size = -(-batch // num_gpus)
    sizes, left = [], batch
    while left > 0:
        sizes.append(min(size, left))
        left -= size
    return sizes


def data_parallel(module, input, device_ids, output_device=None):
    """Seed 001's data_parallel(), built from replicate, scatter, parallel_apply and gather."""
    if not device_ids:
        return module(input)
    if output_device is None:
        output_device = device_ids[0]
    replicas = nn.parallel.replicate(module, device_ids)
    inputs = nn.parallel.scatter(input, device_ids)
    replicas = replicas[:len(inputs)]
    outputs = nn.parallel.parallel_apply(replicas, inputs)
    return nn.parallel.gather(outputs, output_device)


def activation_bytes_per_gpu(batch, in_features, out_features, num_gpus):
    """Peak bytes of float32 inputs and outputs each GPU holds in nn.DataParallel(nn.Linear(...)) forward.

    GPU 0 holds the whole input batch, the output of its own chunk and the whole gathered output; GPU i holds
    only its chunk's input and output. With one GPU, DataParallel calls the module directly: no gather.
    """
    if num_gpus == 1:
        return [4 * batch * (in_features + out_features)]
    sizes = chunk_sizes(batch, num_gpus)
    result = [4 * (batch * in_features + sizes[0] * out_features + batch * out_features)]
    result += [4 * rows * (in_features + out_features) for rows in sizes[1:]]
    return result + [0] * (num_gpus - len(result))


def diagnose_data_parallel(events):
    """The phase of a DataParallel forward whose events span the longest (first start to last end), and the
    change that removes it: replicas kept between steps (DDP) for replicate, per-GPU loading for scatter,
    a loss computed on each GPU for gather, more GPUs when the computation itself dominates."""
    marks = {"replicate": lambda e: e.kind == "collective" and e.name == "nccl:broadcast",
             "scatter": lambda e: e.kind == "copy" and e.name.startswith("copy cuda:0->"),
             "parallel_apply": lambda e: e.kind == "kernel",
             "gather": lambda e: e.kind == "copy" and e.name.endswith("->cuda:0")}
    spans = {}
    for phase, belongs in marks.items():
        mine = [e for e in events if belongs(e)]
        spans[phase] = max(e.end_ns for e in mine) - min(e.start_ns for e in mine) if mine else 0
    phase = max(spans, key=spans.get)
    fixes = {"replicate": "ddp", "scatter": "load_per_gpu", "parallel_apply": "more_gpus", "gather": "loss_per_gpu"}
    return phase, fixes[phase]
