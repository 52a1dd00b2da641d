"""The housekeeping most training repos carry: seed everything, save resumable checkpoints with the RNG
states in them, evaluate with MC-dropout inside fork_rng so training's random stream is untouched, and log
GPU memory (stats, peaks, the summary table) when there is a GPU.

A resumed run must repeat the original run's losses exactly, and the evaluation must not shift the stream.
"""
import io
import json
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def memory_report(tag):
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    report = {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated(),
              "reserved": torch.cuda.memory_reserved(), "allocs": stats["allocation.all.current"],
              "ooms": stats["num_ooms"]}
    print(f"[{tag}] " + ", ".join(f"{k}={v}" for k, v in report.items()))
    return report


class MLP(nn.Module):
    def __init__(self, width=64, p=0.2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Dropout(p),
                                 nn.Linear(width, width), nn.GELU(), nn.Dropout(p), nn.Linear(width, 3))

    def forward(self, x):
        return self.net(x)


def batches(step, gen):
    # data from a seeded generator on the training device, the way synthetic benchmarks make it
    x = torch.randn(32, 16, device=device, generator=gen)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def train(model, opt, gen, steps):
    model.train()
    losses = []
    for step in range(steps):
        x, y = batches(step, gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def mc_dropout_eval(model, x, samples=8):
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(1234)
        model.train()
        probs = torch.stack([model(x).softmax(-1) for _ in range(samples)])
    return probs.mean(0), probs.std(0)


def main():
    result = {}
    set_seed(0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    model = MLP().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator(device=device)
    gen.manual_seed(42)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result["num_params"] = sum(p.numel() for p in model.parameters())
    result["warmup_losses"] = train(model, opt, gen, 4)

    mem = memory_report("after warmup")
    # AdamW keeps two moments per parameter: at least 3x the parameter bytes stay allocated
    result["memory_accounts_for_adam_state"] = mem is None or (
        mem["allocated"] - before >= 3 * param_bytes and mem["peak"] >= mem["allocated"] and mem["ooms"] == 0)
    if torch.cuda.is_available():
        summary = torch.cuda.memory_summary(abbreviated=True)
        print(summary)
        result["summary_has_table"] = "Allocated memory" in summary
    else:
        result["summary_has_table"] = True

    # checkpoint everything a resume needs, RNG included, as a resumable trainer does
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(),
                "data_rng": gen.get_state()}, buffer)

    probe = torch.get_rng_state()
    x_eval, _ = batches(0, torch.Generator(device=device).manual_seed(7))
    mean, std = mc_dropout_eval(model, x_eval)
    result["eval_left_rng_alone"] = torch.equal(probe, torch.get_rng_state())
    result["mc_dropout_mean_std"] = [mean[:, 0].sum().item(), std.mean().item()]

    result["continued_losses"] = train(model, opt, gen, 4)

    # resume in a "new process": fresh objects, state from the checkpoint
    buffer.seek(0)
    ckpt = torch.load(buffer, map_location="cpu", weights_only=False)  # RNG states must be CPU tensors
    set_seed(999)  # whatever the new process did before loading must not matter
    resumed = MLP().to(device)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=3e-3, weight_decay=0.01)
    resumed_opt.load_state_dict(ckpt["optimizer"])
    load_rng_state(ckpt["rng"])
    resumed_gen = torch.Generator(device=device)
    resumed_gen.set_state(ckpt["data_rng"])
    resumed_losses = train(resumed, resumed_opt, resumed_gen, 4)
    result["resume_reproduces"] = resumed_losses == result["continued_losses"]
    result["weights_match"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))

    # legacy tensor construction still seen in older repos
    template = next(model.parameters())
    result["new_tensor"] = template.new([1.0, 2.0]).tolist()
    result["new_on_model_device"] = template.new(2, 3).device == template.device
    memory_report("end")
    return result


if __name__ == "__main__":
    print("RESULT", json.dumps(main()))
