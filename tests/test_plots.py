"""Checks the timeline, Chrome trace and summary against traces from real runs under `course.emulate`."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import course  # noqa: E402
from course import export_chrome_trace, plot_timeline, summary  # noqa: E402
from course.machine.plots import _kind  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def two_gpus():
    """A copy between GPUs, work on each, a second stream on cuda:0, and a wait on the host."""
    with course.emulate(gpus=2) as emu:
        a = torch.randn(64, 64, device="cuda:0")
        b = a.to("cuda:1")
        c = b @ b
        side = torch.cuda.Stream(device="cuda:0")
        with torch.cuda.stream(side):
            a @ a
        a + a
        c.sum().item()
        torch.cuda.synchronize()
    return emu


@pytest.fixture(scope="module")
def overlapping_streams():
    """Two big matmuls on two streams of one GPU (shapes only, so it is quick): they partly overlap."""
    with course.emulate(gpus=1, materialize=False) as emu:
        a = torch.empty(4096, 4096, device="cuda:0")
        b = torch.empty(4096, 4096, device="cuda:0")
        side = torch.cuda.Stream(device="cuda:0")
        with torch.cuda.stream(side):
            a @ a
        b @ b
        torch.cuda.synchronize()
    return emu


def lane_label(e):
    return e.device if e.stream == 0 else f"{e.device} s{e.stream}"


def test_timeline_has_a_row_per_lane_and_a_bar_per_event(two_gpus):
    trace = two_gpus.trace
    ax = plot_timeline(trace, title="two GPUs")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "host"
    assert set(labels) == {lane_label(e) for e in trace} | {"host"}
    assert len(labels) == len(set(labels))
    assert "cuda:0 s1" in labels
    assert sum(len(c.get_paths()) for c in ax.collections) == len(trace)
    assert ax.get_title() == "two GPUs"
    assert ax.get_xlabel() == "simulated time (µs)"  # this small run takes well under 0.5 ms
    assert ax.get_ylabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == len({_kind(e) for e in trace})  # a host wait for a copy has its own entry


def test_timeline_switches_to_milliseconds_and_zooms(overlapping_streams):
    ax = overlapping_streams.plot_timeline()
    assert ax.get_xlabel() == "simulated time (ms)"
    assert ax.get_title()
    ax = overlapping_streams.plot_timeline(start_ms=0, end_ms=0.1)
    assert ax.get_xlim() == (0, 100)
    assert ax.get_xlabel() == "simulated time (µs)"


def test_chrome_trace_has_one_complete_event_per_trace_event(two_gpus, tmp_path):
    trace = two_gpus.trace
    path = tmp_path / "trace.json"
    assert two_gpus.export_chrome_trace(path) == path
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(trace)
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    for ours, theirs in zip(trace, complete):
        assert theirs["name"] == ours.name and theirs["cat"] == ours.kind
        assert theirs["ts"] == pytest.approx(ours.start_ns / 1e3)
        assert theirs["dur"] == pytest.approx(ours.duration_ns / 1e3)
        assert processes[theirs["pid"]] == ours.device
        assert (theirs["pid"], theirs["tid"]) in threads
        assert theirs["args"] == {"flops": ours.flops, "bytes": ours.bytes, "peer": ours.peer}
    assert set(processes.values()) == {"host", "cuda:0", "cuda:1"}


def test_summary_busy_time_of_a_single_stream_gpu_is_the_sum_of_its_events(two_gpus):
    trace = two_gpus.trace
    mine = sorted((e for e in trace if e.device == "cuda:1"), key=lambda e: e.start_ns)
    assert {e.stream for e in mine} == {0}
    assert all(a.end_ns <= b.start_ns for a, b in zip(mine, mine[1:]))  # one stream: no overlap
    span_ns = max(e.end_ns for e in trace) - min(e.start_ns for e in trace)
    row = next(r for r in two_gpus.summary().rows if r["device"] == "cuda:1")
    busy_ns = sum(e.duration_ns for e in mine)
    assert row["busy_ms"] == pytest.approx(busy_ns / 1e6)
    assert row["idle_ms"] == pytest.approx((span_ns - busy_ns) / 1e6)
    assert row["utilisation_pct"] == pytest.approx(100 * busy_ns / span_ns)
    assert row["kernels"] == sum(e.kind == "kernel" for e in mine)
    assert row["flops"] == sum(e.flops for e in mine) == 2 * 64**3
    assert row["bytes_in"] == 64 * 64 * 4  # `a` came over from cuda:0
    assert row["bytes_out"] == 4  # the scalar .item() read back
    cuda0 = next(r for r in summary(trace).rows if r["device"] == "cuda:0")
    assert cuda0["bytes_out"] == 64 * 64 * 4


def test_summary_counts_overlapping_streams_once(overlapping_streams):
    trace = overlapping_streams.trace
    (row,) = summary(trace).rows
    on_gpu = [e for e in trace if e.device == "cuda:0"]
    s0, s1 = ([e for e in on_gpu if e.stream == s] for s in (0, 1))
    assert max(e.start_ns for e in s0) < max(e.end_ns for e in s1)  # the two streams overlap
    busy_ns = row["busy_ms"] * 1e6
    assert busy_ns < sum(e.duration_ns for e in on_gpu)
    # independently: cut time at every event edge and add up the pieces some event covers
    edges = sorted({t for e in on_gpu for t in (e.start_ns, e.end_ns)})
    covered = sum(hi - lo for lo, hi in zip(edges, edges[1:])
                  if any(e.start_ns <= lo and hi <= e.end_ns for e in on_gpu))
    assert busy_ns == pytest.approx(covered)


def test_summary_prints_as_text_and_html(two_gpus):
    table = two_gpus.summary()
    text = str(table)
    assert "busy (ms)" in text and "utilisation (%)" in text
    assert len(text.splitlines()) == 2 + len(table.rows)  # a caption, a header, a line per GPU
    html = table._repr_html_()
    assert html.count("<tr>") == 1 + len(table.rows) and "<th>busy (ms)</th>" in html


def test_empty_trace_says_nothing_ran(tmp_path):
    for show in (plot_timeline, summary, lambda t: export_chrome_trace(t, tmp_path / "t.json")):
        with pytest.raises(ValueError, match="nothing ran on the emulated GPUs yet"):
            show([])
    with course.emulate(gpus=1) as emu:
        pass
    with pytest.raises(ValueError, match="nothing ran"):
        emu.plot_timeline()


def test_memory_over_time_draws_the_samples_and_marks_the_highest_point():
    """Samples of a real emulated step: the curve passes through every allocated value and peaks where the
    step's max_memory_allocated says, each phase is shaded once, and a cap is drawn where asked."""
    samples = []

    def sample(phase):
        samples.append({"ms": emu.now_ms(),
                        "allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated(),
                        "phase": phase})
        torch.cuda.reset_peak_memory_stats()

    with course.emulate(gpus=1, materialize=False) as emu:
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).cuda()
        x = torch.empty(256, 512, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        sample("forward")
        loss = model(x).square().mean()
        sample("forward")
        loss.backward()
        sample("backward")
        del loss
        sample("optimizer")
    ax = course.machine.plots.plot_memory_over_time(samples, limit_bytes=64 * 2**20)
    line = ax.lines[0]
    ys = list(line.get_ydata())
    for s in samples:
        assert s["allocated"] / 2**20 in ys
    assert max(ys) == pytest.approx(max(max(s["peak"], s["allocated"]) for s in samples) / 2**20)
    assert [t.get_text() for t in ax.texts if t.get_text() in ("forward", "backward", "optimizer")] == \
        ["forward", "backward", "optimizer"]
    assert any(t.get_text().startswith("peak ") for t in ax.texts)
    assert any(l.get_label() == "cap" for l in ax.lines)
    with pytest.raises(ValueError, match="no memory samples"):
        course.machine.plots.plot_memory_over_time([])
