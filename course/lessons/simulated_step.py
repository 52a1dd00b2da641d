"""Simulated time of one training step of a `planning.Plan`, at real scale, on the emulator in shape-only mode.

The step is ordinary PyTorch (blocks of `nn.Linear`, `torch.utils.checkpoint`, `.to()` between pipeline stages, a
mixed-precision Adam); the collectives of data-parallel groups are launched on the emulator's clock with the course's
NCCL cost model, where the GPUs' real ones would run, as `course.lessons.ddp_timing` does for DDP.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from course.cuda.emulator import emulate
from course.lessons.pipeline import elapsed_ms, synchronize_all
from course.lessons.planning import ModelSpec, Plan, check_job
from course.machine import costs, hardware, plots

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


class _Block(nn.Module):
    """One block of a `ModelSpec`, gelu(x W1) W2; with `checkpointing` its activations are recomputed in backward."""

    def __init__(self, d_model: int, d_hidden: int, dtype, checkpointing: bool = False):
        super().__init__()
        self.up = nn.Linear(d_model, d_hidden, bias=False, dtype=dtype)
        self.down = nn.Linear(d_hidden, d_model, bias=False, dtype=dtype)
        self.checkpointing = checkpointing

    def _run(self, x):
        return self.down(F.gelu(self.up(x)))

    def forward(self, x):
        return checkpoint(self._run, x, use_reentrant=False) if self.checkpointing else self._run(x)


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
    """Adam as mixed-precision training runs it, and as `planning.memory_per_gpu` counts it.

    Every fp16/bf16 weight has an fp32 master copy; a step casts the gradients to fp32 into the masters'
    `.grad`, divides them by the loss scale and checks them for inf/NaN in one fused kernel (the kernel
    `torch.amp.GradScaler.unscale_` runs; fp16 needs a loss scale, or small gradients underflow to zero; bf16
    has fp32's exponent range and needs none), runs Adam on the masters and copies them back into the
    low-precision weights. fp32 weights are updated directly. Adam's state is made in the constructor, so a
    timed step is a steady-state one. The planner trains in bf16 (`loss_scale=1`, the unscale kernel costs the
    same whatever the scale); shape-only mode has no inf flag to read, so a step here never skips.
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

    plan: Plan
    step_ms: float
    trace: list

    def plot_timeline(self, **kwargs):
        kwargs.setdefault("title", f"one training step, {self.plan} on {self.plan.num_gpus} GPUs")
        return plots.plot_timeline(self.trace, **kwargs)


class _Group:
    """One data-parallel group (the GPUs of one pipeline stage): its communication streams and collectives.

    Ranks are symmetric, so only the group's first GPU computes; its collectives run on every member's
    communication stream, timed by the course's NCCL model on `link`, as `course.lessons.ddp_timing` does for DDP.
    """

    def __init__(self, emu, devices: list[int], link, sharding: str):
        self.emu, self.devices, self.link, self.sharding = emu, devices, hardware.link(link), sharding
        self.streams = [torch.cuda.Stream(device=d) for d in devices]
        self.bucket = [0, 0]  # bytes, ready_ns
        self.gathered: set[int] = set()  # indices of the blocks whose weights are all-gathered now

    def compute_ready_ns(self) -> int:
        device = self.devices[0]
        return self.emu.clock.stream_ready(device, torch.cuda.current_stream(device).stream_id)

    def collective(self, name: str, nbytes: int, ready_ns: int = 0) -> None:
        if len(self.devices) == 1:
            return
        duration = {"nccl:all_reduce": costs.ring_allreduce_ns, "nccl:all_gather": costs.ring_allgather_ns,
                    "nccl:reduce_scatter": costs.ring_reduce_scatter_ns}[name](self.link, nbytes, len(self.devices))
        self.emu.clock.launch_collective(name, [(d, s.stream_id) for d, s in zip(self.devices, self.streams)],
                                         duration, ready_ns, nbytes)

    def wait(self) -> None:
        """The compute stream waits for every collective launched so far."""
        torch.cuda.current_stream(self.devices[0]).wait_stream(self.streams[0])


# A pipeline's micro-batches all go back in one backward() (GPipe), and autograd sums a weight's gradients from
# every micro-batch before accumulating them into .grad once: the hooks below fire once per step.

def _bucket_hooks(stage: nn.Module, group: _Group) -> None:
    """DDP and ZeRO-1/2: gradients join 25 MiB buckets as backward makes them; a full bucket is all-reduced (DDP)
    or reduce-scattered (ZeRO), the last one when the stage's first parameter, reached last, is done."""
    first = next(stage.parameters())
    name = "nccl:all_reduce" if group.sharding == "ddp" else "nccl:reduce_scatter"

    def made(param):
        group.bucket = [group.bucket[0] + param.grad.numel() * param.grad.element_size(),
                        max(group.bucket[1], param.grad.ready_ns)]
        if group.bucket[0] >= DDP_BUCKET_BYTES or param is first:
            group.collective(name, *group.bucket)
            group.bucket = [0, 0]

    for p in stage.parameters():
        p.register_post_accumulate_grad_hook(made)


def _fsdp_hooks(stage: nn.Module, group: _Group) -> None:
    """FSDP: all-gather a block's weights before its forward and again when backward reaches it, the next block's
    too (prefetch), free them after; reduce-scatter a block's gradients once both are made."""
    blocks = list(stage)
    nbytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())

    def gather(index: int, step: int):
        for i in (index, index + step):
            if 0 <= i < len(blocks) and i not in group.gathered:
                group.gathered.add(i)
                group.collective("nccl:all_gather", nbytes)
        group.wait()

    def after_forward(module, args, output, index):
        group.gathered.discard(index)
        if output.requires_grad:
            output.register_hook(lambda grad: gather(index, -1))  # backward reaches this block

    for index, block in enumerate(blocks):
        params = list(block.parameters())
        block.register_forward_pre_hook(lambda module, args, i=index: gather(i, +1))
        block.register_forward_hook(functools.partial(after_forward, index=index))

        def made(param, i=index, params=params):
            group.gathered.discard(i)
            if param is params[0]:  # up.weight: backward reaches it after down.weight
                group.collective("nccl:reduce_scatter", nbytes, max(p.grad.ready_ns for p in params))

        for p in params:
            p.register_post_accumulate_grad_hook(made)


