"""The GPU columns of a `torch.profiler` table, so a notebook can show where GPU time goes, identically every run.

`prof.key_averages().table(...)` mixes CPU wall times (on the emulator: this laptop running the emulated ops, not a
GPU box's host, and different on every run) with the CUDA times of the GPU work (simulated, so deterministic).
`gpu_columns` keeps the name, the CUDA columns and the call count, and the rows that ran GPU work.
"""
from __future__ import annotations

import re

_TIME_UNITS_US = {"s": 1e6, "ms": 1e3, "us": 1.0}


def _spans(dash_line: str) -> list[tuple[int, int | None]]:
    """Each column from the start of its dashes to the start of the next (headers may run into the gap)."""
    starts = [match.start() for match in re.finditer(r"-+", dash_line)]
    return list(zip(starts, starts[1:] + [None]))


def _microseconds(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(s|ms|us)", text.strip()).groups()
    return float(number) * _TIME_UNITS_US[unit]


def gpu_columns(table: str) -> str:
    """`table` (from `EventList.table`) without its CPU columns, CPU footer and rows that ran no GPU work.

    Rows are ordered by CUDA total, largest first, as `sort_by="cuda_time_total"` orders them; rows with equal
    totals (an op and the kernel it launched) by name, so the order never depends on CPU timings.
    """
    lines = table.rstrip("\n").split("\n")
    dash_rows = [i for i, line in enumerate(lines) if line.startswith("-") and set(line.strip()) <= {"-", " "}]
    if len(dash_rows) < 3:
        raise ValueError("gpu_columns expects the text of prof.key_averages().table(...): a header between two "
                         "lines of dashes, the rows, and a closing line of dashes")
    spans = _spans(lines[dash_rows[0]])
    header = [lines[dash_rows[0] + 1][start:end].strip() for start, end in spans]
    if "CUDA total" not in header:
        raise ValueError("this table has no 'CUDA total' column: profile with "
                         "activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]")
    keep = [k for k, name in enumerate(header) if "CPU" not in name]
    total = header.index("CUDA total")

    def cells(line: str) -> list[str]:
        return [line[start:end] for start, end in spans]

    def join(parts: list[str]) -> str:
        return "".join(parts[k] for k in keep).rstrip()

    rows = [cells(line) for line in lines[dash_rows[1] + 1:dash_rows[2]]]
    rows = [row for row in rows if _microseconds(row[total]) > 0]
    rows.sort(key=lambda row: (-_microseconds(row[total]), row[0].strip()))
    dashes = join(cells(lines[dash_rows[0]]))
    footer = [line for line in lines[dash_rows[2] + 1:] if line.strip() and "CPU" not in line]
    return "\n".join([dashes, join(cells(lines[dash_rows[0] + 1])), dashes, *map(join, rows), dashes, *footer])
