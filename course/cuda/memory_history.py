"""`torch.cuda.memory._record_memory_history` on emulated GPUs: the allocator's trace that memory snapshots carry.

While recording, every allocation and free the emulator counts (course/machine/memory.py) becomes a trace entry
with the learner's Python stack, stamped with the simulated host clock: PyTorch's `_snapshot()` then holds
`device_traces` and per-block `frames`, and `_dump_snapshot` a pickle that pytorch.org/memory_viz opens, as
on a GPU. Nothing is cached, so each allocation is its own segment: "segment_alloc" then "alloc", and a free is
"free_requested", "free_completed" and "segment_free" (what a real GPU shows after `torch.cuda.empty_cache()`).
"""
from __future__ import annotations

import collections
import os
import sys

from course.cuda.devices import current_emulator

_COURSE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the course package


def _frames() -> list[dict]:
    """The Python stack, innermost first, without the emulator's own frames (a GPU run has none)."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not os.path.abspath(filename).startswith(_COURSE_DIR):
            frames.append({"filename": filename, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back
    return frames


class History:
    """What one emulator has recorded: a bounded trace per device and the stack that made each live block."""

    def __init__(self, emu, num_gpus: int):
        self.emu = emu
        self.traces = [collections.deque() for _ in range(num_gpus)]
        self.block_frames: dict[tuple[int, int], list[dict]] = {}
        self.trace_alloc = False
        self.with_stacks = True

    def configure(self, enabled, context, stacks, max_entries, clear_history) -> None:
        """`_record_memory_history(enabled, context, stacks, max_entries, clear_history)`, PyTorch's meanings:
        enabled "all" records the trace, "state" only which stack made each live block, None stops."""
        if enabled not in (None, "state", "all"):
            raise ValueError(f"expected enabled to be None, 'state' or 'all', got {enabled!r}")
        if clear_history:
            for trace in self.traces:
                trace.clear()
        self.trace_alloc = enabled == "all"
        self.with_stacks = context is not None and stacks is not None
        self.traces = [collections.deque(trace, maxlen=max_entries if self.trace_alloc else None)
                       for trace in self.traces]
        self.emu.memory.observer = self.observe if enabled is not None else None

    def observe(self, action: str, device: int, address: int, nbytes: int) -> None:
        frames = _frames() if self.with_stacks else []
        if action == "alloc":
            self.block_frames[(device, address)] = frames
            actions = ("segment_alloc", "alloc")
        else:
            self.block_frames.pop((device, address), None)
            actions = ("free_requested", "free_completed", "segment_free")
        if self.trace_alloc:
            time_us = self.emu.clock.host_ns // 1000
            self.traces[device].extend({"action": action, "addr": address, "size": nbytes, "stream": 0,
                                        "time_us": time_us, "frames": frames} for action in actions)

    def annotate(self, segments: list[dict]) -> list[dict]:
        """memory.snapshot()'s segments, each block with the stack that allocated it."""
        for segment in segments:
            for block in segment["blocks"]:
                block["frames"] = self.block_frames.get((segment["device"], block["address"]), [])
        return segments


def history(emu) -> History:
    if getattr(emu, "memory_history", None) is None:
        emu.memory_history = History(emu, len(emu.memory.fraction))
    return emu.memory_history


def record_memory_history(enabled, context, stacks, max_entries, clear_history, compile_context=False,
                          global_record_annotations=False, skip_actions=()) -> None:
    """`torch._C._cuda_record_memory_history`, the binding `torch.cuda.memory._record_memory_history` calls."""
    history(current_emulator("torch.cuda.memory._record_memory_history")).configure(
        enabled, context, stacks, max_entries, clear_history)


def record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                                 trace_alloc_record_context=False, record_context_cpp=False, clear_history=False,
                                 *rest) -> None:
    """The older boolean form (`_record_memory_history(True, trace_alloc_max_entries=...)`)."""
    trace = enabled and trace_alloc_max_entries > 1
    history(current_emulator("torch.cuda.memory._record_memory_history")).configure(
        ("all" if trace else "state") if enabled else None, "all" if record_context else None, "python",
        trace_alloc_max_entries, clear_history)


def device_traces(emu) -> list[list[dict]]:
    recorded = getattr(emu, "memory_history", None)
    return [list(trace) for trace in recorded.traces] if recorded else [[] for _ in emu.memory.fraction]


def annotate(emu, segments: list[dict]) -> list[dict]:
    recorded = getattr(emu, "memory_history", None)
    return recorded.annotate(segments) if recorded else segments