def _shard_optimizer(stage: nn.Module, group: _Group):
    """Adam on this GPU's 1/N of the stage's weights (ZeRO stages 1-3), as one flat bf16 shard with its gradient."""
    numel = sum(p.numel() for p in stage.parameters())
    dtype = next(stage.parameters()).dtype
    shard = torch.empty(math.ceil(numel / len(group.devices)), dtype=dtype, device=f"cuda:{group.devices[0]}",
                        requires_grad=True)
    shard.grad = torch.empty_like(shard)
    return MixedPrecisionAdam([shard]), numel * shard.element_size()


def _simulate_tensor_parallel(spec: ModelSpec, plan: Plan, global_batch: int):
    """Megatron-style split of every block, one all-reduce per block forward and one backward."""
    n = plan.tensor_parallel
    shards = []
    for gpu_index in range(n):
        with torch.device(f"cuda:{gpu_index}"):
            shards.append([_Block(spec.d_model, math.ceil(spec.d_hidden / n), spec.dtype, plan.checkpointing)
                           for _ in range(spec.num_blocks)])
    optimizer = MixedPrecisionAdam([p for blocks in shards for block in blocks for p in block.parameters()])
    rows = global_batch * spec.tokens_per_sample
    inputs = [torch.empty(rows, spec.d_model, dtype=spec.dtype, device=f"cuda:{i}") for i in range(n)]

    def step():
        xs = inputs
        for index in range(spec.num_blocks):
            partials = [shards[i][index](xs[i]) for i in range(n)]
            xs = _AllReduceSum.apply(*partials) if n > 1 else partials
        xs[0].float().square().mean().backward()
        optimizer.step()

    return step


def _simulate_pipeline_of_groups(emu, spec: ModelSpec, plan: Plan, global_batch: int, link):
    """Pipeline stages (GPipe) whose GPUs form data-parallel groups: stage s runs on GPUs s*N .. s*N + N-1."""
    n = plan.data_parallel
    stages, groups, optimizers = [], [], []
    for stage, blocks in enumerate(torch.tensor_split(torch.arange(spec.num_blocks), plan.pipeline_stages)):
        group = _Group(emu, list(range(stage * n, stage * n + n)), link, plan.sharding)
        with torch.device(f"cuda:{group.devices[0]}"):
            module = nn.Sequential(*[_Block(spec.d_model, spec.d_hidden, spec.dtype, plan.checkpointing)
                                     for _ in blocks])
        if n > 1:
            (_fsdp_hooks if plan.sharding == "fsdp" else _bucket_hooks)(module, group)
        sharded = n > 1 and plan.sharding != "ddp"
        optimizers.append(_shard_optimizer(module, group) if sharded else (MixedPrecisionAdam(module.parameters()), 0))
        stages.append(module)
        groups.append(group)
    rows = math.ceil(global_batch / n) * spec.tokens_per_sample
    inputs = [torch.empty(len(part), spec.d_model, dtype=spec.dtype, device="cuda:0")
              for part in torch.arange(rows).tensor_split(plan.num_micro_batches) if len(part)]

    def step():
        losses = []
        for x in inputs:
            for module, group in zip(stages, groups):
                x = module(x.to(f"cuda:{group.devices[0]}"))
            losses.append(x.float().square().mean())
        torch.stack([loss.to("cuda:0") for loss in losses]).sum().backward()  # GPipe: one backward for all
        for group, (optimizer, gather_bytes) in zip(groups, optimizers):
            group.wait()
            optimizer.step()
            if plan.sharding in ("zero1", "zero2"):  # the updated shards, all-gathered into every GPU's weights
                group.collective("nccl:all_gather", gather_bytes, group.compute_ready_ns())
                group.wait()

    return step, groups


