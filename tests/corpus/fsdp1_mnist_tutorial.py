"""FSDP1 the way the FSDP getting-started tutorial writes it: mp.spawn, a small MNIST-shaped CNN wrapped with
FullyShardedDataParallel (default FULL_SHARD) and size_based_auto_wrap_policy, Adadelta with StepLR, a loss summed
with all_reduce, CUDA events around training, and the full state dict saved on rank 0 at the end."""
import functools
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12377"
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def train(model, device, rank, world_size, loader, optimizer, epoch, sampler):
    model.train()
    ddp_loss = torch.zeros(2).to(device)
    sampler.set_epoch(epoch)
    for data, target in loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target, reduction="sum")
        loss.backward()
        optimizer.step()
        ddp_loss[0] += loss.item()
        ddp_loss[1] += len(data)
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    return (ddp_loss[0] / ddp_loss[1]).item()


def test(model, device, loader):
    model.eval()
    ddp_loss = torch.zeros(3).to(device)
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            ddp_loss[0] += F.nll_loss(output, target, reduction="sum").item()
            ddp_loss[1] += output.argmax(dim=1, keepdim=True).eq(target.view_as(output.argmax(dim=1, keepdim=True))).sum().item()
            ddp_loss[2] += len(data)
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    return [(ddp_loss[0] / ddp_loss[2]).item(), (ddp_loss[1] / ddp_loss[2]).item()]


def fsdp_main(rank, world_size, out_dir):
    setup(rank, world_size)
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(48, 1, 16, 16, generator=g), torch.randint(0, 10, (48,), generator=g)
    train_set, test_set = TensorDataset(images[:32], labels[:32]), TensorDataset(images[32:], labels[32:])
    sampler1 = DistributedSampler(train_set, rank=rank, num_replicas=world_size, shuffle=True)
    sampler2 = DistributedSampler(test_set, rank=rank, num_replicas=world_size)
    train_loader = DataLoader(train_set, batch_size=8, sampler=sampler1)
    test_loader = DataLoader(test_set, batch_size=8, sampler=sampler2)
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)

    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        device = rank
    else:
        device = "cpu"
    torch.manual_seed(1)
    model = Net().to(device)
    # FSDP finds the GPU by itself; on a CPU-only build it must be told to use the CPU
    cpu_only = {} if torch.cuda.is_available() else {"device_id": torch.device("cpu")}
    model = FSDP(model, auto_wrap_policy=policy, **cpu_only)
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    if torch.cuda.is_available():
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
    history = []
    for epoch in range(1, 3):
        history.append([train(model, device, rank, world_size, train_loader, optimizer, epoch, sampler1)]
                       + test(model, device, test_loader))
        scheduler.step()
    if torch.cuda.is_available():
        end.record()
        torch.cuda.synchronize()
        elapsed = start.elapsed_time(end)
        assert elapsed > 0
    local_shapes = sorted(list(p.shape) for p in model.parameters())
    dist.barrier()
    states = model.state_dict()
    if rank == 0:
        path = os.path.join(out_dir, "mnist_cnn.pt")
        torch.save(states, path)
        saved = torch.load(path, map_location="cpu")
        print("RESULT " + json.dumps({
            "history": history, "local_shapes": local_shapes,
            "state": {k: [list(v.shape), v.double().sum().item(), v.double().square().sum().item()]
                      for k, v in saved.items()},
            "lr": scheduler.get_last_lr()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(fsdp_main, args=(2, out_dir), nprocs=2, join=True)
