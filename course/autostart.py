"""The emulator in processes started by an emulated one: mp.spawn's workers, torchrun's ranks, run_processes.

A running emulator publishes its machine in the COURSE_EMULATE environment variable. Every Python of the
course's environment reads it at start-up (course_emulate.pth, installed by `make setup`) and, when it
is set, starts the same emulated machine before any user code runs, so a worker's `torch.cuda` sees the
same GPUs as its parent's.
"""
from __future__ import annotations

import json
import os

ENV = "COURSE_EMULATE"

# The line Python runs at start-up from site-packages/course_emulate.pth: cheap when the variable is unset.
PTH_LINE = ("import os; os.environ.get('COURSE_EMULATE') and "
            "__import__('course.autostart').autostart.start_from_env()\n")


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


def start_from_env():
    """Start the machine COURSE_EMULATE describes, unless an emulator already runs in this process."""
    from course.cuda import devices
    from course.cuda.emulator import emulate

    if devices.active is not None:
        return devices.active
    return emulate(**json.loads(os.environ[ENV]), force=True).start()


def install_pth(site_packages: str) -> str:
    """Write course_emulate.pth into a site-packages folder (what `make setup` calls)."""
    path = os.path.join(site_packages, "course_emulate.pth")
    with open(path, "w") as pth:
        pth.write(PTH_LINE)
    return path
