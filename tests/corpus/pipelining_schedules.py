"""Pipeline parallelism with torch.distributed.pipelining, as in its tutorial: a model cut into two stages by
hand (PipelineStage), run with GPipe and with 1F1B over four micro-batches; losses and each stage's
gradients are reported.

Run as `torchrun --nproc-per-node=2 pipelining_schedules.py`; started plainly, it launches itself that way.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for i in range(4)})
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


def mse(output, target):
    return ((output - target) ** 2).mean()


def data(device):
    g = torch.Generator().manual_seed(7)
    return torch.randn(16, 16, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)


def manual_stage(rank, world_size, device):
    """Stage 0 keeps layers 0-1, stage 1 layers 2-3 and the head (the others deleted, as the tutorial does)."""
    torch.manual_seed(0)
    model = Net()
    keep = {"0", "1"} if rank == 0 else {"2", "3"}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if rank == 0:
        model.head = None
    model.forward = (lambda x: model.layers["1"](model.layers["0"](x))) if rank == 0 else \
        (lambda x: model.head(model.layers["3"](model.layers["2"](x))))
    return model.to(device), PipelineStage(model.to(device), rank, world_size, device)


def run_schedule(schedule_cls, rank, world_size, device):
    module, stage = manual_stage(rank, world_size, device)
    schedule = schedule_cls(stage, n_microbatches=4, loss_fn=mse)
    x, y = data(device)
    losses = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    grads = {name: p.grad.norm().item() for name, p in module.named_parameters()}
    return {"losses": [loss.item() for loss in losses], "grad_norms": grads}


def main():
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    result = {"gpipe": run_schedule(ScheduleGPipe, rank, world_size, device),
              "1f1b": run_schedule(Schedule1F1B, rank, world_size, device)}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, result)
    if rank == 0:
        print("RESULT " + json.dumps(everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        from torch.distributed.run import main as torchrun

        sys.exit(torchrun(["--nproc-per-node=2", "--master-port=12370", __file__]))
    main()
