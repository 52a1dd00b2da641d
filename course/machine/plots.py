"""What the emulator recorded, drawn for people: a timeline, a Chrome trace and a per-GPU summary.

Each function takes the trace (`emu.trace`, a list of `TraceEvent`) so it also works on a copy
saved from an earlier run; `Emulator.plot_timeline()` and friends pass their own trace.
"""
from __future__ import annotations

import html
import json

from course.machine.trace import TraceEvent, merge_intervals

KINDS = {  # kind -> (legend label, colour); this order is the legend's
    "kernel": ("compute kernel", "tab:blue"),
    "copy": ("copy", "tab:orange"),
    "collective": ("collective", "tab:green"),
    "host": ("host waiting for GPUs", "tab:gray"),
    "host_blocked": ("host blocked by a copy", "dimgray"),  # a host wait whose reason is a copy, drawn apart
    "host_copy": ("host copying into pinned memory", "tab:brown"),
}


def _kind(e: TraceEvent) -> str:
    """The timeline's colour class: a host wait for a copy (pageable, or to the CPU) is told from synchronize."""
    return "host_blocked" if e.kind == "host" and e.name.startswith("wait for copy") else e.kind
NVTX = ("NVTX range", "tab:purple")  # torch.cuda.nvtx ranges: drawn on their own rows under the host
NVTX_TID = 1  # the host thread NVTX ranges go on in a Chrome trace (host waits are on 0)


def _check(trace) -> list[TraceEvent]:
    if not trace:
        raise ValueError("nothing ran on the emulated GPUs yet: the trace is empty")
    return list(trace)


def _device_key(device: str):
    """Sorts "host" first, then GPUs by number (so cuda:10 comes after cuda:9)."""
    return (-1,) if device == "host" else (int(device.split(":")[1]),)


def _lanes(trace) -> list[tuple[str, int]]:
    """The (device, stream) rows of the timeline, host on top; "host" is always there."""
    lanes = {(e.device, e.stream) for e in trace if e.kind != "nvtx"} | {("host", 0)}
    return sorted(lanes, key=lambda lane: (_device_key(lane[0]), lane[1]))


def _lane_label(device: str, stream: int) -> str:
    if device == "nvtx":
        return "NVTX" if stream == 0 else f"NVTX depth {stream}"
    if device == "host" and stream:
        return f"host thread {stream}"
    return device if stream == 0 else f"{device} s{stream}"


def _nvtx_rows(trace) -> list[tuple[str, int]]:
    """One row per nesting depth of the NVTX ranges, outermost first."""
    return [("nvtx", depth) for depth in sorted({e.stream for e in trace if e.kind == "nvtx"})]


def _draw_nvtx(ax, trace, row, per_unit, span_ns) -> None:
    """Each range as a bar with its name when there is room; each mark as a dashed line with its name."""
    label, colour = NVTX
    mark_label = "NVTX mark"
    for e in (e for e in trace if e.kind == "nvtx"):
        y = row[("nvtx", e.stream)]
        if e.duration_ns == 0:
            ax.plot([e.start_ns / per_unit] * 2, [y - 0.45, y + 0.45], color=colour, linestyle="--",
                    label=mark_label)
            ax.text(e.start_ns / per_unit, y - 0.45, f" {e.name}", ha="left", va="bottom",
                    fontsize=7, color=colour, clip_on=True)
            mark_label = None
            continue
        ax.broken_barh([(e.start_ns / per_unit, e.duration_ns / per_unit)], (y - 0.4, 0.8),
                       facecolors=colour, alpha=0.55, edgecolor=colour, label=label)
        label = None
        if e.duration_ns > 0.05 * span_ns:
            ax.text((e.start_ns + e.end_ns) / 2 / per_unit, y, e.name, ha="center", va="center",
                    fontsize=8, clip_on=True)


