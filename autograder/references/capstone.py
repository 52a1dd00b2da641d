"""Reference answers for the capstone notebook (chapter 10; hidden from learners, see autograder/README.md)."""
from __future__ import annotations

import dataclasses

from course.lessons import planning
from course.lessons.simulated_step import simulate_step
from course.lessons.planning import Plan


def largest_batch(spec, plan, gpu, limit=4096):
    """The largest global batch (1..limit) whose memory fits one GPU of the preset under `plan`; 0 if none."""
    best = 0
    for batch in range(1, limit + 1):
        if not planning.fits(spec, plan, batch, gpu):
            break
        best = batch
    return best


def candidate_plans(num_gpus, gpus_per_node=None):
    """The plans the exercise names, each with and without activation checkpointing: every sharding over all GPUs,
    a pipeline of one GPU per stage, tensor parallelism only within one node, and with several nodes DDP or FSDP
    within each node and a pipeline stage per node."""
    gpus_per_node = gpus_per_node or num_gpus
    plans = [Plan(sharding, data_parallel=num_gpus) for sharding in planning.SHARDINGS] if num_gpus > 1 else [Plan()]
    if num_gpus > 1:
        plans.append(Plan(pipeline_stages=num_gpus))
        if num_gpus <= gpus_per_node:
            plans.append(Plan(tensor_parallel=num_gpus))
    nodes = num_gpus // gpus_per_node
    if nodes > 1 and gpus_per_node > 1:
        plans += [Plan(sharding, data_parallel=gpus_per_node, pipeline_stages=nodes) for sharding in ("ddp", "fsdp")]
    return plans + [dataclasses.replace(plan, checkpointing=True) for plan in plans]


def plan_job(spec, num_gpus, global_batch, gpu, link, gpus_per_node=None, node_link=None):
    """The fitting candidate plan with the smallest simulated step: {"plan", "step_ms", "memory_gib"}, or None."""
    best = None
    for plan in candidate_plans(num_gpus, gpus_per_node):
        if not planning.fits(spec, plan, global_batch, gpu):
            continue
        step_ms = simulate_step(spec, plan, global_batch, gpu, link, gpus_per_node, node_link).step_ms
        if best is None or step_ms < best["step_ms"]:
            memory = planning.memory_per_gpu(spec, plan, global_batch)["total"] / planning.GiB
            best = {"plan": plan, "step_ms": step_ms, "memory_gib": memory}
    return best
