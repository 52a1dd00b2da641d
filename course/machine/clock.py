"""The simulated clock: one timeline per stream per GPU plus the host, in integer nanoseconds.

CUDA launches are asynchronous: the host pays a launch overhead and moves on while the kernel waits
for its stream and its inputs. Only a synchronising call (`.item()`, `.cpu()`, printing,
`torch.cuda.synchronize()`) makes the host wait. Integers keep every run identical to the nanosecond.

Each host thread (DataParallel's workers, rank threads) has its own host time: a thread starts at its
parent's time and the parent takes the later of both when it joins, so the timeline does not depend
on how the operating system interleaves the threads.
"""
from __future__ import annotations

import threading
from _thread import get_ident
from typing import Callable

from course.machine.trace import TraceEvent

_event = tuple.__new__  # TraceEvent(...) without its Python-level __new__: one event per op, so it counts


class Clock:
    """Host time, the time each stream becomes free, and the trace of everything that ran."""

    def __init__(self, host_launch_ns: int, module_op_ns: int = 0):
        self.host_launch_ns = host_launch_ns
        # Python of model code around each op issued inside an `nn.Module` call (course/cuda/module_calls.py), by how
        # many module calls each thread is inside.
        self.module_op_ns = module_op_ns
        self._module_depth: dict[int, int] = {}
        self.stream_ready_ns: dict[tuple[int, int], int] = {}
        self._events: list[TraceEvent] = []
        self._host = threading.local()
        self._main_host_ns = 0
        self._main_thread = threading.main_thread().ident
        self.lock = threading.RLock()
        self.recording: set[int] = set()  # threads capturing a CUDA graph (see `launch`)

    @property
    def host_ns(self) -> int:
        # Every launch reads and writes this: the main thread's time is a plain attribute (a threading.local
        # lookup that misses raises and catches an AttributeError inside getattr: most of a microsecond per op).
        if get_ident() == self._main_thread:
            return self._main_host_ns
        return getattr(self._host, "ns", self._main_host_ns)

    @host_ns.setter
    def host_ns(self, value: int) -> None:
        if get_ident() == self._main_thread:
            self._main_host_ns = value
        else:
            self._host.ns = value

    @property
    def trace(self) -> list[TraceEvent]:
        """Every event, ordered by start time then lane, whatever order threads recorded them in."""
        with self.lock:
            return sorted(self._events, key=lambda e: (e.start_ns, e.device, e.stream, e.end_ns, e.name))

    def enter_module(self, call_ns: int) -> None:
        """The host calls an `nn.Module`: it pays `call_ns`, and every op until `exit_module` pays module_op_ns."""
        thread = threading.get_ident()
        self._module_depth[thread] = self._module_depth.get(thread, 0) + 1
        self.host_ns = self.host_ns + call_ns

    def exit_module(self) -> None:
        thread = threading.get_ident()
        self._module_depth[thread] -= 1

    def _python_ns(self) -> int:
        return self.module_op_ns if self._module_depth.get(threading.get_ident()) else 0

    def stream_ready(self, device: int, stream: int) -> int:
        return self.stream_ready_ns.get((device, stream), 0)

    def device_ready(self, device: int) -> int:
        """When every stream of the device has finished its queued work."""
        return max((t for (d, _), t in self.stream_ready_ns.items() if d == device), default=0)

    def issue_at(self, host_ns: int) -> None:
        """Set this thread's host time so that its next launch is issued at `host_ns` and costs the host nothing: work
        that one CUDA graph launch queued all at once (course/cuda/graphs.py)."""
        self.host_ns = host_ns - self.host_launch_ns - self._python_ns()

    def join_lanes(self, lane: tuple[int, int], others) -> None:
        """Work queued on `lane` from now on waits for everything queued on `others`, as work after a graph launch
        waits for the whole graph, whichever streams its branches ran on."""
        with self.lock:
            self.stream_ready_ns[lane] = max(self.stream_ready(*other) for other in {lane, *others})

    def launch(
        self,
        kind: str,
        name: str,
        device: int,
        stream: int,
        duration_ns: int | Callable[[int], int],
        inputs_ready_ns: int = 0,
        also_on: tuple[tuple[int, int], ...] = (),
        flops: int = 0,
        nbytes: int = 0,
        peer: str | None = None,
    ) -> int:
        """Queue work on (device, stream) and return when it ends.

        `also_on` lists other (device, stream) pairs the work occupies too, as a peer copy holds
        the streams of both GPUs. `duration_ns` may be a function of the start time, for a copy whose speed
        depends on what else crosses its links then (course/machine/topology.py).

        On a thread in `recording` (capturing a CUDA graph, course/cuda/graphs.py) the host pays the launch, which
        records the work, and nothing runs on the device: it returns the host time, when the work was recorded.
        """
        with self.lock:
            thread = get_ident()  # the host_ns property and _python_ns, inlined: this runs for every kernel
            python_ns = self.module_op_ns if self._module_depth.get(thread) else 0
            if thread == self._main_thread:
                host = self._main_host_ns = self._main_host_ns + self.host_launch_ns + python_ns
            else:
                host = self._host.ns = getattr(self._host, "ns", self._main_host_ns) + self.host_launch_ns + python_ns
            if thread in self.recording:
                return host
            ready = self.stream_ready_ns
            lane = (device, stream)
            start = max(host, inputs_ready_ns, ready.get(lane, 0))
            if also_on:
                start = max(start, *(ready.get(other, 0) for other in also_on))
            if callable(duration_ns):
                duration_ns = duration_ns(start)
            end = start + duration_ns
            ready[lane] = end
            for other in also_on:
                ready[other] = end
            self._events.append(
                _event(TraceEvent, (kind, name, f"cuda:{device}", stream, start, end, flops, nbytes, peer)))
            return end

    def launch_collective(self, name: str, lanes: list[tuple[int, int]], duration_ns: int,
                          inputs_ready_ns: int, nbytes: int) -> int:
        """One collective over several GPUs: it starts when every participant is ready, ends together."""
        with self.lock:
            host = self.host_ns + self.host_launch_ns + self._python_ns()
            self.host_ns = host
            start = max(host, inputs_ready_ns, *(self.stream_ready(*lane) for lane in lanes))
            end = start + duration_ns
            for device, stream in lanes:
                self.stream_ready_ns[(device, stream)] = end
                self._events.append(
                    TraceEvent("collective", name, f"cuda:{device}", stream, start, end, 0, nbytes)
                )
            return end

    def record_span(self, kind: str, name: str, device: int, stream: int, start_ns: int, end_ns: int,
                    nbytes: int = 0) -> int:
        """Work whose start was agreed elsewhere (by every rank of a collective): the host pays one launch."""
        with self.lock:
            self.host_ns = self.host_ns + self.host_launch_ns + self._python_ns()
            lane = (device, stream)
            self.stream_ready_ns[lane] = max(self.stream_ready(*lane), end_ns)
            self._events.append(TraceEvent(kind, name, f"cuda:{device}", stream, start_ns, end_ns, 0, nbytes))
            return end_ns

    def record(self, events) -> None:
        """Add events computed elsewhere (e.g. the symmetric ranks of a simulated DDP step)."""
        with self.lock:
            self._events.extend(events)

    def host_advance(self, duration_ns: int) -> None:
        """The host spends duration_ns on an op that launches nothing (a view), so later launches start later."""
        thread = get_ident()
        duration_ns += self.module_op_ns if self._module_depth.get(thread) else 0
        if thread == self._main_thread:
            self._main_host_ns += duration_ns
        else:
            self._host.ns = getattr(self._host, "ns", self._main_host_ns) + duration_ns

    def host_wait(self, until_ns: int, reason: str) -> None:
        """Block the host until `until_ns`, recording the idle wait on the host lane."""
        with self.lock:
            host = self.host_ns
            if until_ns > host:
                self._events.append(TraceEvent("host", reason, "host", 0, host, until_ns))
                self.host_ns = until_ns

    def host_lane(self) -> int:
        """The host row this thread's own work is drawn on: 0 for the main thread, 1, 2... for others in the
        order they first do host work (a DataLoader's pin-memory thread, say)."""
        with self.lock:
            if threading.current_thread() is threading.main_thread():
                return 0
            lane = getattr(self._host, "lane", None)
            if lane is None:
                self._host_lanes = getattr(self, "_host_lanes", 0) + 1
                lane = self._host.lane = self._host_lanes
            return lane

    def host_busy(self, duration_ns: int, name: str) -> None:
        """The host thread does work of its own (not waiting for a GPU) for duration_ns."""
        with self.lock:
            host = self.host_ns
            self._events.append(TraceEvent("host_copy", name, "host", self.host_lane(), host, host + duration_ns))
            self.host_ns = host + duration_ns

    def synchronize(self, devices) -> None:
        self.host_wait(max((self.device_ready(d) for d in devices), default=0), "synchronize")
