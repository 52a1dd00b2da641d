"""DDP's extras and collectives inside models, as the examples and contrastive / mixture-of-experts code write them.

ZeroRedundancyOptimizer under the Join context with uneven inputs (rank 1 has two more batches), the PowerSGD comm
hook (plain all-reduce for two steps, then rank-1 compression with error feedback), find_unused_parameters,
static_graph, and the DDP tutorial's model parallelism (each rank's model on two GPUs, device_ids unset); then SimCLR-style embeddings gathered with gradients (torch.distributed.nn), a mixture-of-experts
dispatch with all_to_all_single and uneven splits, an all-reduce on a side stream, and CPU tensors on the mixed
"cpu:gloo,cuda:nccl" backend. Plain CPU (gloo) and emulated GPUs (nccl) must give the same numbers.
"""
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.nn as distnn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)


def batches(rank, n):
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


class TwoDevices(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second
        torch.manual_seed(2)
        self.net1, self.net2 = nn.Linear(16, 16).to(first), nn.Linear(16, 4).to(second)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x.to(self.first))).to(self.second))


def sums(module):
    return [p.detach().sum().item() for p in module.parameters()]


def ddp_extras(rank, device, ids):
    out = {}
    ddp = DDP(mlp(device), device_ids=ids)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    with Join([ddp, zero]):
        for x in batches(rank, 3 + 2 * rank):
            ddp(x.to(device)).pow(2).mean().backward()
            zero.step()
            zero.zero_grad()
    out["zero_join"] = sums(ddp)

    ddp = DDP(mlp(device), device_ids=ids)
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                   min_compression_rate=0.5, use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x in batches(rank, 4):
        ddp(x.to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out["powersgd"] = sums(ddp)

    for name, options, use_b in [("find_unused", {"find_unused_parameters": True}, lambda i: i % 2 == 0),
                                 ("static_graph", {"static_graph": True}, lambda i: False)]:
        torch.manual_seed(1)
        ddp = DDP(Branchy().to(device), device_ids=ids, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for i, x in enumerate(batches(rank, 4)):
            ddp(x.to(device), use_b=use_b(i)).sum().backward()
            opt.step()
            opt.zero_grad()
        out[name] = sums(ddp)

    cuda = device.type == "cuda"
    ddp = DDP(TwoDevices(2 * rank if cuda else "cpu", 2 * rank + 1 if cuda else "cpu"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x in batches(rank, 3):
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out["model_parallel"] = sums(ddp)
    return out


def collectives_in_models(rank, world, device):
    out = {}
    torch.manual_seed(0)
    encoder = nn.Linear(8, 4).to(device)
    torch.manual_seed(1 + rank)
    z1 = F.normalize(encoder(torch.randn(3, 8, device=device)), dim=1)
    z2 = F.normalize(encoder(torch.randn(3, 8, device=device)), dim=1)
    everyone = torch.cat(distnn.functional.all_gather(z2), dim=0)  # gradients flow back to every rank's z2
    loss = F.cross_entropy(z1 @ everyone.T / 0.1, torch.arange(3, device=device) + 3 * rank)
    loss.backward()
    out["contrastive_loss"] = loss.item()
    out["encoder_grad"] = encoder.weight.grad.flatten().tolist()

    send_splits, recv_splits = [rank + 1] * world, [peer + 1 for peer in range(world)]
    tokens = torch.arange(sum(send_splits) * 2, dtype=torch.float32, device=device).reshape(-1, 2) + 100 * rank
    received = torch.empty(sum(recv_splits), 2, device=device)
    dist.all_to_all_single(received, tokens, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    out["moe_received"] = received.tolist()

    t = torch.full((4,), float(rank + 1), device=device)
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            work = dist.all_reduce(t, async_op=True)
        work.wait()
        torch.cuda.current_stream().wait_stream(side)
    else:
        dist.all_reduce(t)
    out["side_stream"] = (t * 2).tolist()

    host = torch.tensor([rank + 1.0])  # a CPU tensor: gloo's half of the mixed backend
    dist.all_reduce(host, group=dist.new_group([1, 0]))
    out["host_all_reduce"] = host.tolist()
    return out


def run(rank, world):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "12371"
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    out = ddp_extras(rank, device, [rank] if cuda else None)
    out.update(collectives_in_models(rank, world, device))
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        print("RESULT " + json.dumps(everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
