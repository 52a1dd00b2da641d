"""course.lessons.planning and course.lessons.simulated_step: memory per plan against the emulator's own counts and the ZeRO paper,
and simulated steps that behave."""
import pytest
import torch

import course
from course.lessons import planning, simulated_step
from course.lessons.planning import Plan

SMALL = planning.ModelSpec("small", num_blocks=4, d_model=256, d_hidden=1024, tokens_per_sample=16)


def test_parameter_bytes_match_the_emulated_model():
    with course.emulate(gpus=1, materialize=False, force=True):
        with torch.device("cuda:0"):
            model = torch.nn.Sequential(*[simulated_step._Block(SMALL.d_model, SMALL.d_hidden, SMALL.dtype)
                                          for _ in range(SMALL.num_blocks)])
        allocated = torch.cuda.memory_allocated(0)
        del model
    assert allocated == planning.memory_per_gpu(SMALL, Plan(), 1)["params"]


SPLITS = [Plan("ddp", data_parallel=4), Plan(pipeline_stages=4), Plan(tensor_parallel=4)]


def test_memory_total_is_the_sum_and_one_gpu_plans_agree():
    for plan in (Plan(), Plan(pipeline_stages=1, micro_batches=3), Plan("fsdp", data_parallel=1)):
        table = planning.memory_per_gpu(SMALL, plan, 8)
        assert table["total"] == sum(v for k, v in table.items() if k != "total")
        assert table == planning.memory_per_gpu(SMALL, Plan(), 8)


def test_splitting_shrinks_model_memory_but_data_parallel_keeps_a_whole_copy():
    data, pipe, tensor = (planning.memory_per_gpu(SMALL, plan, 8) for plan in SPLITS)
    assert data["params"] == SMALL.num_params * 2
    assert pipe["params"] == tensor["params"] == SMALL.num_params * 2 // 4
    assert data["activations"] < pipe["activations"] * 4 + 1


def test_checkpointing_keeps_block_inputs_only():
    plain, kept = (planning.memory_per_gpu(SMALL, Plan(checkpointing=c), 8)["activations"] for c in (False, True))
    rows = 8 * SMALL.tokens_per_sample * 2
    assert kept == SMALL.num_blocks * rows * SMALL.d_model + rows * (SMALL.d_model + 2 * SMALL.d_hidden)
    assert plain == SMALL.num_blocks * rows * (SMALL.d_model + 2 * SMALL.d_hidden)


def test_bad_plans_are_named():
    with pytest.raises(ValueError, match="sharding must be one of"):
        Plan("diagonal", data_parallel=2)
    with pytest.raises(ValueError, match="tensor parallelism is simulated alone"):
        Plan(data_parallel=2, tensor_parallel=2)
    with pytest.raises(TypeError, match="plan must be a planning.Plan"):
        planning.memory_per_gpu(SMALL, "ddp", 8)
    with pytest.raises(ValueError, match="give node_link"):
        simulated_step.simulate_step(SMALL, Plan(data_parallel=4), 8, gpus_per_node=2)


@pytest.mark.parametrize("plan", SPLITS + [Plan("zero2", 2), Plan("fsdp", 2), Plan("fsdp", 2, 2, checkpointing=True)],
                         ids=str)
def test_simulated_steps_are_deterministic_and_use_every_gpu(plan):
    first = simulated_step.simulate_step(SMALL, plan, 8)
    simulated_step._simulate_step.cache_clear()
    second = simulated_step.simulate_step(SMALL, plan, 8)
    assert first.step_ms == second.step_ms > 0
    assert {e.device for e in first.trace if e.kind == "kernel"} == {f"cuda:{i}" for i in range(plan.num_gpus)}


def test_collectives_follow_the_zero_stage():
    counts = {}
    for sharding in planning.SHARDINGS:
        trace = simulated_step.simulate_step(SMALL, Plan(sharding, data_parallel=2), 8).trace
        names = [e.name for e in trace if e.kind == "collective" and e.device == "cuda:0"]
        counts[sharding] = {name: names.count(name) for name in set(names)}
    assert counts["ddp"] == {"nccl:all_reduce": 1}  # 4 MiB of gradients: one bucket
    assert counts["zero1"] == counts["zero2"] == {"nccl:reduce_scatter": 1, "nccl:all_gather": 1}
    # FSDP: every block all-gathered in forward and in backward, its gradients reduce-scattered
    assert counts["fsdp"] == {"nccl:all_gather": 2 * SMALL.num_blocks, "nccl:reduce_scatter": SMALL.num_blocks}


