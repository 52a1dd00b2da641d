"""Two distributed styles from large-model code, under torchrun with 2 ranks: expert parallelism (top-1 routing,
token exchange with torch.distributed.nn's differentiable all_to_all_single and uneven splits) and
torch.distributed.pipelining's tracer front end (`pipe_split()` markers, `pipeline()`, `build_stage` moving the
traced stage to the rank's GPU, ScheduleGPipe).

Run as `torchrun --nproc-per-node=2 moe_and_traced_pipeline.py`; started plainly, it launches itself that way.
"""
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
from torch.distributed.pipelining import ScheduleGPipe, pipe_split, pipeline


def experts(rank, world, device):
    torch.manual_seed(0)
    router = nn.Linear(8, world).to(device)
    expert = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(world)][rank].to(device)
    torch.manual_seed(10 + rank)
    tokens = torch.randn(6, 8, device=device, requires_grad=True)
    choice = router(tokens).argmax(-1)
    order = torch.argsort(choice, stable=True)
    send_counts = torch.bincount(choice, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sent, received = send_counts.tolist(), recv_counts.tolist()
    arrived = dist_fn.all_to_all_single(torch.empty(sum(received), 8, device=device), tokens[order], received, sent)
    returned = dist_fn.all_to_all_single(torch.empty(6, 8, device=device), expert(arrived), sent, received)
    out = torch.empty_like(returned).index_copy(0, order, returned)
    loss = out.pow(2).mean()
    loss.backward()
    expert_grad = torch.cat([p.grad.flatten() for p in expert.parameters()]).sum()
    # numbers and GPU scalars in one list, as metric code builds them
    stats = torch.tensor([loss.item(), float(sum(received)), expert_grad, tokens.grad.sum()], device=device)
    gathered = [torch.zeros(4, device=device) for _ in range(world)]
    dist.all_gather(gathered, stats)
    return [t.tolist() for t in gathered]


class Traced(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.l2(torch.relu(self.l1(x))))
        pipe_split()
        return self.l4(torch.relu(self.l3(x)))


def traced_pipeline(rank, world, device):
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = pipeline(Traced(), mb_args=(x.chunk(4)[0],))
    stage = pipe.build_stage(rank, device)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x.to(device))
        else:
            microbatch_losses = []
            schedule.step(target=y.to(device), losses=microbatch_losses)
            losses.append(sum(l.item() for l in microbatch_losses) / len(microbatch_losses))
        opt.step()
    weight_sum = torch.tensor([sum(p.sum().item() for p in stage.submod.parameters())], device=device)
    weight_sums = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(weight_sums, weight_sum)
    return {"losses": losses, "weight_sums": [t.item() for t in weight_sums], "stages": pipe.num_stages,
            "on_rank_device": next(stage.submod.parameters()).device == device}


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    result = {"experts": experts(rank, world, device), "pipeline": traced_pipeline(rank, world, device)}
    if rank == world - 1:
        print("RESULT " + json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        from torch.distributed.run import main as torchrun
        torchrun(["--nproc-per-node=2", "--master-port=29561", __file__])
    else:
        main()
