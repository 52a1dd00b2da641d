"""A small CNN trained with DDP and SyncBatchNorm, as image-classification scripts do on several GPUs.

With GPUs: two processes, each with half of every batch, BatchNorm converted to SyncBatchNorm so the
statistics cover the whole batch. Without (plain CPU): one process with the whole batch and plain
BatchNorm. The two compute the same thing, so loss, running statistics and weights must agree.
"""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

BATCH, STEPS = 8, 3


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def worker(rank, world, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    model = make_model()
    if use_cuda:
        torch.cuda.set_device(rank)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model.to(device), device_ids=[rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = BATCH // world
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if rank == 0:
        bn = model.module[1]
        print("RESULT " + json.dumps({
            "losses": losses,
            "running_mean": bn.running_mean.cpu().tolist(), "running_var": bn.running_var.cpu().tolist(),
            "batches_tracked": bn.num_batches_tracked.item(),
            "head": model.module[-1].weight.detach().cpu().flatten().tolist(),
            "conv_sum": model.module[0].weight.detach().sum().item(),
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    world = 2 if torch.cuda.device_count() >= 2 else 1
    mp.spawn(worker, args=(world, "29561"), nprocs=world)
