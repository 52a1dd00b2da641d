"""Reference answers for the distributed-data-parallel notebook (chapter 6; hidden from learners, see autograder/README.md).

Also the harnesses its hidden tests use: a ring of mailboxes that runs a ring all-reduce in threads
(the threaded process group has no send/recv), and a by-hand data-parallel training loop.
"""
from __future__ import annotations

import copy
import math
import queue
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.ddp_timing import simulate_ddp_step


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


def run_ring(fn, tensors, timeout_s: float = 10.0):
    """Run `fn(tensors[rank], rank, n, exchange)` in one thread per rank; returns the message log.

    Messages go through one queue per rank, so sending never blocks. The log holds, per rank, the
    number of elements of each chunk it sent, in order.
    """
    world_size = len(tensors)
    mailboxes = [queue.Queue() for _ in range(world_size)]
    sent = [[] for _ in range(world_size)]
    errors = []

    def worker(rank):
        def exchange(send_chunk, receive_into):
            sent[rank].append(send_chunk.numel())
            mailboxes[(rank + 1) % world_size].put(send_chunk.detach().clone())
            try:
                message = mailboxes[rank].get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"rank {rank} waited {timeout_s} s for rank {(rank - 1) % world_size}") from None
            receive_into.copy_(message)

        try:
            fn(tensors[rank], rank, world_size, exchange)
        except BaseException as error:  # noqa: BLE001 - reported to the caller below
            errors.append((rank, error))

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s * 4 * max(1, world_size))
    if errors:
        rank, error = errors[0]
        raise AssertionError(f"rank {rank} of {world_size} failed: {type(error).__name__}: {error}") from error
    return sent


def train_by_hand(rank: int, world_size: int, base_model, rank_batches, average, lr: float = 0.1):
    """SGD on this rank's batches with `average(model)` after every backward; returns the final parameters."""
    model = copy.deepcopy(base_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for inputs, targets in rank_batches[rank]:
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        average(model)
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def strong_scaling(make_model, global_batch: int, num_features: int, gpu_counts, link: str = "nvlink3",
                   gpu: str = "A100-80GB") -> list[dict]:
    """Strong scaling of DDP: the global batch stays fixed and is split over the GPUs.

    The largest share, ceil(global_batch / n), sets every step's pace (the others wait for it in the
    all-reduce). One row per GPU count: gpus, per_gpu_batch, step_ms, speedup over one GPU, efficiency.
    """
    rows = []
    for num_gpus in gpu_counts:
        per_gpu = math.ceil(global_batch / num_gpus)
        step = simulate_ddp_step(make_model, (per_gpu, num_features), num_gpus, gpu=gpu, link=link)
        rows.append({"gpus": num_gpus, "per_gpu_batch": per_gpu, "step_ms": step.step_ms})
    one_gpu_ms = simulate_ddp_step(make_model, (global_batch, num_features), 1, gpu=gpu, link=link).step_ms
    for row in rows:
        row["speedup"] = one_gpu_ms / row["step_ms"]
        row["efficiency"] = row["speedup"] / row["gpus"]
    return rows
