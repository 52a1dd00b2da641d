"""course.planning: memory per strategy against the emulator's own counts, and simulated steps that behave."""
import pytest
import torch

import course
from course import planning

SMALL = planning.ModelSpec("small", num_blocks=4, d_model=256, d_hidden=1024, tokens_per_sample=16)


def test_parameter_bytes_match_the_emulated_model():
    with course.emulate(gpus=1, materialize=False, force=True):
        with torch.device("cuda:0"):
            model = planning._model(SMALL)
        allocated = torch.cuda.memory_allocated(0)
        del model
    assert allocated == planning.memory_per_gpu(SMALL, "data", 1, 1)["params"]


@pytest.mark.parametrize("strategy", planning.STRATEGIES)
def test_memory_total_is_the_sum_and_one_gpu_strategies_agree(strategy):
    table = planning.memory_per_gpu(SMALL, strategy, 1, 8)
    assert table["total"] == sum(v for k, v in table.items() if k != "total")
    assert table == planning.memory_per_gpu(SMALL, "data", 1, 8)


def test_splitting_shrinks_model_memory_but_data_parallel_keeps_a_whole_copy():
    data, pipe, tensor = (planning.memory_per_gpu(SMALL, s, 4, 8) for s in planning.STRATEGIES)
    assert data["params"] == SMALL.num_params * 2
    assert pipe["params"] == tensor["params"] == SMALL.num_params * 2 // 4
    assert data["activations"] < pipe["activations"] * 4 + 1


def test_unknown_strategy_is_named():
    with pytest.raises(ValueError, match="strategy must be one of"):
        planning.memory_per_gpu(SMALL, "diagonal", 2, 8)


@pytest.mark.parametrize("strategy", planning.STRATEGIES)
def test_simulated_steps_are_deterministic_and_use_every_gpu(strategy):
    first = planning.simulate_step(SMALL, strategy, 2, 8)
    second = planning.simulate_step(SMALL, strategy, 2, 8)
    assert first.step_ms == second.step_ms > 0
    assert {e.device for e in first.trace if e.kind == "kernel"} >= {"cuda:0", "cuda:1"}


def test_tensor_parallel_all_reduces_twice_per_block():
    step = planning.simulate_step(SMALL, "tensor", 2, 8)
    all_reduces = {e.start_ns for e in step.trace if e.name == "nccl:all_reduce"}
    assert len(all_reduces) == 2 * SMALL.num_blocks


def test_one_gpu_step_is_close_to_the_flop_count_for_a_compute_bound_model():
    spec = planning.ModelSpec("big", num_blocks=2, d_model=4096, d_hidden=16384, tokens_per_sample=1024)
    a100 = course.GPUS["A100-80GB"]
    ideal_ms = spec.flops_per_sample * 4 / (a100.peak_tflops["bf16"] * 1e12 * a100.matmul_efficiency) * 1e3
    assert planning.simulate_step(spec, "data", 1, 4).step_ms == pytest.approx(ideal_ms, rel=0.15)
