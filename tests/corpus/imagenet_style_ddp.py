"""The shape of an ImageNet-style training script: one process per GPU, `model.cuda(gpu)`, a criterion on
the GPU, DistributedSampler with persistent loader workers and pinned memory, `non_blocking` copies, a StepLR
schedule, accuracy meters all-reduced across ranks, and a checkpoint written by rank 0.
Plain CPU runs the same script with gloo and two CPU processes.
"""
import json
import os
import tempfile

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed

WORLD, EPOCHS, BATCH = 2, 2, 8


def dataset():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 12, 12, generator=g)
    labels = torch.randint(0, 4, (64,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 4))


def accuracy(output, target):
    with torch.no_grad():
        return (output.argmax(1) == target).float().sum()


def main_worker(gpu, ngpus, checkpoint_dir):
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="tcp://127.0.0.1:29581",
                            world_size=ngpus, rank=gpu)
    model = model_fn()
    if use_cuda:
        torch.cuda.set_device(gpu)
        model.cuda(gpu)
        model = nn.parallel.DistributedDataParallel(model, device_ids=[gpu])
        criterion = nn.CrossEntropyLoss().cuda(gpu)
        cudnn.benchmark = True
    else:
        model = nn.parallel.DistributedDataParallel(model)
        criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train_set = dataset()
    sampler = torch.utils.data.distributed.DistributedSampler(train_set, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(train_set, batch_size=BATCH, sampler=sampler, num_workers=1, persistent_workers=True,
                                         pin_memory=use_cuda)
    device = torch.device("cuda", gpu) if use_cuda else torch.device("cpu")
    history = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        totals = torch.zeros(3, dtype=torch.float32, device=device)  # loss sum, correct, count
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            totals += torch.stack([loss.detach() * images.size(0), accuracy(output, target),
                                   torch.tensor(float(images.size(0)), device=device)])
        dist.all_reduce(totals, dist.ReduceOp.SUM, async_op=False)
        scheduler.step()
        history.append({"loss": (totals[0] / totals[2]).item(), "acc": (totals[1] / totals[2]).item(),
                        "lr": scheduler.get_last_lr()[0]})
        if gpu == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(checkpoint_dir, "checkpoint.pth.tar"))
    dist.barrier()
    if gpu == 0:
        saved = torch.load(os.path.join(checkpoint_dir, "checkpoint.pth.tar"), map_location="cpu")
        print("RESULT " + json.dumps({"history": history, "epoch": saved["epoch"],
                                      "fc": saved["state_dict"]["module.7.weight"].flatten().tolist()[:16]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(main_worker, nprocs=WORLD, args=(WORLD, tmp))
