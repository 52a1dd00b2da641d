"""`torch.profiler` with CUDA activity on the emulated GPUs, showing their simulated kernel times.

A CPU build of torch cannot record CUDA activity (its fallback prints pages of C++ stack traces and
reports no CUDA time). While the emulator runs, a profile asking for CUDA profiles the CPU as usual
and marks each emulated launch with a `cudaLaunchKernel` (or `cudaMemcpyAsync`) range; when the
results are read, the kernels, copies and collectives those launches queued become the CUDA events
a real profile has, with their simulated durations, attached to the op that launched them.
The emulator's own Python dispatch (`PythonSubclass` and the CPU ops it runs) is left out, so the
table reads like one taken on a GPU box.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager

import torch
import torch.autograd.profiler as autograd_profiler
from torch.autograd import DeviceType, ProfilerActivity, ProfilerState
from torch.autograd.profiler_util import FunctionEvent

from course.cuda import devices

_Profile = autograd_profiler.profile
_REAL = {name: getattr(_Profile, name) for name in
         ("__init__", "_start_trace", "__exit__", "_parse_kineto_results", "export_chrome_trace")}
_REAL_SUPPORTED = torch.autograd._supported_activities
_REAL_KINETO = {name: getattr(autograd_profiler, name)
                for name in ("_prepare_profiler", "_enable_profiler", "_disable_profiler")}

# The emulator's own frames in a CPU profile -> what a GPU profile shows in their place (None: nothing).
# What runs inside them is the emulator at work, not the program: it is left out.
EMULATOR_FRAMES = {"PythonSubclass": None, "_Move": "aten::to", "_CopyInto": "aten::copy_"}
_MARK = re.compile(r"^(cudaLaunchKernel|cudaMemcpyAsync)#(\d+)$")
_LAUNCHES = ("launch", "launch_collective", "record_span", "record")  # the Clock methods that queue GPU work
_CHROME_CATEGORY = {"kernel": "kernel", "collective": "kernel", "copy": "gpu_memcpy"}
# libkineto prints these two info lines on stderr at every start and stop; a notebook cell fails
# when anything reaches stderr, so they are filtered out (other output passes through).
_KINETO_INFO = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


def supported_activities() -> set:
    """The emulated GPUs can be profiled, as on a machine with CUDA."""
    return _REAL_SUPPORTED() | {ProfilerActivity.CUDA}


class Recording:
    """The launches made while one profile ran: token -> the trace events that launch queued."""

    def __init__(self, profile, emu, records_gpu: bool, cpu_requested: bool):
        self.profile = profile
        self.emu = emu
        self.records_gpu = records_gpu
        self.cpu_requested = cpu_requested
        self.launches: dict[int, list] = {}
        self.origin_ns = 0
        self._tokens = itertools.count(1)
        self._originals: dict = {}

    # -- while profiling: wrap the clock's launch methods -----------------------------------------
    def start(self) -> None:
        clock = self.emu.clock
        self.origin_ns = clock.host_ns
        for name in _LAUNCHES:
            if hasattr(clock, name):
                self._originals[name] = getattr(clock, name)
                setattr(clock, name, self._marked(name, self._originals[name]))
        _LIVE.add(self)

    def stop(self) -> None:
        for name in self._originals:
            delattr(self.emu.clock, name)  # the instance attribute hid the class's method
        self._originals.clear()
        _LIVE.discard(self)

    def _marked(self, method: str, original):
        clock = self.emu.clock

        def launch(*args, **kwargs):
            if method == "record":
                events = list(args[0] if args else kwargs["events"])
                if all(e.device == "host" for e in events):  # e.g. NVTX ranges: no GPU work
                    return original(events)
                args, kwargs = (events,), {}
            kind = args[0] if method in ("launch", "record_span") and args else kwargs.get("kind")
            label = "cudaMemcpyAsync" if kind == "copy" else "cudaLaunchKernel"
            with clock.lock:
                token = next(self._tokens)
                first = len(clock._events)
                with torch._C._profiler._RecordFunctionFast(f"{label}#{token}"):
                    result = original(*args, **kwargs)
                self.launches[token] = [e for e in clock._events[first:] if e.device != "host"]
            return result

        return launch

    # -- when the results are read --------------------------------------------------------------
    def rewrite(self, events: list[FunctionEvent], use_device) -> list[FunctionEvent]:
        """Drop the emulator's dispatch, rename the launch marks, add the GPU events they queued."""
        kept, launchers, renames = _without_emulator(
            events, lambda e: (e.thread, e.time_range.start, e.time_range.end, e.name,
                               e.device_type == DeviceType.CPU and not e.is_async), slack=0)
        for event, name in renames:
            event.name = event.trace_name = name
        device_events = []
        for event, launcher in launchers:
            label, token = _MARK.match(event.name).groups()
            event.name = event.trace_name = label
            for gpu_event in self.launches.get(int(token), ()):
                device = int(gpu_event.device.split(":")[1])
                name = device_event_name(gpu_event)
                start_us = (gpu_event.start_ns - self.origin_ns) / 1e3
                if launcher is not None:
                    launcher.append_kernel(name, device, gpu_event.duration_ns / 1e3)
                device_events.append(FunctionEvent(
                    id=launcher.id if launcher is not None else event.id, name=name, trace_name=name,
                    overload_name="", input_shapes=[], stack=[],
                    thread=gpu_event.stream, start_us=start_us,
                    end_us=start_us + gpu_event.duration_ns / 1e3, use_device=use_device,
                    device_type=DeviceType.CUDA, device_index=device,
                    device_resource_id=gpu_event.stream, flops=gpu_event.flops or None,
                    linked_correlation_id=launcher.id if launcher is not None else 0))
        if not self.cpu_requested:
            kept = []
        result = kept + device_events
        result.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
        return result

    def rewrite_chrome_trace(self, path: str, trace_start_ns: int) -> None:
        """The same changes in a trace file kineto wrote: GPU kernels on one process per GPU."""
        with open(path) as f:
            data = json.load(f)
        events = data["traceEvents"]
        spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("tid"), int)]
        # kineto rounds each start and duration to the nanosecond: let a child end 2 ns late
        kept, launchers, renames = _without_emulator(
            spans, lambda e: ((e["pid"], e["tid"]), e["ts"], e["ts"] + e["dur"], e["name"], True),
            slack=0.002)
        for event, name in renames:
            event["name"] = name
        dropped = {id(e) for e in spans} - {id(e) for e in kept}
        events = [e for e in events if id(e) not in dropped]
        origin_us = (trace_start_ns - data.get("baseTimeNanoseconds", 0)) / 1e3
        lanes: set[tuple[int, int]] = set()
        for event, launcher in launchers:
            label, token = _MARK.match(event["name"]).groups()
            event.update(name=label, cat="cuda_runtime")
            event["args"]["correlation"] = int(token)
            external = (launcher or event)["args"].get("External id", 0)
            for gpu_event in self.launches.get(int(token), ()):
                device = int(gpu_event.device.split(":")[1])
                lanes.add((device, gpu_event.stream))
                events.append({
                    "ph": "X", "cat": _CHROME_CATEGORY.get(gpu_event.kind, "kernel"),
                    "name": device_event_name(gpu_event), "pid": device, "tid": gpu_event.stream,
                    "ts": origin_us + (gpu_event.start_ns - self.origin_ns) / 1e3,
                    "dur": gpu_event.duration_ns / 1e3,
                    "args": {"External id": external, "correlation": int(token), "device": device,
                             "stream": gpu_event.stream, "flops": gpu_event.flops,
                             "bytes": gpu_event.bytes, "peer": gpu_event.peer}})
        events.extend(_gpu_lane_metadata(lanes))
        data["traceEvents"] = events
        if self.records_gpu:
            data["deviceProperties"] = [_device_properties(self.emu, d) for d in range(self.emu.num_gpus)]
        with open(path, "w") as f:
            json.dump(data, f)


