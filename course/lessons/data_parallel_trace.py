"""One nn.DataParallel forward pass of an MLP, shape-only, and its trace: material for reading a timeline and
saying which of DataParallel's four phases (replicate, scatter, parallel_apply, gather) holds the step up.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from course.cuda.emulator import emulate

PHASES = ("replicate", "scatter", "parallel_apply", "gather")


def data_parallel_forward(batch: int, widths, num_gpus: int, link: str = "nvlink3") -> list:
    """The trace events of `nn.DataParallel(mlp)(x)` on `num_gpus` emulated GPUs joined by `link`, from the call
    to the end of the gather. The MLP has `nn.Linear(widths[i], widths[i + 1])` layers with ReLUs between, made
    on cuda:0, and the float32 input `batch x widths[0]` is already there, as in a loop over in-memory data."""
    widths = list(widths)
    if len(widths) < 2 or batch < 1 or num_gpus < 1:
        raise ValueError(f"need a batch of 1 or more, at least two widths and a GPU; got batch={batch}, "
                         f"widths={widths}, num_gpus={num_gpus}")
    with emulate(gpus=num_gpus, link=link, materialize=False, force=True) as emu:
        layers = []
        for width_in, width_out in zip(widths, widths[1:]):
            layers += [nn.Linear(width_in, width_out, device="cuda:0"), nn.ReLU()]
        model = nn.DataParallel(nn.Sequential(*layers[:-1]))
        x = torch.empty(batch, widths[0], device="cuda:0")
        torch.cuda.synchronize()
        start_ns = emu.clock.host_ns
        model(x)
        torch.cuda.synchronize()
        return [e for e in emu.trace if e.start_ns >= start_ns and e.kind != "host"]
