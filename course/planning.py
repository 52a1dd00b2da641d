"""Planning a training job: memory per GPU and simulated step time under data, pipeline or tensor parallelism.

The capstone describes a model as a stack of MLP blocks (`ModelSpec`) and asks which split of it fits a
machine and trains fastest. Memory comes from counting bytes; step time from running one training step of
the real-size model on the emulator in shape-only mode (`materialize=False`), so it costs no CPU time.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from course import hardware
from course.ddp_timing import simulate_ddp_step
from course.emulator import emulate
from course.pipeline import elapsed_ms

STRATEGIES = ("data", "pipeline", "tensor")
ADAM_STATE_BYTES_PER_PARAM = 8  # Adam keeps two fp32 moments per parameter
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
    def num_params(self) -> int:
        return self.num_blocks * 2 * self.d_model * self.d_hidden

    @property
    def flops_per_sample(self) -> int:
        """Forward and backward: 2 FLOPs per parameter per token forward, twice that backward."""
        return 6 * self.num_params * self.tokens_per_sample

    @property
    def activation_bytes_per_sample(self) -> int:
        """What backward needs per sample and block: the block's input, and the hidden layer before and after gelu."""
        return self.num_blocks * self.tokens_per_sample * (self.d_model + 2 * self.d_hidden) * self.element_bytes


def _check(strategy: str, num_gpus: int) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be 1 or more; got {num_gpus}")


def memory_per_gpu(spec: ModelSpec, strategy: str, num_gpus: int, global_batch: int) -> dict[str, int]:
    """Bytes on the busiest GPU: parameters, gradients, Adam states, activations, and their total.

    data: every GPU holds the whole model and ceil(batch / n) samples' activations.
    pipeline: GPU i holds ceil(blocks / n) whole blocks and, as GPipe keeps every micro-batch's
    activations until backward, those blocks' activations for the whole batch.
    tensor: every block's W1 columns and W2 rows are split n ways; each GPU keeps the block inputs for the
    whole batch and 1/n of the hidden activations.
    """
    _check(strategy, num_gpus)
    params = spec.num_params
    if strategy == "data":
        params_here = params
        activations = math.ceil(global_batch / num_gpus) * spec.activation_bytes_per_sample
    elif strategy == "pipeline":
        blocks_here = math.ceil(spec.num_blocks / num_gpus)
        params_here = params * blocks_here // spec.num_blocks
        activations = global_batch * spec.activation_bytes_per_sample * blocks_here // spec.num_blocks
    else:
        params_here = math.ceil(params / num_gpus)
        activations = (global_batch * spec.num_blocks * spec.tokens_per_sample * spec.element_bytes
                       * (spec.d_model + 2 * math.ceil(spec.d_hidden / num_gpus)))
    table = {"params": params_here * spec.element_bytes, "grads": params_here * spec.element_bytes,
             "optimizer": params_here * ADAM_STATE_BYTES_PER_PARAM, "activations": activations}
    table["total"] = sum(table.values())
    return table


def fits(spec: ModelSpec, strategy: str, num_gpus: int, global_batch: int, gpu="A100-80GB") -> bool:
    """Whether `memory_per_gpu(...)["total"]` fits in one GPU of the preset."""
    return memory_per_gpu(spec, strategy, num_gpus, global_batch)["total"] <= hardware.gpu(gpu).memory_bytes


class _Cast(nn.Module):
    """Turns simulate_ddp_step's float32 input into the model's dtype."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


class _Block(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, dtype):
        super().__init__()
        self.up = nn.Linear(d_model, d_hidden, bias=False, dtype=dtype)
        self.down = nn.Linear(d_hidden, d_model, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _model(spec: ModelSpec) -> nn.Module:
    return nn.Sequential(_Cast(spec.dtype), *[_Block(spec.d_model, spec.d_hidden, spec.dtype)
                                             for _ in range(spec.num_blocks)])


class _AllReduceSum(torch.autograd.Function):
    """Sum one tensor per GPU into every GPU (forward); backward all-reduces the gradients the same way."""

    @staticmethod
    def forward(ctx, *partials):
        # Outputs nobody uses get None, not zeros: autograd would make those zeros on the CPU, not on the GPU.
        ctx.set_materialize_grads(False)
        ctx.like = partials
        outputs = [p.clone() for p in partials]
        torch.cuda.nccl.all_reduce(outputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        grads = [torch.zeros_like(p) if g is None else g.clone() for g, p in zip(grads, ctx.like)]
        torch.cuda.nccl.all_reduce(grads)
        return tuple(grads)


@dataclass
class StepEstimate:
    """One simulated training step: its time and the emulator's trace for the timeline."""

    strategy: str
    num_gpus: int
    step_ms: float
    trace: list

    def plot_timeline(self, **kwargs):
        from course import plots

        kwargs.setdefault("title", f"one training step, {self.strategy} parallel on {self.num_gpus} GPUs")
        return plots.plot_timeline(self.trace, **kwargs)


