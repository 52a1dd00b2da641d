"""The emulator in processes started by an emulated one: mp.spawn's workers, torchrun's ranks, run_processes.

A running emulator publishes its machine in the COURSE_EMULATE environment variable. Every Python of the
course's environment reads it at start-up (course_emulate.pth, installed by `make setup`) and, when it
is set, starts the same emulated machine before any user code runs, so a worker's `torch.cuda` sees the
same GPUs as its parent's (all but multiprocessing's resource tracker, which runs no user code).
"""
from __future__ import annotations

import json
import os

from course.cuda import devices
from course.cuda.emulator import emulate
from course.cuda.environment import ENV

# multiprocessing's resource tracker, a helper Python that an emulated program starts with the variable set as soon
# as it makes a lock or queue in the spawn context (mp.spawn does): it runs no user code, and importing the course
# there (torch with it) cost ~1.7 CPU s per program for nothing.
RESOURCE_TRACKER = "from multiprocessing.resource_tracker import"
# The line Python runs at start-up from site-packages/course_emulate.pth: cheap when the variable is unset or
# the process is the resource tracker (told by its command line, `-c "from multiprocessing.resource_tracker ..."`).
PTH_LINE = ("import os, sys; os.environ.get('COURSE_EMULATE') and "
            f"not ''.join(sys.orig_argv[-1:]).startswith({RESOURCE_TRACKER!r}) and "
            "__import__('course.autostart').autostart.start_from_env()\n")


def start_from_env():
    """Start the machine COURSE_EMULATE describes, unless an emulator already runs in this process. Its
    CUDA_VISIBLE_DEVICES is judged against the value the first emulator started with, not this process's own,
    which a launcher may have set for it."""
    if devices.active is not None:
        return devices.active
    config = json.loads(os.environ[ENV])
    visible_at_start = config.pop("visible_at_start", None)
    emulator = emulate(**config, force=True)
    emulator.visible_at_start = visible_at_start
    return emulator.start()


def install_pth(site_packages: str) -> str:
    """Write course_emulate.pth into a site-packages folder (what `make setup` calls)."""
    path = os.path.join(site_packages, "course_emulate.pth")
    with open(path, "w") as pth:
        pth.write(PTH_LINE)
    return path
