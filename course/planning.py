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
from course.pipeline import elapsed_ms, synchronize_all

STRATEGIES = ("data", "pipeline", "tensor")
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


def master_bytes_per_param(spec: ModelSpec) -> int:
    """fp32 master weights per parameter: 4 bytes when the model trains in fp16 or bf16, none in fp32."""
    return MASTER_WEIGHT_BYTES_PER_PARAM if spec.element_bytes < 4 else 0


def memory_per_gpu(spec: ModelSpec, strategy: str, num_gpus: int, global_batch: int) -> dict[str, int]:
    """Bytes on the busiest GPU: parameters, gradients, fp32 master weights, Adam's moments, activations, total.

    Mixed-precision Adam (ZeRO paper, Rajbhandari et al. 2020, section 3.1): 2 bytes of fp16/bf16 weights,
    2 of gradients, and 12 of what the paper calls optimizer state (4 of fp32 master weights, 4 + 4 of
    Adam's moments): 16 bytes per parameter. A model trained in fp32 needs no master copy: 4 + 4 + 8.

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
             "master": params_here * master_bytes_per_param(spec),
             "optimizer": params_here * ADAM_STATE_BYTES_PER_PARAM, "activations": activations}
    table["total"] = sum(table.values())
    return table


def zero_memory_per_gpu(spec: ModelSpec, stage: int, num_gpus: int, global_batch: int) -> dict[str, int]:
    """Data parallel with ZeRO stage 0-3 (Rajbhandari et al. 2020): `memory_per_gpu(..., "data", ...)` with
    shards of 1/num_gpus (rounded up) of the optimizer state (master weights and Adam's moments) from stage 1,
    of the gradients from stage 2, of the parameters from stage 3. Stage 0 is plain DDP. PyTorch offers stage 1
    as `ZeroRedundancyOptimizer` and stage 3 as FSDP (`fully_shard`). Stage 3 also holds, for a moment, the
    all-gathered parameters of the layer it is computing; that transient is not counted here.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {stage!r}")
    table = memory_per_gpu(spec, "data", num_gpus, global_batch)
    del table["total"]
    sharded = {1: ("master", "optimizer"), 2: ("master", "optimizer", "grads"),
               3: ("master", "optimizer", "grads", "params")}.get(stage, ())
    for key in sharded:
        table[key] = math.ceil(table[key] / num_gpus)
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


class MixedPrecisionAdam:
    """Adam as mixed-precision training runs it, and as `memory_per_gpu` counts it.

    Every fp16/bf16 weight has an fp32 master copy; a step casts the gradients to fp32 into the masters'
    `.grad`, divides them by the loss scale and checks them for inf/NaN in one fused kernel (the kernel
    `torch.amp.GradScaler.unscale_` runs; fp16 needs a loss scale, or small gradients underflow to zero; bf16
    has fp32's exponent range and needs none), runs Adam on the masters and copies them back into the
    low-precision weights. fp32 weights are updated directly. Adam's state is made in the constructor, so a
    timed step is a steady-state one. A real GradScaler multiplies the loss by the scale before backward and
    reads the inf flag on the host to skip the step on overflow; the planner's loss is not scaled
    (`loss_scale=1`: the unscale kernel costs the same whatever the scale) and shape-only mode has no flag
    value to read, so a step here never skips.
    """

    def __init__(self, parameters, lr=1e-4, loss_scale=1.0):
        parameters = list(parameters)
        self.low = [p for p in parameters if p.element_size() < 4]
        with torch.no_grad():
            self.masters = [p.detach().float() for p in self.low]
        trainable = self.masters + [p for p in parameters if p.element_size() >= 4]
        self.adam = torch.optim.Adam(trainable, lr=lr, foreach=True)
        for p in trainable:
            self.adam.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
        self.loss_scale = loss_scale
        self.scale = {}

    def step(self):
        with torch.no_grad():
            for master, p in zip(self.masters, self.low):
                master.grad = p.grad.float()
            by_device = {}
            for master in self.masters:
                by_device.setdefault(master.device, []).append(master.grad)
            for device, grads in by_device.items():
                if device not in self.scale:
                    self.scale[device] = (torch.zeros(1, device=device),
                                          torch.full((1,), 1 / self.loss_scale, device=device))
                found_inf, inverse_scale = self.scale[device]
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inverse_scale)
            self.adam.step()
            by_device = {}
            for p, master in zip(self.low, self.masters):
                by_device.setdefault(p.device, ([], []))
                by_device[p.device][0].append(p)
                by_device[p.device][1].append(master)
            for lows, masters in by_device.values():  # foreach kernels run per device, as torch groups them
                torch._foreach_copy_(lows, masters)


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
    """Simulated time of one training step (forward, backward, mixed-precision Adam update) in shape-only mode.

    The update is `MixedPrecisionAdam`: fp32 master weights, unscaled gradients, Adam, weights copied back.

    data: `simulate_ddp_step` with ceil(batch / n) samples per GPU (bucketed all-reduce overlapping backward).
    pipeline: blocks split into n consecutive stages, GPipe: all micro-batches forward (2 per stage by
    default), then one backward through all of them; activations travel between stages with `.to()`.
    tensor: Megatron-style split of every block, one all-reduce per block forward and one backward.
    """
    _check(strategy, num_gpus)
    rows = global_batch * spec.tokens_per_sample
    if strategy == "data":
        step = simulate_ddp_step(lambda: _model(spec), (math.ceil(global_batch / num_gpus) * spec.tokens_per_sample,
                                                        spec.d_model), num_gpus, gpu=gpu, link=link,
                                 optimizer=MixedPrecisionAdam)
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

        optimizer = MixedPrecisionAdam(parameters)
        synchronize_all()
        start_ms = emu.now_ms()
        step_ms, _ = elapsed_ms(step)
    trace = [e for e in emu.trace if e.start_ns >= start_ms * 1e6]
    return StepEstimate(strategy, num_gpus, step_ms, trace)
