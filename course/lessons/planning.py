"""Planning a training job: a model (`ModelSpec`), a way to spread it over GPUs (`Plan`), and its memory per GPU.

The capstone describes a model as a stack of MLP blocks and a plan as data parallel with ZeRO stage 0-3 (DDP,
ZeRO-1, ZeRO-2, FSDP), a pipeline of stages, tensor parallelism, or a hybrid (a data-parallel group of GPUs in every
pipeline stage), with or without activation checkpointing. Memory comes from counting bytes here; the step time of
a plan from `course.lessons.simulated_step`, which runs it on the emulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from course.machine import hardware

SHARDINGS = ("ddp", "zero1", "zero2", "fsdp")  # ZeRO stage 0, 1, 2, 3 of a data-parallel group
ADAM_STATE_BYTES_PER_PARAM = 8  # Adam's two fp32 moments per parameter (exp_avg, exp_avg_sq)
MASTER_WEIGHT_BYTES_PER_PARAM = 4  # mixed precision: an fp32 copy of every fp16/bf16 weight, the one Adam updates
GiB = 2**30


@dataclass(frozen=True)
class ModelSpec:
    """`num_blocks` blocks of gelu(x W1) W2 (W1: d_model x d_hidden, W2: d_hidden x d_model, no bias).

    A sample is `tokens_per_sample` rows of width d_model (a sequence of tokens).
    """

    name: str
    num_blocks: int
    d_model: int
    d_hidden: int
    tokens_per_sample: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def block_params(self) -> int:
        return 2 * self.d_model * self.d_hidden

    @property
    def num_params(self) -> int:
        return self.num_blocks * self.block_params

    @property
    def flops_per_sample(self) -> int:
        """Forward and backward: 2 FLOPs per parameter per token forward, twice that backward."""
        return 6 * self.num_params * self.tokens_per_sample

    @property
    def activation_bytes_per_sample(self) -> int:
        """What backward needs per sample and block: the block's input, and the hidden layer before and after gelu."""
        return self.num_blocks * self.tokens_per_sample * (self.d_model + 2 * self.d_hidden) * self.element_bytes


@dataclass(frozen=True)
class Plan:
    """How a job spreads over `data_parallel` x `pipeline_stages` x `tensor_parallel` GPUs.

    Each pipeline stage holds consecutive blocks and is run by a data-parallel group of `data_parallel` GPUs that
    share its model states as `sharding` says (ZeRO stage 0-3). Tensor parallelism splits every block; it is
    simulated alone (one NVLink domain), not combined with the other two. `checkpointing` recomputes each block's
    activations in backward (`torch.utils.checkpoint`) instead of keeping them. A pipeline runs GPipe with
    `micro_batches` (default: twice the stages).
    """

    sharding: str = "ddp"
    data_parallel: int = 1
    pipeline_stages: int = 1
    tensor_parallel: int = 1
    checkpointing: bool = False
    micro_batches: int | None = None

    def __post_init__(self):
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}; got {self.sharding!r}")
        if min(self.data_parallel, self.pipeline_stages, self.tensor_parallel) < 1:
            raise ValueError(f"data_parallel, pipeline_stages and tensor_parallel must be 1 or more; got {self}")
        if self.tensor_parallel > 1 and self.data_parallel * self.pipeline_stages > 1:
            raise ValueError("tensor parallelism is simulated alone: give data_parallel=1 and pipeline_stages=1 "
                             "with tensor_parallel > 1")

    @property
    def num_gpus(self) -> int:
        return self.data_parallel * self.pipeline_stages * self.tensor_parallel

    @property
    def zero_stage(self) -> int:
        return SHARDINGS.index(self.sharding) if self.data_parallel > 1 else 0

    @property
    def num_micro_batches(self) -> int:
        return (self.micro_batches or 2 * self.pipeline_stages) if self.pipeline_stages > 1 else 1

    def __str__(self) -> str:
        parts = []
        if self.tensor_parallel > 1:
            parts.append(f"tensor parallel x{self.tensor_parallel}")
        if self.data_parallel > 1:
            parts.append(f"{self.sharding} x{self.data_parallel}")
        if self.pipeline_stages > 1:
            parts.append(f"pipeline x{self.pipeline_stages}")
        text = " in each of ".join(parts) if parts else "one GPU"
        return text + (" + checkpointing" if self.checkpointing else "")


