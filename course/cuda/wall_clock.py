"""Wall-clock timing of emulated GPU work: what `torch.utils.benchmark.Timer` and `time.perf_counter` read.

The real clock measures this CPU doing the GPU's math (a 4096^2 matmul takes most of a second here, 8.6 ms on the
emulated A100), so a benchmark snippet timed by it gives a silently wrong picture. Patching the `time` module is not
an option: Jupyter's event loop, timeouts and retry loops run on it, and a clock that stood still during
`time.sleep` could hang a program. Two narrower answers instead:

- `torch.utils.benchmark.Timer` is a GPU benchmarking tool that synchronizes the accelerator around what it times
  (its default `timer`, torch/utils/benchmark/utils/timer.py). With that default timer, the emulator's Timer reads
  the simulated host clock, synchronized the same way, so it reports what the emulated GPU box would. A statement
  that runs no emulated work leaves the simulated clock still; that measurement keeps the real clock, as it is CPU
  work, which is the same on any box (and a still clock would make `blocked_autorange` grow its loop forever).
- `torch.cuda.synchronize()` called from code that also reads a wall clock (`time.perf_counter`, `time.time`, ...)
  is the usual hand-written GPU timing; it gets a one-time note that points at CUDA events or Timer.
"""
from __future__ import annotations

import dis
import gc
import itertools
import sys
import time
import timeit
import warnings

import torch

from course.cuda import devices

_CLOCK_MODULES = (time, timeit)
_CLOCK_ATTRIBUTES = frozenset({"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns",
                               "process_time", "default_timer"})
_CLOCK_IDS = frozenset(id(getattr(module, name)) for module in _CLOCK_MODULES for name in _CLOCK_ATTRIBUTES
                       if callable(getattr(module, name, None)))
_noted = False


def _reads_wall_clock(frame) -> bool:
    """Whether the frame's code calls a wall clock: a name bound to one (`from time import perf_counter`), or a clock
    read from the time or timeit module (`time.perf_counter()`, `timeit.default_timer()`), imported globally or in
    this function or one around it."""
    code, local, scope = frame.f_code, frame.f_locals, frame.f_globals
    lookup = lambda name: local[name] if name in local else scope.get(name)
    values = [lookup(name) for name in code.co_names + code.co_freevars + code.co_varnames]
    if any(id(value) in _CLOCK_IDS for value in values):
        return True
    if not any(value is module for value in values for module in _CLOCK_MODULES):
        return False
    previous = None
    for instruction in dis.get_instructions(code):
        if (instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and instruction.argval in _CLOCK_ATTRIBUTES
                and previous is not None and previous.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF")
                and any(lookup(previous.argval) is module for module in _CLOCK_MODULES)):
            return True
        previous = instruction
    return False


def note_if_wall_clock() -> None:
    """Called by `torch.cuda.synchronize`: warn once if the program code calling it also reads a wall clock (code in
    torch or the course that synchronizes, such as Timer's own timer, is not the program's)."""
    global _noted
    if _noted:
        return
    frame = sys._getframe(2)
    if str(frame.f_globals.get("__name__")).partition(".")[0] in ("torch", "course") or not _reads_wall_clock(frame):
        return
    _noted = True
    warnings.warn("time.perf_counter() and other wall clocks measure this CPU running the emulated GPUs' kernels, "
                  "not the emulated GPUs (course.emulate): time GPU work with torch.cuda.Event(enable_timing=True) "
                  "and elapsed_time(), or torch.utils.benchmark.Timer, which read the simulated clock.", stacklevel=3)


class _SimulatedTimeit:
    """The timeit.Timer inside a `torch.utils.benchmark.Timer` made with its default, synchronizing timer: the same
    compiled loop, timed on the simulated host clock (see the module docstring)."""

    def __init__(self, inner):
        self._inner = inner

    def timeit(self, number: int) -> float:
        readings = []

        def clock() -> float:
            torch.cuda.synchronize()
            readings.append(time.perf_counter())
            return devices.active.clock.host_ns / 1e9

        collecting = gc.isenabled()
        gc.disable()  # as timeit.Timer.timeit does
        try:
            simulated = self._inner.inner(itertools.repeat(None, number), clock)
        finally:
            if collecting:
                gc.enable()
        return simulated if simulated > 0 else readings[-1] - readings[0]


# Imported only if the program uses it: it pulls in setuptools, a seventh of the emulator's start-up cost, which
# every emulated process (each rank, each notebook kernel) would pay. The emulator patches it once it is imported.
TIMER_MODULE = "torch.utils.benchmark.utils.timer"


def patches() -> list:
    """`Timer.__init__`, then its timeit.Timer swapped for the simulated one when it got the default timer."""
    benchmark_timer = sys.modules[TIMER_MODULE]
    timer_init = benchmark_timer.Timer.__init__

    def __init__(self, *args, **kwargs) -> None:
        timer_init(self, *args, **kwargs)
        if getattr(self._timer, "timer", None) is benchmark_timer.timer:
            self._timer = _SimulatedTimeit(self._timer)
    return [(benchmark_timer.Timer, {"__init__": __init__})]
