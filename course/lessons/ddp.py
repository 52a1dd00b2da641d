"""Data-parallel training with real torch.distributed: by hand and with DistributedDataParallel.

The DDP notebook runs `train_data_parallel` on every rank (through `run_threads` or `run_processes`)
and checks it against `train_single_process`, one process training on all ranks' data at once.
`simulate_ddp_step` and `ddp_scaling` time a DDP step on emulated GPUs (see course/lessons/ddp_timing.py).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from course.lessons.ddp_timing import DDPStep, ddp_scaling, simulate_ddp_step
from course.lessons.ranks import RankFailed, default_backend, free_port, run_processes, run_threads

__all__ = ["average_gradients", "train_data_parallel", "train_single_process", "run_threads",
           "run_processes", "default_backend", "free_port", "RankFailed", "simulate_ddp_step",
           "ddp_scaling", "DDPStep"]

def average_gradients(model: torch.nn.Module) -> None:
    """What DDP does after backward, written out: sum each gradient over all ranks, divide by their number.

    Every rank then holds the gradient of the mean loss over the whole global batch, so identical
    replicas take identical optimizer steps and stay identical.
    """
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= world_size


def train_data_parallel(rank: int, world_size: int, make_model, rank_batches, lr: float = 0.1,
                        hand_written: bool | Callable[[torch.nn.Module], None] = False,
                        **ddp_options) -> dict[str, torch.Tensor]:
    """SGD on this rank's batches, gradients averaged over ranks; returns the final parameters.

    `make_model()` must give every rank the same initial weights (seed it). `rank_batches[r]` is the
    list of (inputs, targets) rank r trains on; ranks may have different numbers of batches: DDP's
    `join()` lets ranks that run out shadow the others' all-reduces, as PyTorch documents for uneven
    inputs. `hand_written=True` uses `average_gradients` instead of DDP; `hand_written=fn` calls `fn(model)`
    after every backward instead (one's own averaging, to compare). `ddp_options` go to
    DistributedDataParallel (e.g. `find_unused_parameters=True`).
    """
    model = make_model()
    if hand_written:
        if len({len(batches) for batches in rank_batches}) > 1:
            raise ValueError("average_gradients needs the same number of batches on every rank (its "
                             "all_reduce would wait forever for a rank that has stopped); use DDP with join().")
        replica, joined = model, contextlib.nullcontext()
        average = hand_written if callable(hand_written) else average_gradients
    else:
        model = DistributedDataParallel(model, **ddp_options)
        replica, joined = model.module, model.join()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with joined:
        for inputs, targets in rank_batches[rank]:
            optimizer.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            if hand_written:
                average(model)
            optimizer.step()
    return {name: value.detach().clone() for name, value in replica.state_dict().items()}


def train_single_process(make_model, rank_batches, lr: float = 0.1) -> dict[str, torch.Tensor]:
    """The reference: one process, one model, each step on all ranks' batches concatenated.

    The loss is the mean over the concatenated batch, scaled by the fraction of ranks that still had
    data at that step: a rank that has joined contributes zero gradient while DDP still divides by
    the initial world size. With even inputs the factor is 1: plain training on the global batch.
    """
    world_size = len(rank_batches)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(max(len(batches) for batches in rank_batches)):
        present = [batches[step] for batches in rank_batches if step < len(batches)]
        if len({len(inputs) for inputs, _ in present}) > 1:
            raise ValueError("train_single_process compares with DDP only when the ranks' batches at a "
                             "step have the same size: DDP averages per-rank means, not samples.")
        inputs = torch.cat([inputs for inputs, _ in present])
        targets = torch.cat([targets for _, targets in present])
        optimizer.zero_grad()
        (F.mse_loss(model(inputs), targets) * len(present) / world_size).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}