_LIVE: set[Recording] = set()


def device_event_name(event) -> str:
    """A GPU event's name in the profile: kernels are named after the op that launched them."""
    return f"{event.name} (GPU kernel)" if event.kind == "kernel" else event.name


def _without_emulator(events, describe, slack):
    """Leave out the emulator's frames, name them as PyTorch does, find the op behind each launch.

    `describe(e)` gives (thread, start, end, name, nests); events that nest on a thread form a
    call tree (a child may end `slack` after its parent). Returns the events to keep, for each
    launch mark (mark, innermost kept op around it, or None), and the (event, new name) renames.
    """
    ordered = sorted(events, key=lambda e: (str(describe(e)[0]), describe(e)[1], -describe(e)[2]))
    kept, launchers, renames = [], [], []
    stacks: dict = {}  # thread -> [(end, kept event or None, whether it hides what runs inside)]
    for event in ordered:
        thread, start, end, name, nests = describe(event)
        if not nests:
            kept.append(event)
            continue
        stack = stacks.setdefault(thread, [])
        while stack and not (start < stack[-1][0] and end <= stack[-1][0] + slack):
            stack.pop()
        if _MARK.match(name):
            launchers.append((event, next((o for _, o, _ in reversed(stack) if o is not None), None)))
        elif any(hides for _, _, hides in stack):
            stack.append((end, None, True))
            continue
        elif name in EMULATOR_FRAMES:
            shown = EMULATOR_FRAMES[name]
            if shown is not None:
                renames.append((event, shown))
                kept.append(event)
            stack.append((end, event if shown else None, True))
            continue
        kept.append(event)
        stack.append((end, event, False))
    return kept, launchers, renames


