"""course.lessons.pipeline: multi-GPU timing, the GPipe schedule and bubble / overlap measured from the trace."""
import torch
import torch.nn as nn

import course
from course.lessons.pipeline import elapsed_ms, gpipe_schedule, measured_bubble, overlap_ns, plot_schedule
from course.machine.trace import TraceEvent


def _pipelined(x, stage1, stage2, micro_batches):
    return torch.cat([stage2(stage1(c.to("cuda:0")).to("cuda:1")) for c in x.tensor_split(micro_batches)])


def test_elapsed_ms_returns_the_plain_pytorch_result_and_waits_for_every_gpu():
    torch.manual_seed(0)
    stage1, stage2, x = nn.Linear(8, 8), nn.Linear(8, 3), torch.randn(5, 8)
    expected = stage2(stage1(x))
    with course.emulate(gpus=2) as emu:
        on0, on1 = nn.Linear(8, 8).to("cuda:0"), nn.Linear(8, 3).to("cuda:1")
        on0.load_state_dict(stage1.state_dict())
        on1.load_state_dict(stage2.state_dict())
        ms, out = elapsed_ms(lambda: on1(on0(x.to("cuda:0")).to("cuda:1")))
        last_end = max(e.end_ns for e in emu.trace)
        torch.testing.assert_close(out.cpu(), expected)
    assert ms > 0 and emu.clock.host_ns >= last_end  # the host waited for cuda:1 too, not only the current device


def test_gpipe_schedule_has_one_cell_per_stage_and_micro_batch_in_order():
    schedule = gpipe_schedule(3, 4)
    assert len(schedule) == 12 and max(t for _, _, t in schedule) == 3 + 4 - 2
    for s, i, t in schedule:
        if s > 0:
            assert (s - 1, i, t - 1) in schedule  # the previous stage finished this micro-batch one slot earlier
    assert len({(s, t) for s, _, t in schedule}) == 12  # a stage does one thing at a time


def test_plot_schedule_counts_the_idle_cells():
    figure = plot_schedule(2, 4)
    assert "2 of 10 cells idle" in figure.axes[0].get_title()


def test_measured_bubble_and_overlap_on_a_hand_made_trace():
    trace = [TraceEvent("kernel", "a", "cuda:0", 0, 0, 10), TraceEvent("kernel", "b", "cuda:1", 0, 5, 20),
             TraceEvent("host", "wait", "host", 0, 0, 20)]
    assert measured_bubble(trace, ["cuda:0", "cuda:1"]) == 1 - 25 / 40
    assert overlap_ns(trace, "cuda:0", "cuda:1") == 5


def test_pipelined_run_overlaps_and_its_bubble_follows_the_formula():
    with course.emulate(gpus=2, materialize=False) as emu:
        stage1 = nn.Linear(4096, 4096, device="cuda:0")
        stage2 = nn.Linear(4096, 4096, device="cuda:1")
        x = torch.randn(1024, 4096, device="cuda:0")
        torch.cuda.synchronize(0)
        before = len(emu.trace)
        elapsed_ms(_pipelined, x, stage1, stage2, 4)
        events = emu.trace[before:]
    assert overlap_ns(events, "cuda:0", "cuda:1") > 0
    assert abs(measured_bubble(events, ["cuda:0", "cuda:1"]) - 1 / 5) < 0.03
