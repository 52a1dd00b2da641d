"""DDP the way the introductory tutorial does it: mp.spawn, a toy model, one optimizer step per rank."""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12361"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        # all_gather_object below puts its tensors on the current device: cuda:0 in every rank without this,
        # which NCCL refuses ("Duplicate GPU detected") or, after DDP's collectives on cuda:rank, hangs on
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    setup(rank, world_size)
    device = rank if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[rank] if torch.cuda.is_available() else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    torch.manual_seed(100 + rank)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10).to(device))
        labels = torch.randn(20, 5).to(device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    summed = [p.detach().sum().item() for p in ddp_model.parameters()]
    all_losses = [None] * world_size
    dist.all_gather_object(all_losses, losses)
    if rank == 0:
        print("RESULT " + json.dumps({"losses": all_losses, "param_sums": summed,
                                      "backend_is_default": dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")}))
    cleanup()


if __name__ == "__main__":
    world_size = 2
    mp.spawn(demo_basic, args=(world_size,), nprocs=world_size, join=True)
