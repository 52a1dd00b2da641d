"""DDP's constructor options and helpers as training scripts use them, each trained a few steps.

find_unused_parameters, static_graph, gradient_as_bucket_view, an fp16 compression comm hook, no_sync
for gradient accumulation, then the object collectives and a subgroup. Plain CPU (gloo) and emulated
GPUs (nccl) must give the same weights.
"""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

CONFIGS = {
    "plain": ({}, None),
    "find_unused": ({"find_unused_parameters": True}, None),
    "static_graph": ({"static_graph": True}, None),
    "bucket_view": ({"gradient_as_bucket_view": True}, None),
    "fp16_hook": ({}, default_hooks.fp16_compress_hook),
}


def make_model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def train(rank, device, options, hook):
    model = make_model(device)
    ddp = DDP(model, device_ids=[rank] if device.type == "cuda" else None, **options)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        first, second = torch.randn(5, 8).to(device), torch.randn(5, 8).to(device)
        if step > 0:  # static_graph needs one synchronised iteration first
            with ddp.no_sync():  # accumulate locally, all-reduce on the next backward
                ddp(first).pow(2).mean().backward()
        ddp(second).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().cpu().flatten().tolist()[:6] for p in model.parameters()]


@record
def main(rank, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    dist.barrier()
    result = {name: train(rank, device, options, hook) for name, (options, hook) in CONFIGS.items()}

    handle = dist.all_reduce(torch.full((3,), rank + 1.0, device=device), async_op=True)
    handle.wait()
    subgroup = dist.new_group([0, 1])
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones, group=subgroup)
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "device": device.type})
    gathered = [torch.zeros(2, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device=device))
    broadcast = [rank * 10]
    dist.broadcast_object_list(broadcast, src=0)
    if rank == 0:
        result.update(subgroup_sum=ones.item(), objects=[o["rank"] for o in objects],
                      gathered=[g.cpu().tolist() for g in gathered], broadcast=broadcast)
        print("RESULT " + json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2,), nprocs=2)
