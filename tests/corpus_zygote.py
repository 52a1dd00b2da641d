"""A Python that has imported torch once and starts each corpus program as a fork of itself (tests/test_corpus.py).

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
  -> {"argv": [program, ...], "stdout": path, "stderr": path}   <- {"pid": n}, then {"exited": returncode}
"""
import gc
import json
import os
import runpy
import sys
import threading

# What the emulated run's first op imports lazily (torch.distributed.tensor and sympy): ~0.6 CPU s more per run.
PRELOAD = {"plain": ["torch"], "emulated": ["torch", "course.__main__", "torch.distributed.tensor"]}


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


def run(mode: str, argv: list[str]) -> None:
    """The program, as its command line would run it."""
    program = os.path.abspath(argv[0])
    os.chdir(os.path.dirname(program))
    sys.path[0] = os.path.dirname(program)
    if mode == "emulated":
        from course.__main__ import main
        main(["--gpus", "4", *argv])
    else:
        sys.argv = list(argv)
        runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    mode = sys.argv[1]
    run(mode, serve(mode)["argv"])
