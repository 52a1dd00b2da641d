"""Hogwild-style training in the manner of the multiprocessing examples: the model's parameters are shared
(`model.share_memory()`), worker processes train them in place, and the parent sees every update. On a GPU the
workers must be spawned, and the parameters travel by CUDA IPC, not by copy. A tensor put on a queue is shared
the same way: the worker's in-place change shows in the parent.

The workers run one after another, so that the numbers do not depend on how the processes interleave.
"""
import json

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def train(rank, model, device, steps, queue, done):
    if rank == 1:  # the last worker also takes a tensor off the queue and changes it in place
        tensor = queue.get()
        tensor.mul_(3)
        done.put(str(tensor.device))
    torch.manual_seed(100 + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    for _ in range(steps):
        x, y = torch.randn(16, 10, device=device), torch.randint(0, 3, (16,), device=device)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


if __name__ == "__main__":
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    context = mp.get_context("spawn" if use_cuda else "fork")
    torch.manual_seed(0)
    model = nn.Linear(10, 3).to(device)
    model.share_memory()
    before = model.weight.detach().clone()
    # SimpleQueue: a Queue's feeder thread, forked while it holds a lock, can leave the forked worker blocked on it.
    queue, done = context.SimpleQueue(), context.SimpleQueue()
    shared = torch.arange(4.0, device=device)
    queue.put(shared)
    exit_codes = []
    for rank in range(2):
        worker = context.Process(target=train, args=(rank, model, device, 4, queue, done))
        worker.start()
        worker.join()
        exit_codes.append(worker.exitcode)
    seen_on = done.get()

    print("RESULT " + json.dumps({
        "exit_codes": exit_codes,
        "weight_sum": model.weight.sum().item(),
        "moved": (model.weight.detach() - before).abs().sum().item(),
        "queued_tensor_after_worker": shared.tolist(),
        "worker_saw_device_type": seen_on.split(":")[0] == device.type,
    }))
