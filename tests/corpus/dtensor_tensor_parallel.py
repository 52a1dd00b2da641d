"""Tensor parallelism with DTensor, as in the TP tutorial: a 2-layer MLP split Megatron-style over a 1-D device
mesh (first Linear column-wise, second row-wise), trained with SGD, the sharded weights gathered at the end.
"""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class FeedForward(nn.Module):
    def __init__(self, dim=16, hidden=64):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def worker(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "12369"
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    device_type = "cuda" if use_cuda else "cpu"
    tp_mesh = init_device_mesh(device_type, (world_size,))

    torch.manual_seed(0)
    model = FeedForward().to(device_type)
    model = parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(1)  # the same batch on every rank, as TP requires
    losses = []
    for _ in range(4):
        x = torch.randn(8, 16, device=device_type)
        target = torch.randn(8, 16, device=device_type)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    # A DTensor made from a plain tensor, redistributed and gathered back.
    plain = torch.arange(32, dtype=torch.float32, device=device_type).reshape(8, 4)
    sharded = distribute_tensor(plain, tp_mesh, [Shard(0)])
    local_rows = sharded.to_local().shape[0]
    regathered = sharded.redistribute(tp_mesh, [Shard(1)]).full_tensor()

    weights = {name: p.full_tensor() for name, p in model.named_parameters()}
    placements = {name: str(p.placements) for name, p in model.named_parameters()}
    if rank == 0:
        print("RESULT " + json.dumps({
            "losses": losses,
            "placements": placements,
            "weight_sums": {k: v.sum().item() for k, v in weights.items()},
            "w2_row0": weights["w2.weight"][0].tolist(),
            "local_rows": local_rows,
            "regathered_equal": bool(torch.equal(regathered.cpu(), plain.cpu())),
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2, join=True)