def plot_timeline(trace, ax=None, title=None, start_ms=None, end_ms=None):
    """A Gantt chart of the trace: one row per GPU stream, plus the host; white space is idle time.

    `start_ms`/`end_ms` zoom in on part of the run. Spans under half a millisecond are drawn in µs
    so short runs stay readable. Returns the matplotlib Axes.
    """
    trace = _check(trace)
    import matplotlib.pyplot as plt  # here, not at the top: pyplot takes a second to import

    lanes = _lanes(trace)
    lanes = lanes[:1] + _nvtx_rows(trace) + lanes[1:]  # host, its NVTX ranges, then the GPUs
    row = {lane: i for i, lane in enumerate(lanes)}
    lo_ns = min(e.start_ns for e in trace) if start_ms is None else start_ms * 1e6
    hi_ns = max(e.end_ns for e in trace) if end_ms is None else end_ms * 1e6
    unit, per_unit = ("µs", 1e3) if hi_ns - lo_ns < 0.5e6 else ("ms", 1e6)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(lanes)), layout="constrained")

    for kind, (label, colour) in KINDS.items():
        events = [e for e in trace if _kind(e) == kind]
        for lane in lanes:
            bars = [(e.start_ns / per_unit, e.duration_ns / per_unit) for e in events
                    if (e.device, e.stream) == lane]
            if bars:
                ax.broken_barh(bars, (row[lane] - 0.4, 0.8), facecolors=colour, edgecolor="white",
                               linewidth=0.5, label=label, hatch="//" if kind == "host_blocked" else None)
                label = None  # one legend entry per kind
        for e in events:  # say where a copy goes (or comes from) when its bar has room
            if e.peer and e.duration_ns > 0.08 * (hi_ns - lo_ns):
                ax.text((e.start_ns + e.end_ns) / 2 / per_unit, row[(e.device, e.stream)],
                        f"← {e.peer}" if _copied_in(e, e.device) else f"→ {e.peer}",
                        ha="center", va="center", fontsize=8, clip_on=True)

    _draw_nvtx(ax, trace, row, per_unit, hi_ns - lo_ns)
    ax.set_yticks(range(len(lanes)), [_lane_label(*lane) for lane in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # host on top
    ax.set_xlim(lo_ns / per_unit, hi_ns / per_unit)
    ax.set_xlabel(f"simulated time ({unit})")
    ax.set_ylabel("device and stream")
    ax.set_title(title or "What each GPU did (white space = idle)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(lanes) < 4 else -0.15),
              ncol=len(ax.get_legend_handles_labels()[1]), frameon=False)
    return ax


def export_chrome_trace(trace, path):
    """Write the trace as Chrome trace event JSON, to open in Perfetto or chrome://tracing.

    Same format as `torch.profiler`'s export, so the emulated run and a real profile can be
    compared in the same viewer: one process per device, one thread per stream. Returns `path`.
    """
    trace = _check(trace)
    devices = sorted({e.device for e in trace} | {"host"}, key=_device_key)
    pid = {device: i for i, device in enumerate(devices)}
    meta = []
    for device in devices:
        meta.append({"ph": "M", "name": "process_name", "pid": pid[device], "args": {"name": device}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid[device],
                     "args": {"sort_index": pid[device]}})
    for device, stream in _lanes(trace):
        name = "host" if device == "host" else f"stream {stream}" + (" (default)" if stream == 0 else "")
        meta.append({"ph": "M", "name": "thread_name", "pid": pid[device], "tid": stream,
                     "args": {"name": name}})
    if any(e.kind == "nvtx" for e in trace):
        meta.append({"ph": "M", "name": "thread_name", "pid": pid["host"], "tid": NVTX_TID,
                     "args": {"name": "NVTX ranges"}})
    events = [_chrome_event(e, pid[e.device]) for e in trace]
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
    return path


def _chrome_event(e: TraceEvent, pid: int) -> dict:
    if e.kind == "nvtx":  # ranges nest by time on one thread; a mark is an instant
        if e.duration_ns == 0:
            return {"ph": "i", "s": "t", "name": e.name, "cat": "nvtx", "pid": pid, "tid": NVTX_TID,
                    "ts": e.start_ns / 1e3}
        return {"ph": "X", "name": e.name, "cat": "nvtx", "pid": pid, "tid": NVTX_TID,
                "ts": e.start_ns / 1e3, "dur": e.duration_ns / 1e3, "args": {"depth": e.stream}}
    return {"ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": e.stream,
            "ts": e.start_ns / 1e3, "dur": e.duration_ns / 1e3,
            "args": {"flops": e.flops, "bytes": e.bytes, "peer": e.peer}}


def _busy_ns(intervals) -> int:
    """Length of the union of (start, end) intervals, so overlapping streams count once."""
    return sum(end - start for start, end in merge_intervals(intervals))


def _copied_in(e: TraceEvent, device: str) -> bool:
    # a host copy sits on its GPU's lane with peer "cpu"; only its name says which way it went
    return e.peer == device or (e.device == device and e.peer == "cpu" and e.name.startswith("copy cpu"))


def _copied_out(e: TraceEvent, device: str) -> bool:
    return e.device == device and e.peer is not None and not _copied_in(e, device)


class Summary:
    """Per-GPU totals of a trace; prints as a text table and shows as an HTML table in Jupyter."""

    COLUMNS = [  # (header, key in a row, format)
        ("device", "device", "{}"),
        ("busy (ms)", "busy_ms", "{:.3f}"),
        ("idle (ms)", "idle_ms", "{:.3f}"),
        ("utilisation (%)", "utilisation_pct", "{:.1f}"),
        ("kernels", "kernels", "{}"),
        ("GFLOP", "flops", "{:.2f}"),
        ("copied in (MB)", "bytes_in", "{:.2f}"),
        ("copied out (MB)", "bytes_out", "{:.2f}"),
    ]
    SCALE = {"flops": 1e-9, "bytes_in": 1e-6, "bytes_out": 1e-6}

    def __init__(self, rows: list[dict], span_ms: float):
        self.rows = rows
        self.span_ms = span_ms

    def _cells(self) -> list[list[str]]:
        return [[fmt.format(row[key] * self.SCALE.get(key, 1)) for _, key, fmt in self.COLUMNS]
                for row in self.rows]

    def __str__(self) -> str:
        table = [[header for header, _, _ in self.COLUMNS]] + self._cells()
        widths = [max(len(line[i]) for line in table) for i in range(len(self.COLUMNS))]
        lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                           for i, (cell, w) in enumerate(zip(line, widths))) for line in table]
        return "\n".join([f"over {self.span_ms:.3f} ms of simulated time", *lines])

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(header)}</th>" for header, _, _ in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>"
                       for cells in self._cells())
        return (f"<table><caption>over {self.span_ms:.3f} ms of simulated time</caption>"
                f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def summary(trace) -> Summary:
    """Per GPU: how long it was busy or idle over the whole run, how many kernels, FLOPs and bytes moved.

    Idle time is what multi-GPU tuning hunts down, so it is measured over the span of the whole
    trace, host waits included: a GPU waiting on the others counts as idle.
    """
    trace = _check(trace)
    span_ns = max(e.end_ns for e in trace) - min(e.start_ns for e in trace)
    gpus = {e.device for e in trace if e.device != "host"}
    gpus |= {e.peer for e in trace if e.peer and e.peer.startswith("cuda")}
    rows = []
    for device in sorted(gpus, key=_device_key):
        mine = [e for e in trace if e.device == device]
        busy = _busy_ns((e.start_ns, e.end_ns) for e in mine)
        rows.append({
            "device": device,
            "busy_ms": busy / 1e6,
            "idle_ms": (span_ns - busy) / 1e6,
            "utilisation_pct": 100 * busy / span_ns if span_ns else 0.0,
            "kernels": sum(e.kind == "kernel" for e in mine),
            "flops": sum(e.flops for e in mine),
            "bytes_in": sum(e.bytes for e in trace if e.kind == "copy" and _copied_in(e, device)),
            "bytes_out": sum(e.bytes for e in trace if e.kind == "copy" and _copied_out(e, device)),
        })
    return Summary(rows, span_ns / 1e6)


def plot_memory_over_time(samples, ax=None, title=None, limit_bytes=None, label=None):
    """Memory allocated on one GPU through a training step, from samples the caller took along the way.

    The emulator's timeline shows when kernels run, not how much memory is held, and `memory_stats()` only
    gives the current value and the peak; a chapter about the memory of a training step needs the curve in
    between. `samples` are dicts with "ms" (simulated time; the x axis starts at the first sample's), "allocated" (`torch.cuda.memory_allocated()`),
    "peak" (`torch.cuda.max_memory_allocated()` since the previous sample, so a short-lived high point such as
    an optimizer's temporaries shows as a spike) and "phase" ("forward", "backward", "optimizer"...). Phases are
    shaded and named; `limit_bytes` draws a horizontal line (a memory cap); `label` names this curve in a legend,
    so two steps can share one Axes. Returns the Axes.
    """
    import matplotlib.pyplot as plt

    if not samples:
        raise ValueError("no memory samples to plot")
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.5), layout="constrained")
    origin = samples[0]["ms"]
    xs, ys = [0.0], [samples[0]["allocated"] / 2**20]
    for sample in samples[1:]:  # flat since the previous sample, up to the peak in between, down to the current value
        ms = sample["ms"] - origin
        xs += [ms, ms, ms]
        ys += [ys[-1], max(sample["peak"], sample["allocated"]) / 2**20, sample["allocated"] / 2**20]
    line, = ax.plot(xs, ys, linewidth=1.5, label=label)
    if label is None:  # one curve: shade its phases
        colours = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
        start = 0
        for index in range(1, len(samples) + 1):
            if index == len(samples) or samples[index]["phase"] != samples[start]["phase"]:
                phase = samples[start]["phase"]
                lo = (samples[start - 1]["ms"] if start else origin) - origin
                hi = samples[index - 1]["ms"] - origin
                ax.axvspan(lo, hi, color=colours.get(phase, "lightgray"), alpha=0.12, linewidth=0)
                ax.text((lo + hi) / 2, 1.01, phase, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                        fontsize=8)
                start = index
    top = max(ys)
    peak_at = xs[ys.index(top)]
    ax.plot([peak_at], [top], marker="v", color=line.get_color(), markersize=7)
    ax.annotate(f"peak {top:,.0f} MiB", (peak_at, top), textcoords="offset points", xytext=(6, 2), fontsize=8,
                color=line.get_color())
    if limit_bytes is not None:
        ax.axhline(limit_bytes / 2**20, color="tab:red", linestyle="--", linewidth=1, label="cap")
    ax.set_ylim(0, max(ax.get_ylim()[1], max(top, (limit_bytes or 0) / 2**20) * 1.15))  # room for every curve
    ax.set_xlabel("simulated time since the first sample (ms)")
    ax.set_ylabel("allocated (MiB)")
    ax.set_title(title or "Memory allocated during the step", pad=14)
    if label is not None or limit_bytes is not None:
        ax.legend(loc="upper left", fontsize=8)
    return ax
