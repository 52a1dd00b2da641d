"""FSDP2 beyond the basic tutorial, under torchrun with 2 ranks: fully_shard with reshard_after_forward=False on
the blocks, gradient accumulation with set_requires_gradient_sync(False) on the micro-steps and True on the last,
a second model with CPUOffloadPolicy (sharded parameters and the optimizer step on the host), and the full state
dict gathered with get_model_state_dict(StateDictOptions(full_state_dict=True, cpu_offload=True)). The plain run
trains the same models on one process with the ranks' micro-batches concatenated."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

WORLD = 2


def make(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def batches(rank_count, rank):
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(4 * WORLD, 8, generator=g), torch.randn(4 * WORLD, 4, generator=g)
        if rank_count == 1:
            yield x, y
        else:
            yield x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]


def train(model, opt, device, rank_count, rank, accumulate):
    losses = []
    for i, (x, y) in enumerate(batches(rank_count, rank)):
        last = i == 2
        if accumulate and rank_count > 1:
            model.set_requires_gradient_sync(last)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device)) / 3
        loss.backward()
        losses.append(loss.item())
        if not accumulate:
            opt.step()
            opt.zero_grad()
    if accumulate:
        opt.step()
        opt.zero_grad()
    return losses


def main():
    distributed = "LOCAL_RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if distributed:
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo")
    count = WORLD if distributed else 1

    model = make(0).to(device)
    if distributed:
        for layer in (model[0], model[2]):
            fully_shard(layer, reshard_after_forward=False)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = {"accum_losses": train(model, opt, device, count, rank, accumulate=True)}

    offloaded = make(1)
    if distributed:
        fully_shard(offloaded, offload_policy=CPUOffloadPolicy())
    else:
        offloaded = offloaded.to(device)
    opt2 = torch.optim.Adam(offloaded.parameters(), lr=0.01)
    res["offload_losses"] = train(offloaded, opt2, device, count, rank, accumulate=False)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=opts) if distributed else model.state_dict()
    full2 = get_model_state_dict(offloaded, options=opts) if distributed else offloaded.state_dict()
    if rank == 0:
        res["weights"] = {k: round(v.sum().item(), 5) for k, v in full.items()}
        res["offload_weights"] = {k: round(v.sum().item(), 5) for k, v in full2.items()}
        res["state_on_cpu"] = all(v.device.type == "cpu" for v in full.values())
    if distributed:  # each rank's losses are over half the batch: the mean over ranks is the whole batch's
        for key in ("accum_losses", "offload_losses"):
            t = torch.tensor(res[key], device=device)
            dist.all_reduce(t)
            res[key] = (t / WORLD).tolist()
        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ and torch.cuda.is_available():
        from torch.distributed.run import main as torchrun

        sys.exit(torchrun([f"--nproc-per-node={WORLD}", "--master-port=12383", __file__]))
    main()
