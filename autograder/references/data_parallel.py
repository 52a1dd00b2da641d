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
