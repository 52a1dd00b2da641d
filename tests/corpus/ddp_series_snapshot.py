"""The multi-GPU training series' Trainer: DDP, a DistributedSampler, snapshots saved by rank 0 and resumed.

Trains for 2 epochs, "crashes", restarts from the snapshot (loaded with map_location to each rank's GPU) and
trains 2 more; the result must equal 4 uninterrupted epochs.
"""
import json
import os
import tempfile

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id, snapshot_path):
        self.gpu_id = gpu_id
        self.device = gpu_id if torch.cuda.is_available() else "cpu"
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[gpu_id] if torch.cuda.is_available() else None)

    def _load_snapshot(self, path):
        loc = f"cuda:{self.gpu_id}" if torch.cuda.is_available() else "cpu"
        snapshot = torch.load(path, map_location=loc)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            loss = self._run_batch(source.to(self.device), targets.to(self.device))
        return loss.item()

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs):
        losses = []
        for epoch in range(self.epochs_run, max_epochs):
            losses.append(self._run_epoch(epoch))
            if self.gpu_id == 0:
                self._save_snapshot(epoch)
        return losses


def train_run(rank, max_epochs, snapshot_path, out_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = DataLoader(MyTrainDataset(64), batch_size=8, shuffle=False, sampler=DistributedSampler(MyTrainDataset(64)))
    trainer = Trainer(model, data, optimizer, rank, snapshot_path)
    losses = trainer.train(max_epochs)
    if rank == 0:
        weights = torch.cat([p.detach().flatten().cpu() for p in trainer.model.module.parameters()])
        torch.save({"losses": losses, "weights": weights}, out_path)


def main(rank, world_size, runs, port):
    """Each run is (max_epochs, snapshot_path, out_path): a fresh Trainer, resuming if its snapshot exists."""
    ddp_setup(rank, world_size, port)
    for max_epochs, snapshot_path, out_path in runs:
        train_run(rank, max_epochs, snapshot_path, out_path)
    destroy_process_group()


if __name__ == "__main__":
    world_size = 2
    with tempfile.TemporaryDirectory() as tmp:
        snap, straight = os.path.join(tmp, "snapshot.pt"), os.path.join(tmp, "straight.pt")
        first_out, resumed_out, straight_out = (os.path.join(tmp, f"{n}.pt") for n in ("first", "resumed", "straight_out"))
        # The job "crashes" after 2 epochs (the same processes then train 4 epochs uninterrupted, from scratch);
        # a new job resumes from the snapshot.
        mp.spawn(main, args=(world_size, [(2, snap, first_out), (4, straight, straight_out)], "12365"), nprocs=world_size)
        mp.spawn(main, args=(world_size, [(4, snap, resumed_out)], "12366"), nprocs=world_size)
        first, resumed, uninterrupted = (torch.load(p) for p in (first_out, resumed_out, straight_out))
    print("RESULT " + json.dumps({
        "losses": first["losses"] + resumed["losses"],
        "uninterrupted_losses": uninterrupted["losses"],
        "resume_matches": torch.allclose(resumed["weights"], uninterrupted["weights"], atol=1e-6),
        "weights": resumed["weights"][:16].tolist()}))
