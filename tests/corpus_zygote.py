"""A Python that has imported torch once and starts each corpus program as a fork of itself (tests/test_corpus.py;
tests/test_pytorch_harness.py runs its files so too); `Zygote` starts one and asks it for runs.

A fresh Python spends ~1.7 CPU s importing torch (the course too, for the emulated run) before a program's first
line: 37 programs, twice each. This process imports that once, then for each request forks a child that runs the
program as `python PROGRAM` would (runpy as __main__, argv, sys.path[0] and cwd the program's folder) or exactly
as `python -m course --gpus 4 PROGRAM` does (course.__main__.main), and exits through the interpreter's own
shutdown (atexit, non-daemon threads, flushed output). The zygote only imports: no op has run, no random number
was drawn and no thread started when it forks, so a child starts where a fresh interpreter would be after those
imports (which the program, or `python -m course`, makes first anyway); a run costs ~0.1 CPU s more than the
program itself, a fresh start ~1.7 s. What the program starts itself (torchrun
ranks, mp.spawn workers) are fresh Pythons as before.

`python corpus_zygote.py plain|emulated`, JSON lines on stdin/stdout:
  -> {"argv": [program, ...], "stdout": path, "stderr": path, "cwd": path or null (the program's folder)}
  <- {"pid": n}, then {"exited": returncode}
"""
from __future__ import annotations

import gc
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# What the emulated run's first op imports lazily (torch.distributed.tensor and sympy): ~0.6 CPU s more per run.
PRELOAD = {"plain": ["torch"], "emulated": ["torch", "course.__main__", "torch.distributed.tensor"]}
BWRAP = shutil.which("bwrap")
TIMEOUT_S = 300


def serve(mode: str) -> dict:
    """Answer requests until stdin closes (then exit); return only in a forked child, with its request."""
    for name in PRELOAD[mode]:
        __import__(name)
    assert threading.active_count() == 1, "the zygote must not fork with threads running"
    # The imported objects move out of the collector's reach: a child's collections (and its shutdown) would
    # otherwise touch, and so copy, every page of them: 0.5 CPU s per run, a third of a fresh start.
    gc.freeze()
    rx, tx = os.dup(0), os.dup(1)  # the protocol moves off fds 0/1, which the children's output takes over
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    requests = os.fdopen(rx)
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(err, 2)
            for fd in (out, err, devnull, tx):
                os.close(fd)
            requests.close()
            return request
        os.write(tx, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        os.write(tx, (json.dumps({"exited": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    sys.exit(0)


def run(mode: str, argv: list[str], cwd: str | None) -> None:
    """The program, as its command line would run it: `python -m course` puts the working directory first on
    sys.path, and then, as `python PROGRAM` does, the program's folder in its place."""
    program = os.path.abspath(argv[0])
    os.chdir(cwd or os.path.dirname(program))
    sys.path[0] = os.getcwd() if mode == "emulated" else os.path.dirname(program)
    if mode == "emulated":
        from course.__main__ import main
        main(["--gpus", "4", *argv])
    else:
        sys.argv = list(argv)
        runpy.run_path(program, run_name="__main__")


class Zygote:
    """A corpus_zygote.py process (see there): each run is a fork of it, one at a time. With `own_network`, it and
    so every run it starts live in a network namespace of their own (bubblewrap, loopback only), so that
    hard-coded rendezvous ports cannot collide with the other run going on at the same time."""

    def __init__(self, mode: str, own_network: bool = False, env: dict | None = None):
        if env is None:
            env = {k: v for k, v in os.environ.items() if k != "COURSE_EMULATE"}
            env["PYTHONWARNINGS"] = "ignore"
        command = [sys.executable, os.path.abspath(__file__), mode]
        launch = [BWRAP, "--dev-bind", "/", "/", "--unshare-net", "--die-with-parent", "--"] + command \
            if own_network else command
        self.mode, self.buffer, self.running = mode, b"", None
        self.process = subprocess.Popen(launch, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        cwd=os.path.dirname(command[1]), env=env)

    def _message(self, deadline: float | None = None) -> dict:
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.process.stdout], [], [], wait)[0]:
                raise TimeoutError
            data = os.read(self.process.stdout.fileno(), 1 << 16)
            assert data, f"the {self.mode} corpus zygote exited {self.process.wait()} (its stderr is above)"
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def start(self, program: Path, folder: Path, args: tuple[str, ...] = (), cwd: Path | None = None) -> None:
        """Start a program with `args`, in `cwd` (by default its own folder); it writes its output to files in
        `folder`."""
        self.output = folder / f"{self.mode}.out", folder / f"{self.mode}.err"
        self.process.stdin.write((json.dumps({"argv": [str(program), *args], "stdout": str(self.output[0]),
                                              "stderr": str(self.output[1]),
                                              "cwd": cwd and str(cwd)}) + "\n").encode())
        self.process.stdin.flush()
        self.running = self._message()["pid"]

    def finish(self) -> tuple[int, str, str]:
        """Wait for the run (killed after TIMEOUT_S seconds): its return code, stdout and stderr."""
        try:
            returncode = self._message(time.monotonic() + TIMEOUT_S)["exited"]
        except TimeoutError:
            self._kill()
            returncode = self._message()["exited"]
        self.running = None
        return returncode, self.output[0].read_text(), self.output[1].read_text()

    def _kill(self) -> None:
        try:
            os.kill(self.running, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass

    def close(self) -> None:
        if self.running is not None:  # a test that failed before waiting for its run
            self._kill()
            self._message()
        self.process.stdin.close()
        self.process.wait(timeout=60)


if __name__ == "__main__":
    mode = sys.argv[1]
    request = serve(mode)
    run(mode, request["argv"], request.get("cwd"))
