"""COURSE_EMULATE: the machine a running emulator publishes for the processes it starts.

mp.spawn's workers, torchrun's ranks and run_processes' children read it at start-up (course/autostart.py)
and start the same emulated machine, so a worker's `torch.cuda` sees the same GPUs as its parent's.
"""
from __future__ import annotations

import json
import os

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
