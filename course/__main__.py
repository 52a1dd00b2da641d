"""`python -m course --gpus 4 train.py [args]`: run a program written for CUDA GPUs, unchanged, on emulated ones.

`python -m course --gpus 4 -m torch.distributed.run --nproc-per-node=4 train.py` runs torchrun the same way:
its worker processes start the same emulated machine (see course/autostart.py).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

from course.cuda.emulator import emulate
from course.machine.hardware import GPUS, LINKS


def _as_python_runs_a_script(program: str) -> str:
    """`python train.py` puts the script's folder first on sys.path (so `from model import Net` finds its sibling)
    and gives __main__ an absolute __file__; `python -m course` put the working directory there instead."""
    path = os.path.abspath(program)
    if os.path.isfile(path) and not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4, help="number of emulated GPUs (default 4)")
    parser.add_argument("--gpu", default="A100-80GB", choices=sorted(GPUS), help="GPU preset")
    parser.add_argument("--link", default="nvlink3", choices=sorted(LINKS), help="GPU-to-GPU link preset")
    parser.add_argument("--host-link", default="pcie4", choices=sorted(LINKS), help="host-to-GPU link preset")
    # Like python's own -m, everything after the module's name is its arguments (`-m pytest -q test_x.py`).
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ...",
                        help="run a module as a script, like python -m; the arguments after it are its own")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="the script and its arguments")
    args = parser.parse_args(argv)
    if not args.module and not args.program:  # `-m` with no module name gives []
        parser.error("name a script to run (or -m module)")
    emu = emulate(gpus=args.gpus, gpu=args.gpu, link=args.link, host_link=args.host_link, force=True).start()
    try:
        if args.module:
            sys.argv = list(args.module)
            runpy.run_module(args.module[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args.program)
            runpy.run_path(_as_python_runs_a_script(args.program[0]), run_name="__main__")
    finally:
        emu.stop()


if __name__ == "__main__":
    main()
