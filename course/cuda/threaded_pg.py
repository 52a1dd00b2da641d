"""PyTorch's threaded process group (`MultiThreadedTestCase`, `FSDPTestMultiThread`, `course.run_threads`) on
emulated GPUs.

That group (torch/testing/_internal/distributed/multi_threaded_pg.py) is Python: each rank joins a `Collective`,
and rank 0 then moves every rank's tensors itself (`AllReduce.work`: `.to(rank 0's device)`, a reduction on it,
`copy_` back). It runs inside `dist.all_reduce`'s torch-function handling, where the emulator's mode is off, so
`.to("cuda:0")` would reach a CPU build's lazy CUDA init and be refused. `Collective.join` runs with the mode on
again: those calls are the emulated GPUs' own, the values are the ones the group computes for CPU tensors, and its
copies between GPUs are on the timeline (as the group's own Python moves them, not as NCCL would).
"""
from __future__ import annotations

import functools
import sys

from course.cuda import graphs
from course.cuda.interception import EmulatorMode

MODULE = "torch.testing._internal.distributed.multi_threaded_pg"


def patches() -> list[tuple[object, dict]]:
    """`Collective.join` with the emulator's mode on, once the group's module is imported (else nothing)."""
    module = sys.modules.get(MODULE)
    if module is None:
        return []
    join = module.Collective.join

    @functools.wraps(join)
    def join_on_emulated_gpus(self, rank, data):
        graphs.refuse_collective("the threaded test group moves GPU values in Python when called")
        with EmulatorMode():
            return join(self, rank, data)
    return [(module.Collective, {"join": join_on_emulated_gpus})]
