"""course_emulate.pth's start-up line: which Python processes of an emulated program start the emulated machine.

Each case runs the line as Python runs it at start-up, in a fresh interpreter given the command line of the
process in question, with COURSE_EMULATE unset at launch so the installed .pth (maybe an older line) stays idle.
"""
import json
import os
import subprocess
import sys

import course
from course import autostart

_ENV = {k: v for k, v in os.environ.items() if k != autostart.ENV}


def _tracker_command_line() -> list[str]:
    """The command line multiprocessing gives its resource tracker here, read from the running tracker (once it
    has exec'd: multiprocessing returns its pid straight after the fork)."""
    code = ("import multiprocessing.resource_tracker as r, time; r.ensure_running()\n"
            "own, deadline = open('/proc/self/cmdline').read(), time.time() + 30\n"
            "while open(f'/proc/{r._resource_tracker._pid}/cmdline').read() in ('', own) and time.time() < deadline:\n"
            "    time.sleep(0.01)\n"
            "print(open(f'/proc/{r._resource_tracker._pid}/cmdline').read())")
    out = subprocess.run([sys.executable, "-c", code], env=_ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.rstrip("\n").rstrip("\0").split("\0")


def _start_up_as(command_line: list[str], published: str) -> dict:
    """Run PTH_LINE in a fresh Python whose command line reads `command_line`, with `published` in COURSE_EMULATE."""
    code = (f"import os, sys, json; os.environ[{autostart.ENV!r}] = {published!r}; sys.orig_argv = {command_line!r}\n"
            f"exec({autostart.PTH_LINE!r})\n"
            "active = sys.modules['course.cuda.devices'].active if 'course.cuda.devices' in sys.modules else None\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'gpus': active and active.num_gpus}))")
    out = subprocess.run([sys.executable, "-c", code], env=_ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_resource_tracker_skips_the_emulator_and_a_spawned_worker_starts_it():
    """mp.spawn starts multiprocessing's resource tracker: it runs no user code, so it imports neither the course
    nor torch; a spawned worker, given the same published machine, emulates it."""
    with course.emulate(gpus=4, materialize=False):
        published = os.environ[autostart.ENV]
    tracker = _tracker_command_line()
    assert tracker[-2] == "-c" and tracker[-1].startswith(autostart.RESOURCE_TRACKER), tracker
    assert _start_up_as(tracker, published) == {"torch": False, "gpus": None}
    worker = [sys.executable, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
              "--multiprocessing-fork"]
    assert _start_up_as(worker, published) == {"torch": True, "gpus": 4}
