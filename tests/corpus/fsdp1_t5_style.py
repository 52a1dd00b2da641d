"""FSDP1 the way pytorch/examples' distributed/FSDP (T5) script trains: torchrun, transformer_auto_wrap_policy on
the transformer block class, MixedPrecision in bf16, activation checkpointing applied to every block with
apply_activation_checkpointing, AdamW with StepLR, and a rank-0 full state dict offloaded to the CPU
(FullStateDictConfig(offload_to_cpu=True, rank0_only=True)) saved with torch.save.

Run as `torchrun --nproc-per-node=2 fsdp1_t5_style.py`; started plainly, it launches itself that way.
"""
import functools
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import (BackwardPrefetch, FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class Seq2SeqToy(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).float().flatten(0, 1), labels.flatten())


def main():
    local_rank, rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(local_rank)
    bf16_ready = on_gpu and torch.cuda.is_bf16_supported() and dist.is_nccl_available()
    print(f"rank {rank}: bf16 ready {bf16_ready}")
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})

    torch.manual_seed(0)
    model = Seq2SeqToy()
    model = FSDP(model, auto_wrap_policy=policy, mixed_precision=mixed,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 device_id=torch.cuda.current_device() if on_gpu else torch.device("cpu"), limit_all_gathers=True)
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.85)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")

    g = torch.Generator().manual_seed(10 + rank)
    history = []
    for epoch in range(2):
        model.train()
        fsdp_loss = torch.zeros(2).to(device)
        for _ in range(2):
            ids = torch.randint(0, 50, (4, 12), generator=g).to(device)
            optimizer.zero_grad()
            loss = model(ids, ids.roll(1, dims=1))
            loss.backward()
            optimizer.step()
            fsdp_loss[0] += loss.item()
            fsdp_loss[1] += 1
        dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
        history.append((fsdp_loss[0] / fsdp_loss[1]).item())
        scheduler.step()

    # plain CPU FSDP1 cannot "offload" parameters that are on the CPU already (setStorage ... out of bounds)
    save_policy = FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
        cpu_state = model.state_dict()
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(cpu_state, os.path.join(tmp, "t5-toy.pt"))
            saved = torch.load(os.path.join(tmp, "t5-toy.pt"))
        print("RESULT " + json.dumps({
            "history": history, "_tolerance": [2e-2, 2e-2],
            "state": {k: [str(v.dtype), str(v.device), list(v.shape), round(v.double().sum().item(), 3)]
                      for k, v in saved.items()}}))
    else:
        assert cpu_state == {}, "rank0_only: other ranks get an empty state dict"
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        main()
    else:
        from torch.distributed.run import main as torchrun
        sys.exit(torchrun(["--nproc-per-node=2", "--master-port=12378", __file__]))