def _gpu_lane_metadata(lanes) -> list[dict]:
    meta = []
    for device in sorted({d for d, _ in lanes}):
        meta += [{"ph": "M", "name": "process_name", "pid": device, "tid": 0,
                  "args": {"name": "emulated GPU"}},
                 {"ph": "M", "name": "process_labels", "pid": device, "tid": 0,
                  "args": {"labels": f"GPU {device}"}},
                 {"ph": "M", "name": "process_sort_index", "pid": device, "tid": 0,
                  "args": {"sort_index": 5000000 + device}}]
    for device, stream in sorted(lanes):
        meta.append({"ph": "M", "name": "thread_name", "pid": device, "tid": stream,
                     "args": {"name": f"stream {stream}"}})
    return meta


def _device_properties(emu, device: int) -> dict:
    gpu = emu.gpu
    major, minor = gpu.compute_capability
    return {"id": device, "name": gpu.name, "totalGlobalMem": gpu.memory_bytes,
            "computeMajor": major, "computeMinor": minor, "numSms": gpu.multi_processor_count}


# -- the hooks, in place while the emulator runs ----------------------------------------------------
def _init(self, *args, **kwargs):
    _REAL["__init__"](self, *args, **kwargs)
    emu = devices.active
    if not self.enabled or emu is None:
        return
    cuda = self.use_device == "cuda"
    if cuda:  # profile the CPU with kineto; the GPU events come from the emulator
        self.profiler_kind = ProfilerState.KINETO
        self.kineto_activities.discard(ProfilerActivity.CUDA)
    self._emulated = Recording(self, emu, records_gpu=cuda, cpu_requested=bool(self.kineto_activities))
    if cuda and not self.kineto_activities:
        self.kineto_activities.add(ProfilerActivity.CPU)  # the launch marks need CPU events
    # Reading the results may come after the emulator stopped: bind the readers to this profile.
    self._parse_kineto_results = _parse_kineto_results.__get__(self)
    self.export_chrome_trace = _export_chrome_trace.__get__(self)


def _start_trace(self):
    _REAL["_start_trace"](self)
    if getattr(self, "_emulated", None) is not None and self._emulated.records_gpu:
        self._emulated.start()


def _exit(self, exc_type, exc_val, exc_tb):
    try:
        return _REAL["__exit__"](self, exc_type, exc_val, exc_tb)
    finally:
        if getattr(self, "_emulated", None) is not None:
            self._emulated.stop()


def _parse_kineto_results(self, result, timeout_s=None):
    events = _REAL["_parse_kineto_results"](self, result, timeout_s=timeout_s)
    return self._emulated.rewrite(events, self.use_device)


def _export_chrome_trace(self, path, metadata=None, use_python_export=False):
    written = _REAL["export_chrome_trace"](self, path, metadata, use_python_export)
    if self.kineto_results is not None and os.path.exists(path):
        self._emulated.rewrite_chrome_trace(path, self.kineto_results.trace_start_ns())
    return written


@contextmanager
def _kineto_info_filtered():
    """Send file descriptor 2 to a temporary file and pass on all but kineto's info lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            passed = "".join(line for line in lines if not _KINETO_INFO.match(line))
            if passed:
                sys.stderr.write(passed)


def _quiet(name: str):
    real = _REAL_KINETO[name]

    def call(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return real(*args, **kwargs)
        with _kineto_info_filtered():
            return real(*args, **kwargs)

    call.__name__ = name
    return call


PATCHES = [  # (object, {attribute: replacement}) for Emulator._patch
    (torch.autograd, {"_supported_activities": supported_activities}),
    (autograd_profiler, {"_supported_activities": supported_activities,
                         **{name: _quiet(name) for name in _REAL_KINETO}}),
    (_Profile, {"__init__": _init, "_start_trace": _start_trace, "__exit__": _exit}),
]


def stop_recordings(emu) -> None:
    """Called when the emulator stops: a profile still running ends there, its results kept.

    Its own stop() comes later, without the emulated GPUs it would synchronize: it finds it done.
    """
    for recording in [r for r in _LIVE if r.emu is emu]:
        _exit(recording.profile, None, None, None)
        recording.profile.__exit__ = lambda *exc: False