def test_a_data_parallel_group_across_nodes_runs_at_the_node_link():
    within = simulated_step.simulate_step(SMALL, Plan(data_parallel=4), 8, link="nvlink3")
    across = simulated_step.simulate_step(SMALL, Plan(data_parallel=4), 8, link="nvlink3", gpus_per_node=2,
                                    node_link="pcie3")
    assert across.step_ms > within.step_ms


def test_tensor_parallel_all_reduces_twice_per_block():
    step = simulated_step.simulate_step(SMALL, Plan(tensor_parallel=2), 8)
    all_reduces = {e.start_ns for e in step.trace if e.name == "nccl:all_reduce"}
    assert len(all_reduces) == 2 * SMALL.num_blocks


def test_one_gpu_step_matmuls_match_the_flop_count_and_adam_adds_memory_bound_work():
    spec = planning.ModelSpec("big", num_blocks=2, d_model=4096, d_hidden=16384, tokens_per_sample=1024)
    a100 = course.GPUS["A100-80GB"]
    ideal_ms = spec.flops_per_sample * 4 / (a100.peak_tflops["bf16"] * 1e12 * a100.matmul_efficiency) * 1e3
    step = simulated_step.simulate_step(spec, Plan(), 4)
    matmul_ms = sum(e.duration_ns for e in step.trace if e.name == "aten::mm" and e.device == "cuda:0") / 1e6
    assert matmul_ms == pytest.approx(ideal_ms, rel=0.15)
    adam = {e.name for e in step.trace if e.name.startswith("aten::_foreach")}
    assert {"aten::_foreach_addcdiv_", "aten::_foreach_copy_"} <= adam  # Adam on the masters, then copied back
    assert step.step_ms > ideal_ms


def test_mixed_precision_adam_is_16_bytes_per_parameter_and_fp32_is_16_too():
    table = planning.memory_per_gpu(SMALL, Plan(), 1)
    params = SMALL.num_params
    assert (table["params"], table["grads"], table["master"], table["optimizer"]) == (2 * params, 2 * params,
                                                                                     4 * params, 8 * params)
    fp32 = planning.memory_per_gpu(planning.ModelSpec("f", 4, 256, 1024, 16, torch.float32), Plan(), 1)
    assert (fp32["params"], fp32["grads"], fp32["master"], fp32["optimizer"]) == (4 * params, 4 * params, 0,
                                                                                 8 * params)


def test_zero_stages_shard_what_the_paper_says():
    spec = planning.ModelSpec("capstone", 16, 6144, 24576, 1024)
    psi, gib = spec.num_params, 2**30
    stages = [planning.memory_per_gpu(spec, Plan(sharding, data_parallel=8), 32) for sharding in planning.SHARDINGS]
    model_states = [t["params"] + t["grads"] + t["master"] + t["optimizer"] for t in stages]
    # (2 + 2 + K) psi, (2 + 2 + K/N) psi, (2 + (2 + K)/N) psi, (2 + 2 + K) psi / N with K = 12, N = 8
    # (stage 3 plus the all-gathered weights of two blocks and one block's gradients, 6 bytes per block parameter)
    for got, bytes_per_param in zip(model_states, (16, 4 + 12 / 8, 2 + 14 / 8, 16 / 8 + 6 / spec.num_blocks)):
        assert got / gib == pytest.approx(bytes_per_param * psi / gib, abs=0.01)


def test_mixed_precision_adam_updates_like_fp32_adam_on_the_masters():
    torch.manual_seed(0)
    reference = torch.nn.Linear(8, 4)
    with course.emulate(gpus=1):
        model = torch.nn.Linear(8, 4).to("cuda:0", torch.bfloat16)
        with torch.no_grad():
            for p, r in zip(model.parameters(), reference.parameters()):
                p.copy_(r.to(torch.bfloat16))
        optimizer = simulated_step.MixedPrecisionAdam(model.parameters(), lr=0.1)
        masters = [m.detach().clone().cpu() for m in optimizer.masters]
        x = torch.randn(16, 8)
        model(x.to("cuda:0", torch.bfloat16)).float().square().mean().backward()
        grads = [p.grad.float().cpu() for p in model.parameters()]
        optimizer.step()
        updated = [m.detach().cpu() for m in optimizer.masters]
        weights = [p.detach().cpu() for p in model.parameters()]
    expected = [m.clone().requires_grad_() for m in masters]
    for m, g in zip(expected, grads):
        m.grad = g
    torch.optim.Adam(expected, lr=0.1).step()
    for got, want, weight in zip(updated, expected, weights):
        assert torch.allclose(got, want.detach(), atol=1e-6)
        assert torch.equal(weight, want.detach().to(torch.bfloat16))
