"""A torchrun-launched DDP script (env:// rendezvous, LOCAL_RANK, set_device), as training scripts are written.

Run as `torchrun --nproc-per-node=2 ddp_torchrun.py`; started plainly, it launches itself that way.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group(backend="nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    rank = dist.get_rank()

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=8, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    history = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        history.append(total.item() / dist.get_world_size())
    weights = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    if rank == 0:
        print("RESULT " + json.dumps({"epoch_mean_loss": history, "weights": weights.cpu().tolist()[:32],
                                      "weight_norm": weights.norm().item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        from torch.distributed.run import main as torchrun

        sys.exit(torchrun(["--nproc-per-node=2", "--master-port=12362", __file__]))
    main()