def check_job(spec: ModelSpec, plan: Plan, global_batch: int) -> None:
    """Refuse arguments of the wrong kind with a message that says what to pass."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a planning.ModelSpec; got {type(spec).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a planning.Plan, e.g. Plan('fsdp', data_parallel=8) or Plan(pipeline_stages=4); "
                        f"got {plan!r}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be 1 or more; got {global_batch}")


def master_bytes_per_param(spec: ModelSpec) -> int:
    """fp32 master weights per parameter: 4 bytes when the model trains in fp16 or bf16, none in fp32."""
    return MASTER_WEIGHT_BYTES_PER_PARAM if spec.element_bytes < 4 else 0


def memory_per_gpu(spec: ModelSpec, plan: Plan, global_batch: int) -> dict[str, int]:
    """Bytes on the busiest GPU: parameters, gradients, fp32 master weights, Adam's moments, activations, total.

    Mixed-precision Adam (ZeRO paper, Rajbhandari et al. 2020, section 3.1): 2 bytes of fp16/bf16 weights, 2 of
    gradients, and K = 12 of optimizer state (4 of fp32 master weights, 4 + 4 of Adam's moments): 16 bytes per
    parameter. A model trained in fp32 needs no master copy: 4 + 4 + 8.

    A GPU holds ceil(blocks / stages) blocks, each split tensor_parallel ways; its data-parallel group of N GPUs
    shards the optimizer state from ZeRO stage 1, the gradients from stage 2 and the weights from stage 3 (each
    GPU keeps ceil(1/N)). Stage 3 (FSDP) also holds, while it computes, the all-gathered weights of two blocks (the
    one running and the one prefetched) and one block's unsharded gradients.

    Activations: ceil(batch / data_parallel) samples of the GPU's blocks; a GPipe stage keeps all its micro-batches'
    until backward; tensor parallelism keeps the block inputs whole and 1/n of the hidden layer. With checkpointing
    only each block's input is kept, plus one block's full activations (one micro-batch's) while it is recomputed.
    """
    check_job(spec, plan, global_batch)
    blocks = math.ceil(spec.num_blocks / plan.pipeline_stages)
    hidden = math.ceil(spec.d_hidden / plan.tensor_parallel)
    params = blocks * 2 * spec.d_model * hidden
    samples = math.ceil(global_batch / plan.data_parallel)
    rows_per_sample = spec.tokens_per_sample * spec.element_bytes
    block_activations = rows_per_sample * (spec.d_model + 2 * hidden)
    if plan.checkpointing:
        micro_batch = math.ceil(samples / plan.num_micro_batches)
        activations = samples * blocks * rows_per_sample * spec.d_model + micro_batch * block_activations
    else:
        activations = samples * blocks * block_activations
    n, stage = plan.data_parallel, plan.zero_stage
    table = {"params": params * spec.element_bytes, "grads": params * spec.element_bytes,
             "master": params * master_bytes_per_param(spec), "optimizer": params * ADAM_STATE_BYTES_PER_PARAM}
    for key, from_stage in (("master", 1), ("optimizer", 1), ("grads", 2), ("params", 3)):
        if stage >= from_stage:
            table[key] = math.ceil(table[key] / n)
    if stage == 3:
        block_bytes = 2 * spec.d_model * hidden * spec.element_bytes
        table["params"] += 2 * block_bytes
        table["grads"] += block_bytes
    table["activations"] = activations
    table["total"] = sum(table.values())
    return table


def fits(spec: ModelSpec, plan: Plan, global_batch: int, gpu="A100-80GB") -> bool:
    """Whether `memory_per_gpu(...)["total"]` fits in one GPU of the preset."""
    return memory_per_gpu(spec, plan, global_batch)["total"] <= hardware.gpu(gpu).memory_bytes
