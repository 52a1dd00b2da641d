"""The simulated clock: one timeline per stream per GPU plus the host, in integer nanoseconds.

CUDA launches are asynchronous: the host pays a launch overhead and moves on while the kernel waits
for its stream and its inputs. Only a synchronising call (`.item()`, `.cpu()`, printing,
`torch.cuda.synchronize()`) makes the host wait. Integers keep every run identical to the nanosecond.
"""
from __future__ import annotations

import threading

from course.trace import TraceEvent


class Clock:
    """Host time, the time each stream becomes free, and the trace of everything that ran."""

    def __init__(self, host_launch_ns: int):
        self.host_launch_ns = host_launch_ns
        self.host_ns = 0
        self.stream_ready_ns: dict[tuple[int, int], int] = {}
        self.trace: list[TraceEvent] = []
        self.lock = threading.RLock()

    def stream_ready(self, device: int, stream: int) -> int:
        return self.stream_ready_ns.get((device, stream), 0)

    def device_ready(self, device: int) -> int:
        """When every stream of the device has finished its queued work."""
        return max((t for (d, _), t in self.stream_ready_ns.items() if d == device), default=0)

    def launch(
        self,
        kind: str,
        name: str,
        device: int,
        stream: int,
        duration_ns: int,
        inputs_ready_ns: int = 0,
        also_on: tuple[tuple[int, int], ...] = (),
        flops: int = 0,
        nbytes: int = 0,
        peer: str | None = None,
    ) -> int:
        """Queue work on (device, stream) and return when it ends.

        `also_on` lists other (device, stream) pairs the work occupies too, as a peer copy holds
        the streams of both GPUs.
        """
        with self.lock:
            self.host_ns += self.host_launch_ns
            lanes = ((device, stream),) + also_on
            start = max(self.host_ns, inputs_ready_ns, *(self.stream_ready(*lane) for lane in lanes))
            end = start + duration_ns
            for lane in lanes:
                self.stream_ready_ns[lane] = end
            self.trace.append(
                TraceEvent(kind, name, f"cuda:{device}", stream, start, end, flops, nbytes, peer)
            )
            return end

    def host_wait(self, until_ns: int, reason: str) -> None:
        """Block the host until `until_ns`, recording the idle wait on the host lane."""
        with self.lock:
            if until_ns > self.host_ns:
                self.trace.append(TraceEvent("host", reason, "host", 0, self.host_ns, until_ns))
                self.host_ns = until_ns

    def synchronize(self, devices) -> None:
        self.host_wait(max((self.device_ready(d) for d in devices), default=0), "synchronize")
