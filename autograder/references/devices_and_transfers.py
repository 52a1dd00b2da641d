"""Reference answers for chapter 1, "Devices, transfers and asynchronous execution" (hidden from learners)."""
from __future__ import annotations

import torch
import torch.nn as nn

import course
from course.lessons.timing import gpu_time_ms


def time_on_gpu(fn, *args) -> float:
    """Milliseconds of GPU time fn(*args) takes on the current device: events, with a synchronise on each side."""
    return gpu_time_ms(fn, *args)[0]


def move_batch(batch: dict, device) -> dict:
    """Every tensor of batch on device: non-blocking (the host goes on for pinned tensors), and nothing pinned
    on the host (`pin_memory()` per batch is a host copy of the whole batch; the DataLoader's thread pins)."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def effective_bandwidth_gbps(nbytes: int, ms: float) -> float:
    """Bytes per nanosecond, which is GB/s (1 GB = 1e9 bytes)."""
    return nbytes / (ms * 1e6)


def pinned_copy_ms(nbytes: int, host_link: str = "pcie4") -> float:
    """Simulated ms of one pinned host-to-GPU copy of nbytes, measured with CUDA events."""
    with course.emulate(force=True, gpus=1, host_link=host_link, materialize=False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return time_on_gpu(lambda: host.to("cuda:0", non_blocking=True))


class DistributedModel(nn.Module):
    """Seed 001's model: an embedding on the CPU, a linear layer on cuda:0."""

    def __init__(self, num_embeddings=1000, embedding_dim=10, out_features=10):
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, embedding_dim)
        self.rnn = nn.Linear(embedding_dim, out_features).cuda(0)

    def forward(self, x):
        return self.rnn(self.embedding(x).cuda(0))


def fast_train(model, optimizer, batches) -> list[float]:
    """slow_train's training, fixed: batch i+1 is copied on a side stream while cuda:0 computes step i
    (non-blocking from the loader's pinned memory, so the host does not wait), the compute stream waits for
    the copy before it reads the batch, and the losses stay on the GPU until one `.tolist()` at the end."""
    compute_stream = torch.cuda.current_stream(0)
    copy_stream = torch.cuda.Stream(0)

    def prefetch(batch):
        with torch.cuda.stream(copy_stream):
            return [tensor.to("cuda:0", non_blocking=True) for tensor in batch]

    losses = []
    next_batch = prefetch(batches[0])
    for step in range(len(batches)):
        compute_stream.wait_stream(copy_stream)
        x, y = next_batch
        for tensor in next_batch:  # allocated on the copy stream, read on the compute stream
            tensor.record_stream(compute_stream)
        if step + 1 < len(batches):
            next_batch = prefetch(batches[step + 1])
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses).tolist()