def _copy_compute_to_group(emu, groups: list[_Group], start_ns: int) -> None:
    """Ranks of a group are symmetric: show its first GPU's kernels on every member's compute lane too."""
    for group in groups:
        kernels = [e for e in emu.clock.trace if e.kind in ("kernel", "copy") and e.device == f"cuda:{group.devices[0]}"
                   and e.start_ns >= start_ns]
        emu.clock.record(e._replace(device=f"cuda:{d}") for d in group.devices[1:] for e in kernels)


def _links(plan: Plan, link, gpus_per_node: int | None, node_link) -> tuple[str, str]:
    """(link of a data-parallel or tensor-parallel group, link between pipeline stages): `node_link` where they
    cross from one node to another, else `link`. Every stage boundary is costed at the slowest one."""
    gpus_per_node = gpus_per_node or plan.num_gpus
    if plan.num_gpus > gpus_per_node and node_link is None:
        raise ValueError(f"{plan} needs {plan.num_gpus} GPUs, more than one node of {gpus_per_node}: give node_link, "
                         "the link between nodes")
    group = plan.data_parallel * plan.tensor_parallel
    group_link = link if group <= gpus_per_node else node_link
    crosses = any((s * group) // gpus_per_node != ((s + 1) * group) // gpus_per_node
                  for s in range(plan.pipeline_stages - 1))
    return group_link, node_link if crosses else link


def simulate_step(spec: ModelSpec, plan: Plan, global_batch: int, gpu="A100-80GB", link="nvlink3",
                  gpus_per_node: int | None = None, node_link: str | None = None) -> StepEstimate:
    """Simulated time of one bf16 training step (forward, backward, mixed-precision Adam) in shape-only mode.

    The GPUs sit in nodes of `gpus_per_node` (default: one node) joined by `link` within a node and `node_link`
    between nodes. Boundary activations travel between pipeline stages with `.to()`. Within a data-parallel group
    DDP all-reduces 25 MiB buckets of gradients as backward makes them; ZeRO-1/2 reduce-scatter them instead, step
    Adam on a 1/N shard and all-gather the updated weights; FSDP all-gathers each block's weights before its
    forward and when backward reaches it (prefetching the next block's) and reduce-scatters its gradients. Only
    time is simulated: memory is `planning.memory_per_gpu`'s count, so the emulated GPUs' capacity is not enforced here.
    """
    check_job(spec, plan, global_batch)
    return _simulate_step(spec, plan, global_batch, gpu, *_links(plan, link, gpus_per_node, node_link))


@functools.lru_cache(maxsize=128)  # the same plan is often asked for twice: a table, then its timeline or a test
def _simulate_step(spec: ModelSpec, plan: Plan, global_batch: int, gpu, group_link, stage_link) -> StepEstimate:
    big_gpu = dataclasses.replace(hardware.gpu(gpu), memory_bytes=2**62)
    groups = []
    with emulate(gpus=plan.num_gpus, gpu=big_gpu, link=stage_link if plan.pipeline_stages > 1 else group_link,
                 materialize=False, force=True) as emu:
        if plan.tensor_parallel > 1:
            step = _simulate_tensor_parallel(spec, plan, global_batch)
        else:
            step, groups = _simulate_pipeline_of_groups(emu, spec, plan, global_batch, group_link)
        synchronize_all()
        start_ms = emu.now_ms()
        step_ms, _ = elapsed_ms(step)
        start_ns = round(start_ms * 1e6)
        _copy_compute_to_group(emu, groups, start_ns)
    trace = [e for e in emu.trace if e.start_ns >= start_ns]
    return StepEstimate(plan, step_ms, trace)
