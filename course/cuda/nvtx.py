"""`torch.cuda.nvtx` ranges and marks, recorded on the emulator's host timeline.

On a GPU box, Nsight Systems shows NVTX ranges above the kernels they launched; here the emulator
plays that tool: it stands in for `torch._C._nvtx` (which a CPU build lacks), so `range_push`,
`range_pop`, `range(...)`, `range_start`/`range_end` and `mark` work unchanged and their ranges
appear in `emu.plot_timeline()` and `emu.export_chrome_trace()`, in simulated host time.
"""
from __future__ import annotations

import itertools
import threading
import warnings

import torch
import torch.autograd.profiler

from course.machine.trace import TraceEvent

NO_RANGE = -1  # what range_pop returns with no range open: NVTX returns a negative value on error


class EmulatedNVTX:
    """The functions `torch.cuda.nvtx` calls on `torch._C._nvtx`, for one emulator.

    Push/pop ranges nest per thread, as NVTX's do; start/end ranges may cross threads.
    """

    def __init__(self, emu):
        self._emu = emu
        self._per_thread = threading.local()
        self._open: dict[int, tuple[str, int]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _stack(self) -> list[tuple[str, int]]:
        if not hasattr(self._per_thread, "stack"):
            self._per_thread.stack = []
        return self._per_thread.stack

    def rangePushA(self, msg) -> int:  # noqa: N802 - the name torch.cuda.nvtx calls
        """Open a nested range; returns its zero-based depth."""
        stack = self._stack()
        stack.append((str(msg), self._emu.clock.host_ns))
        return len(stack) - 1

    def rangePop(self) -> int:  # noqa: N802
        """Close the innermost range; returns its depth, or NO_RANGE if none is open."""
        stack = self._stack()
        if not stack:
            return NO_RANGE
        name, start_ns = stack.pop()
        self._record(name, len(stack), start_ns)
        return len(stack)

    def rangeStartA(self, msg) -> int:  # noqa: N802
        """Open a range that any thread may end; returns its handle."""
        with self._lock:
            handle = next(self._ids)
            self._open[handle] = (str(msg), self._emu.clock.host_ns)
        return handle

    def rangeEnd(self, handle) -> None:  # noqa: N802
        with self._lock:
            opened = self._open.pop(handle, None)
        if opened is not None:
            self._record(opened[0], len(self._stack()), opened[1])

    def markA(self, msg) -> None:  # noqa: N802
        """An instant: a range of zero length."""
        now = self._emu.clock.host_ns
        self._emu.clock.record([TraceEvent("nvtx", str(msg), "host", len(self._stack()), now, now)])

    def _record(self, name: str, depth: int, start_ns: int) -> None:
        end_ns = max(start_ns, self._emu.clock.host_ns)
        self._emu.clock.record([TraceEvent("nvtx", name, "host", depth, start_ns, end_ns)])


class EmitNVTX(torch.autograd.profiler.emit_nvtx):
    """`torch.autograd.profiler.emit_nvtx` while emulating: the block runs as on a GPU (its numbers do not depend on
    it), and is one NVTX range on the timeline. Per-op ranges, which the profiler's C++ emits on a CUDA build
    and a CPU build refuses ("PyTorch was compiled without CUDA"), are not recorded: a note says so once."""

    warned = False

    def __enter__(self):
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("NVTX annotation context manager is not reentrant")
        self.entered = True
        if not EmitNVTX.warned:
            EmitNVTX.warned = True
            warnings.warn("torch.autograd.profiler.emit_nvtx is not modelled op by op by the GPU emulator "
                          "(course.emulate): the block is one NVTX range on its timeline; use torch.cuda.nvtx ranges "
                          "or torch.profiler for more.", stacklevel=2)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("emit_nvtx")
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if not self.enabled:
            return None
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        return False


def capture_mark(name: str):
    def mark() -> None:
        torch.cuda.nvtx.mark(name)

    mark.__name__ = name
    mark.__doc__ = (f"`torch.cuda.profiler.{name[12:].lower()}()`: where an attached profiler (Nsight Systems with "
                    f"--capture-range=cudaProfilerApi) would {name[12:].lower()} capturing; a mark on the timeline.")
    return mark


# torch.cuda.profiler.start/stop (and profile(), which calls them) only tell an attached profiler when to capture.
PROFILER_PATCHES = {"start": capture_mark("cudaProfilerStart"), "stop": capture_mark("cudaProfilerStop")}