@functools.lru_cache(maxsize=32)  # the same plan is often asked for twice: a table, then its timeline
def simulate_step(spec: ModelSpec, strategy: str, num_gpus: int, global_batch: int, gpu="A100-80GB",
                  link="nvlink3", micro_batches: int | None = None) -> StepEstimate:
    """Simulated time of one training step (forward, backward, SGD update) in shape-only mode.

    data: `simulate_ddp_step` with ceil(batch / n) samples per GPU (bucketed all-reduce overlapping backward).
    pipeline: blocks split into n consecutive stages, GPipe: all micro-batches forward (2 per stage by
    default), then one backward through all of them; activations travel between stages with `.to()`.
    tensor: Megatron-style split of every block, one all-reduce per block forward and one backward.
    """
    _check(strategy, num_gpus)
    rows = global_batch * spec.tokens_per_sample
    if strategy == "data":
        step = simulate_ddp_step(lambda: _model(spec), (math.ceil(global_batch / num_gpus) * spec.tokens_per_sample,
                                                        spec.d_model), num_gpus, gpu=gpu, link=link)
        return StepEstimate(strategy, num_gpus, step.step_ms, step.trace)
    with emulate(gpus=num_gpus, gpu=gpu, link=link, materialize=False, force=True) as emu:
        if strategy == "pipeline":
            stages = []
            for stage, blocks in enumerate(torch.tensor_split(torch.arange(spec.num_blocks), num_gpus)):
                with torch.device(f"cuda:{stage}"):
                    stages.append(nn.Sequential(*[_Block(spec.d_model, spec.d_hidden, spec.dtype) for _ in blocks]))
            parameters = [p for stage in stages for p in stage.parameters()]
            count = micro_batches or 2 * num_gpus
            inputs = [torch.empty(len(rows_part), spec.d_model, dtype=spec.dtype, device="cuda:0")
                      for rows_part in torch.arange(rows).tensor_split(count) if len(rows_part)]

            def step():
                losses = []
                for x in inputs:
                    for stage, module in enumerate(stages):
                        x = module(x.to(f"cuda:{stage}"))
                    losses.append(x.float().square().mean())
                torch.stack([loss.to("cuda:0") for loss in losses]).sum().backward()
                optimizer.step()
        else:
            shards = []
            for gpu_index in range(num_gpus):
                with torch.device(f"cuda:{gpu_index}"):
                    shards.append([_Block(spec.d_model, math.ceil(spec.d_hidden / num_gpus), spec.dtype)
                                   for _ in range(spec.num_blocks)])
            parameters = [p for blocks in shards for block in blocks for p in block.parameters()]
            inputs = [torch.empty(rows, spec.d_model, dtype=spec.dtype, device=f"cuda:{i}") for i in range(num_gpus)]

            def step():
                xs = inputs
                for index in range(spec.num_blocks):
                    partials = [shards[i][index](xs[i]) for i in range(num_gpus)]
                    xs = _AllReduceSum.apply(*partials) if num_gpus > 1 else partials
                xs[0].float().square().mean().backward()
                optimizer.step()

        optimizer = torch.optim.SGD(parameters, lr=0.01)
        start_ms = emu.now_ms()
        step_ms, _ = elapsed_ms(step)
    trace = [e for e in emu.trace if e.start_ns >= start_ms * 1e6]
    return StepEstimate(strategy, num_gpus, step_ms, trace)
