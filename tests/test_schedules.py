"""course.lessons.schedules: torch.distributed.pipelining schedules on emulated GPUs, their replay at full size, the picture."""
import copy

import pytest
import torch
import torch.nn as nn

import course
from course.lessons.schedules import most_in_flight, plot_runs, replay, run_pipelining, split_model, stage_gpu


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    return model, torch.randn(8, 16), torch.randn(8, 16)


@pytest.mark.parametrize("schedule, virtual", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)])
def test_run_pipelining_gives_the_single_device_loss_and_gradients(schedule, virtual):
    model, x, y = _model_and_data()
    whole = copy.deepcopy(model)
    loss = nn.functional.mse_loss(whole(x), y)
    loss.backward()
    with course.emulate(gpus=2):
        ranks = run_pipelining(model, x, y, 2, schedule, 4, virtual)
    grads = {name: grad for rank in ranks for name, grad in rank["grads"].items()}
    assert set(grads) == {name for name, _ in whole.named_parameters()}
    for name, param in whole.named_parameters():
        torch.testing.assert_close(grads[name], param.grad)
    torch.testing.assert_close(torch.stack(ranks[-1]["losses"]).mean(), loss)
    for gpu, rank in enumerate(ranks):  # every stage of the GPU ran forward and backward once per micro-batch
        mine = [s for s in range(2 * virtual) if stage_gpu(s, 2) == gpu]
        assert sorted(rank["actions"]) == sorted((k, s, i) for k in "FB" for s in mine for i in range(4))


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p_minus_s():
    model, x, y = _model_and_data()
    with course.emulate(gpus=2):
        gpipe = run_pipelining(model, x, y, 2, "GPipe", 4)
        one_f_one_b = run_pipelining(model, x, y, 2, "1F1B", 4)
    assert [most_in_flight(rank["actions"]) for rank in gpipe] == [4, 4]
    assert [most_in_flight(rank["actions"]) for rank in one_f_one_b] == [2, 1]


def test_run_pipelining_refuses_a_mismatched_virtual_count_and_running_outside_the_emulator():
    model, x, y = _model_and_data()
    with pytest.raises(RuntimeError, match="course.emulate"):
        run_pipelining(model, x, y, 2, "1F1B", 4)
    with course.emulate(gpus=2), pytest.raises(ValueError, match="virtual"):
        run_pipelining(model, x, y, 2, "Interleaved1F1B", 4, virtual=1)
    with pytest.raises(ValueError, match="5 stages"):
        split_model(nn.Sequential(nn.Linear(2, 2)), 5)


def _replayed(actions, virtual=1):
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    with course.emulate(gpus=2, materialize=False):
        stages = []
        for index, part in enumerate(split_model(model, 2 * virtual)):
            stages.append(part.to_empty(device=f"cuda:{stage_gpu(index, 2)}"))
        micro_batches = [torch.randn(256, 1024, device="cuda:0") for _ in range(4)]
        return replay("test", actions, stages, micro_batches)


def test_replay_measures_memory_held_by_micro_batches_in_flight_and_is_deterministic():
    gpipe = [[("F", s, i) for i in range(4)] + [("B", s, i) for i in range(4)] for s in range(2)]
    one_f_one_b = [[("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3), ("B", 0, 2),
                    ("B", 0, 3)],
                   [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2), ("F", 1, 3),
                    ("B", 1, 3)]]
    first, again, lean = _replayed(gpipe), _replayed(gpipe), _replayed(one_f_one_b)
    assert first.spans == again.spans and first.memory == again.memory
    assert [first.in_flight(g) for g in range(2)] == [4, 4] and [lean.in_flight(g) for g in range(2)] == [2, 1]
    for g in range(2):  # memory held grows with micro-batches in flight: m of them against p - s
        assert first.most_held_bytes(g) == 4 * first.micro_batch_bytes[g]
        assert lean.most_held_bytes(g) == lean.in_flight(g) * lean.micro_batch_bytes[g]
        assert first.memory[g][-1][1] == 0  # every activation freed after its backward
    stage1_forward_starts = [s.start_ms for s in first.spans if s.gpu == 1 and s.kind == "F"]
    stage0_forward_ends = [s.end_ms for s in first.spans if s.gpu == 0 and s.kind == "F"]
    assert all(start >= end for start, end in zip(stage1_forward_starts, stage0_forward_ends))
    assert 0 < first.bubble < 1 and abs(first.total_ms - lean.total_ms) / first.total_ms < 0.05


def test_replay_names_the_actions_of_a_schedule_that_cannot_finish():
    backwards_first = [[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]]
    with pytest.raises(RuntimeError, match="stuck"):
        _replayed([backwards_first[g] + [("F", g, i) for i in range(1, 4)] + [("B", g, i) for i in range(1, 4)]
                   for g in range(2)])


def test_plot_runs_draws_one_column_per_run_with_memory_below():
    gpipe = [[("F", s, i) for i in range(4)] + [("B", s, i) for i in range(4)] for s in range(2)]
    figure = plot_runs([_replayed(gpipe), _replayed(gpipe)])
    assert len(figure.axes) == 4 and "idle" in figure.axes[0].get_title()
    assert len(plot_runs([_replayed(gpipe)], memory=False).axes) == 1
