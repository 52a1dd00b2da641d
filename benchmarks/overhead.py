"""Wall-time cost of the emulator: a small training loop under `course.emulate` vs plain CPU PyTorch.

Prints the median ratio over alternating runs (A B A B ...), since this machine is shared and noisy.
Target from the course design: 1.25x or less.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

import course

WIDTH, BATCH, STEPS, LAYERS, REPEATS = 1024, 256, 20, 4, 5


def train(device: str) -> float:
    """Seconds of wall time for STEPS SGD steps of a LAYERS-deep MLP on `device`."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH, device=device)
    y = torch.randn(BATCH, WIDTH, device=device)
    start = time.perf_counter()
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    loss.item()
    return time.perf_counter() - start


def emulated() -> float:
    with course.emulate(gpus=1):
        return train("cuda")


def main() -> None:
    torch.set_num_threads(torch.get_num_threads())
    train("cpu"), emulated()  # warm up both paths once
    plain, emul = [], []
    for _ in range(REPEATS):
        plain.append(train("cpu"))
        emul.append(emulated())
    ratios = [e / p for e, p in zip(emul, plain)]
    print(f"plain CPU torch : median {statistics.median(plain) * 1e3:8.1f} ms for {STEPS} steps")
    print(f"under emulator  : median {statistics.median(emul) * 1e3:8.1f} ms for {STEPS} steps")
    print(f"overhead ratio  : median {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}x, max {max(ratios):.3f}x; target <= 1.25x)")


if __name__ == "__main__":
    main()
