"""Who sent how many bytes to whom: queries on an emulator trace for the sharding chapters.

Splitting work over GPUs is only worth it if the bytes it moves are few; these helpers read them
back from `emu.trace`, so a notebook can check a byte count it predicted against what really ran.
"""
from __future__ import annotations

import html

from course.machine.memory import format_bytes
from course.machine.trace import TraceEvent


def _ends(event: TraceEvent) -> tuple[str, str]:
    """(source, destination) of a copy. Its name always reads "copy <src>-><dst>" (the lane alone
    cannot tell: a host copy sits on its GPU's lane whichever way it goes)."""
    src, dst = event.name.removeprefix("copy ").split("->")
    return src, dst


def copies(trace, src: str | None = None, dst: str | None = None) -> list[TraceEvent]:
    """The copies of `trace` from device `src` to another device `dst` ("cuda:1", "cpu"; None
    matches any). Copies within one GPU move nothing between devices and are left out."""
    found = []
    for event in trace:
        if event.kind != "copy":
            continue
        source, destination = _ends(event)
        if source != destination and src in (None, source) and dst in (None, destination):
            found.append(event)
    return found


def bytes_copied(trace, src: str | None = None, dst: str | None = None) -> int:
    """Total bytes copied from `src` to `dst` (None matches any device)."""
    return sum(e.bytes for e in copies(trace, src, dst))


def collective_bytes(trace, name: str | None = None) -> int:
    """Bytes of each collective (an NCCL broadcast, reduce, all-reduce ...) counted once, not per GPU.

    The emulator records one event per participating GPU, all with the same start and size.
    """
    seen = {(e.name, e.start_ns, e.bytes) for e in trace
            if e.kind == "collective" and (name is None or e.name == name)}
    return sum(nbytes for _, _, nbytes in seen)


class CopyTable:
    """Bytes copied from each device (rows) to each device (columns); text in a terminal, HTML in Jupyter."""

    def __init__(self, devices: list[str], table: dict[tuple[str, str], int]):
        self.devices = devices
        self.table = table

    def __getitem__(self, src_dst: tuple[str, str]) -> int:
        return self.table.get(src_dst, 0)

    def _cell(self, src: str, dst: str) -> str:
        nbytes = self[src, dst]
        return "-" if src == dst else format_bytes(nbytes) if nbytes else "0"

    def __str__(self) -> str:
        rows = [["from \\ to", *self.devices]]
        rows += [[src, *(self._cell(src, dst) for dst in self.devices)] for src in self.devices]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths))) for row in rows)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(d)}</th>" for d in self.devices)
        body = "".join(f"<tr><th>{html.escape(src)}</th>"
                       + "".join(f"<td>{self._cell(src, dst)}</td>" for dst in self.devices) + "</tr>"
                       for src in self.devices)
        return (f"<table><caption>bytes copied from (rows) to (columns)</caption>"
                f"<thead><tr><th></th>{head}</tr></thead><tbody>{body}</tbody></table>")


def _device_key(device: str):
    return (-1,) if device == "cpu" else (int(device.split(":")[1]),)


def copy_table(trace) -> CopyTable:
    """Every device-to-device byte count of a trace, CPU first, then GPUs in order."""
    table: dict[tuple[str, str], int] = {}
    for event in copies(trace):
        ends = _ends(event)
        table[ends] = table.get(ends, 0) + event.bytes
    devices = sorted({d for ends in table for d in ends}, key=_device_key)
    return CopyTable(devices, table)


def since(trace, start_ms: float) -> list[TraceEvent]:
    """The events that started at or after `start_ms` of simulated time.

    Take `start_ms = emu.now_ms()` right after `torch.cuda.synchronize()`: everything queued before
    has finished by then, so what is left is exactly what the code after it ran.
    """
    start_ns = round(start_ms * 1e6)
    return [e for e in trace if e.start_ns >= start_ns]


# The share of a collective's buffer each rank sends over its link in NCCL's ring algorithms: an all-gather
# or reduce-scatter passes n-1 of the n chunks along, an all-reduce is one of each (the NCCL docs'
# "Collective operations" and nccl-tests' PERFORMANCE.md: busbw = algbw * (n-1)/n, resp. 2(n-1)/n).
_RING_SHARE = {"nccl:all_gather": 1, "nccl:reduce_scatter": 1, "nccl:all_reduce": 2}


def ring_bytes_sent(trace, device: str, world_size: int) -> int:
    """Bytes `device` sends in the ring all-gathers, reduce-scatters and all-reduces of `trace` among
    `world_size` ranks: each collective's buffer (the trace records the full, unsharded size) times
    (n-1)/n, twice for an all-reduce. What the ZeRO paper calls a rank's communication volume."""
    if world_size < 1:
        raise ValueError(f"world_size must be 1 or more; got {world_size}")
    unknown = {e.name for e in trace if e.kind == "collective" and e.device == device} - set(_RING_SHARE)
    if unknown:
        raise ValueError(f"ring_bytes_sent counts all-gathers, reduce-scatters and all-reduces; {device} also ran "
                         f"{sorted(unknown)}: pass only the part of the trace without them (sharding.since)")
    return sum(_RING_SHARE[e.name] * e.bytes * (world_size - 1) // world_size
               for e in trace if e.kind == "collective" and e.device == device)
