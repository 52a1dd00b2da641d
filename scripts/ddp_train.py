"""A minimal DistributedDataParallel training script, launched by torchrun, the same on a laptop and a cluster.

A small MLP learns a fixed random regression task. Each rank reads its share of every batch through a
DistributedSampler; at the end rank 0 prints a checksum of the parameters, which equals that of one
process training on the concatenated batches (`python scripts/ddp_train.py --world-size-1-reference 2`).

    # this CPU: 2 processes, gloo
    torchrun --nproc-per-node=2 scripts/ddp_train.py
    # one machine with 8 GPUs: NCCL, rank i on cuda:i, nothing to change
    torchrun --nproc-per-node=8 scripts/ddp_train.py
    # two machines with 8 GPUs each; run on both, node-rank 0 on HOST, PORT open on HOST
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST --master-port=PORT --nproc-per-node=8 scripts/ddp_train.py
    torchrun --nnodes=2 --node-rank=1 --master-addr=HOST --master-port=PORT --nproc-per-node=8 scripts/ddp_train.py

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process it starts.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 0
NUM_SAMPLES = 96
NUM_FEATURES = 16


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=generator)
    targets = inputs @ torch.randn(NUM_FEATURES, 1, generator=generator) + 0.1
    return TensorDataset(inputs, targets)


def make_model() -> nn.Module:
    """Seeded, so every rank starts from the same weights (DDP also broadcasts rank 0's to be sure)."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))


def make_sampler(dataset, world_size: int, rank: int) -> DistributedSampler:
    """Rank `rank`'s share of every epoch; all ranks shuffle with the same seed, so shares never overlap."""
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)


def checksum(model: nn.Module) -> float:
    return sum(p.detach().double().sum().item() for p in model.parameters())


def train(epochs: int, batch_size: int, lr: float) -> None:
    """One rank of the job: join the process group torchrun describes, train, and report."""
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    model = DistributedDataParallel(make_model().to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dataset = make_dataset()
    sampler = make_sampler(dataset, world_size, rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for step, (inputs, targets) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.mse_loss(model(inputs.to(device)), targets.to(device))
            loss.backward()  # DDP averages the gradients over all ranks here
            optimizer.step()
            print(f"rank {rank}/{world_size} epoch {epoch} step {step} loss {loss.item():.6f}", flush=True)
    if rank == 0:
        print(f"checksum {checksum(model.module):.10f}", flush=True)
    dist.destroy_process_group()


def train_single_process(world_size: int, epochs: int, batch_size: int, lr: float) -> float:
    """The reference: one process, each step on every rank's batch concatenated; returns the checksum."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dataset = make_dataset()
    samplers = [make_sampler(dataset, world_size, rank) for rank in range(world_size)]
    for epoch in range(epochs):
        loaders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            loaders.append(DataLoader(dataset, batch_size=batch_size, sampler=sampler))
        for rank_batches in zip(*loaders):
            inputs = torch.cat([inputs for inputs, _ in rank_batches])
            targets = torch.cat([targets for _, targets in rank_batches])
            optimizer.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            optimizer.step()
    return checksum(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--world-size-1-reference", type=int, metavar="WORLD_SIZE",
                        help="no torchrun: train in one process on what WORLD_SIZE ranks would see together")
    args = parser.parse_args()
    if args.world_size_1_reference:
        value = train_single_process(args.world_size_1_reference, args.epochs, args.batch_size, args.lr)
        print(f"checksum {value:.10f}")
    elif "RANK" not in os.environ:
        parser.error("start it with torchrun, e.g. `torchrun --nproc-per-node=2 scripts/ddp_train.py`, "
                     "or pass --world-size-1-reference 2 for the single-process reference")
    else:
        train(args.epochs, args.batch_size, args.lr)


if __name__ == "__main__":
    main()
