"""The environment an emulated machine reads and writes: COURSE_EMULATE, and CUDA_VISIBLE_DEVICES.

A running emulator publishes its machine in COURSE_EMULATE for the processes it starts: mp.spawn's workers,
torchrun's ranks and run_processes' children read it at start-up (course/autostart.py) and start the same
emulated machine, so a worker's `torch.cuda` sees the same GPUs as its parent's. Each process then sees the GPUs
CUDA_VISIBLE_DEVICES names, as on a real box, once the program or a launcher has set it: the value it had when the
emulator started describes the real machine the course runs on (a cluster's GPU allocation, say), not the emulated
one `--gpus` asked for, and is passed on to workers as such.
"""
from __future__ import annotations

import json
import os

import torch

ENV = "COURSE_EMULATE"


def publish(config: dict | None) -> str | None:
    """Set COURSE_EMULATE for child processes; returns the value it replaced, to restore on stop."""
    previous = os.environ.get(ENV)
    if config is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = json.dumps(config)
    return previous


def restore(previous: str | None) -> None:
    if previous is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = previous


def visible_devices(physical: int, at_start: str | None) -> list[int]:
    """The machine's GPUs that CUDA_VISIBLE_DEVICES lets this process see, in the order it names them: parsed by
    PyTorch's own parser (it stops at the first entry that is not a number; a repeated one hides every GPU) and
    cut before the first index the machine does not have, as torch.cuda.device_count() cuts it. Every GPU while the
    variable is as it was when the emulator started (`at_start`)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in (None, at_start):
        return list(range(physical))
    named = torch.cuda._parse_visible_devices()
    if named and isinstance(named[0], str):
        raise RuntimeError(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} names GPUs by UUID, which "
                           "the GPU emulator (course.emulate) does not model; name them by index (0, 1, ...).")
    visible = []
    for index in named:
        if index >= physical:
            break
        visible.append(index)
    return visible
