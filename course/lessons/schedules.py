"""Pipeline schedules for training (GPipe, 1F1B, interleaved 1F1B): run with torch.distributed.pipelining, then replayed
at full size on the emulator to see their timelines and the activation memory they hold on each GPU.

`run_pipelining` runs one training step of a small model with PyTorch's own schedules on rank threads (one emulated
GPU per rank) and notes, per GPU, the order in which the schedule ran each stage's forward and backward.
`replay` issues that same per-GPU order on large shape-only layers (no arithmetic on the CPU), with the
activations sent between GPUs on streams of their own as NCCL does, and measures when each forward and backward
ran (CUDA events) and how much memory each GPU held (`torch.cuda.memory_allocated`).
"""
from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn as nn
# Imported here, on the main thread: rank threads importing it at the same time find torch.distributed.tensor
# half-initialised.
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from course.cuda import devices
from course.lessons.pipeline import synchronize_all
from course.lessons.ranks import run_threads

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


# -- torch.distributed.pipelining on rank threads ----------------------------------------------------------
def split_model(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """Consecutive layers of `model` in `num_stages` parts whose lengths differ by at most one."""
    layers = list(model)
    if len(layers) < num_stages:
        raise ValueError(f"a model of {len(layers)} layers cannot make {num_stages} stages: use fewer stages")
    bounds = [len(layers) * s // num_stages for s in range(num_stages + 1)]
    return [nn.Sequential(*layers[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def stage_gpu(stage: int, num_gpus: int) -> int:
    """The GPU of pipeline stage `stage` when every GPU holds several: stage s on GPU s mod p (looped placement)."""
    return stage % num_gpus


def _schedule_class(name: str):
    classes = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}
    if name not in classes:
        raise ValueError(f"unknown schedule {name!r}: choose one of {SCHEDULES}")
    return classes[name]


def _pipelining_rank(rank, world_size, model, schedule, micro_batches, virtual, inputs, targets, loss_fn):
    """One rank of run_pipelining: its stages, one step of the schedule, what it ran and what it measured."""
    actions: list[tuple[str, int, int]] = []

    class RecordingStage(PipelineStage):
        """A PipelineStage that notes each forward and backward the schedule asks of it, in order."""

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            actions.append(("F", self.stage_index, fwd_chunk_id))
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            actions.append(("B", self.stage_index, bwd_chunk_id))
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    num_stages = world_size * virtual
    parts = split_model(copy.deepcopy(model), num_stages)
    mine = [s for s in range(num_stages) if stage_gpu(s, world_size) == rank]
    stages = [RecordingStage(parts[s].to(device), s, num_stages, device) for s in mine]
    cls = _schedule_class(schedule)
    runner = cls(stages if schedule == "Interleaved1F1B" else stages[0], n_microbatches=micro_batches, loss_fn=loss_fn)
    losses: list = []
    first, last = 0 in mine, num_stages - 1 in mine
    args = (inputs.to(device),) if first else ()
    runner.step(*args, **({"target": targets.to(device), "losses": losses} if last else {}))
    torch.cuda.synchronize(device)
    grads = {}
    for s in mine:
        offset = sum(len(part) for part in parts[:s])  # the stage's first layer's index in the whole model
        for name, param in parts[s].named_parameters():
            index, rest = name.split(".", 1)
            grads[f"{int(index) + offset}.{rest}"] = param.grad.detach().cpu()
    return {"actions": actions, "losses": [loss.detach().cpu() for loss in losses], "grads": grads}


def run_pipelining(model: nn.Sequential, inputs, targets, num_gpus: int, schedule: str, micro_batches: int,
                   virtual: int = 1, loss_fn=None) -> list[dict]:
    """One training step of `model` with torch.distributed.pipelining's `schedule` on `num_gpus` emulated GPUs.

    Must run inside `course.emulate(gpus=num_gpus)`. The model is cut into `num_gpus * virtual` stages of
    consecutive layers, stage s on GPU s mod num_gpus. Returns, per GPU (rank): "actions", the (kind, stage,
    micro-batch) the schedule ran in order ("F" forward, "B" backward); "losses", one per micro-batch (last GPU
    only); "grads", each of its parameters' gradients by its name in `model`.
    """
    if devices.active is None:
        raise RuntimeError("run_pipelining runs its ranks on emulated GPUs: call it inside "
                           f"`with course.emulate(gpus={num_gpus}):`")
    if schedule == "Interleaved1F1B" and virtual < 2:
        raise ValueError("Interleaved1F1B needs virtual=2 or more stages per GPU; with one, use 1F1B")
    if schedule != "Interleaved1F1B" and virtual != 1:
        raise ValueError(f"{schedule} runs one stage per GPU: use virtual=1, or schedule='Interleaved1F1B'")
    loss_fn = loss_fn or nn.functional.mse_loss
    return run_threads(_pipelining_rank, num_gpus, model, schedule, micro_batches, virtual, inputs, targets,
                       loss_fn, backend="nccl")


# -- the same order replayed at full size on the emulator ----------------------------------------------------
@dataclass
class Span:
    """One forward ("F") or backward ("B") of one stage on one micro-batch, as the GPU ran it (simulated ms)."""

    gpu: int
    kind: str
    stage: int
    micro_batch: int
    start_ms: float
    end_ms: float


@dataclass
class PipelineRun:
    """What `replay` measured: every span, and each GPU's memory above its weights and gradients (from
    `torch.cuda.memory_allocated`)."""

    name: str
    num_gpus: int
    micro_batches: int
    virtual: int
    spans: list[Span]
    memory: list[list[tuple[float, int]]]  # per GPU: (ms, bytes held) after each of its actions
    micro_batch_bytes: list[int]  # per GPU: what its first forward left allocated

    @property
    def total_ms(self) -> float:
        return max(s.end_ms for s in self.spans) - min(s.start_ms for s in self.spans)

    def busy_ms(self, gpu: int) -> float:
        return sum(s.end_ms - s.start_ms for s in self.spans if s.gpu == gpu)

    @property
    def bubble(self) -> float:
        """Idle share of the GPUs' time over the step: 1 - busy / (p x total)."""
        return 1 - sum(self.busy_ms(g) for g in range(self.num_gpus)) / (self.num_gpus * self.total_ms)

    def in_flight(self, gpu: int) -> int:
        """The most micro-batches whose forward ran on `gpu` and whose backward had not yet: activations held."""
        return most_in_flight([(s.kind, s.stage, s.micro_batch)
                               for s in sorted((s for s in self.spans if s.gpu == gpu), key=lambda s: s.start_ms)])

    def most_held_bytes(self, gpu: int) -> int:
        """The most memory `gpu` held after any of its forwards or backwards (activations, beyond weights and grads)."""
        return max(held for _, held in self.memory[gpu])


def most_in_flight(actions: list[tuple[str, int, int]]) -> int:
    """The most (stage, micro-batch) pairs forwarded and not yet backwarded along one GPU's list of actions."""
    held = most = 0
    for kind, _, _ in actions:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def replay(name: str, actions: list[list[tuple[str, int, int]]], stages: list[nn.Module], inputs: list,
           loss_fn=None) -> PipelineRun:
    """Run the per-GPU `actions` (from `run_pipelining`) on `stages` (stage s already on GPU s mod p) and `inputs`
    (one micro-batch each, on stage 0's GPU), from one host thread, as a single-controller pipeline does.

    Each GPU runs its actions in the given order on its default stream. Transfers run on streams of their own, one
    pair per direction between two GPUs (NCCL runs point-to-point transfers on a stream per pair of ranks), so a
    transfer never queues behind compute, nor behind a transfer the host issued early for later. Issue order follows
    the dependencies (a stage's forward after the previous stage's, a backward after the next stage's); a schedule
    that waits for something it never gets raises an error naming the stuck actions. Parameters without a gradient
    get a zero one first, as from a second step on, so the memory measured is what the schedule holds: activations.
    """
    num_gpus, num_stages, micro_batches = len(actions), len(stages), len(inputs)
    loss_fn = loss_fn or (lambda output: output.float().pow(2).mean())
    gpu_of = [stage_gpu(s, num_gpus) for s in range(num_stages)]
    links: dict = {}  # (src, dst) -> (stream on src, stream on dst)
    for param in (p for stage in stages for p in stage.parameters() if p.grad is None):
        param.grad = torch.zeros_like(param)
    synchronize_all()
    baseline = [torch.cuda.memory_allocated(g) for g in range(num_gpus)]
    origin = [torch.cuda.Event(enable_timing=True) for _ in range(num_gpus)]
    for g in range(num_gpus):
        origin[g].record(torch.cuda.current_stream(g))
    arrived = {(0, i): (x, None) for i, x in enumerate(inputs)}  # (stage, micro-batch) -> (input, its event)
    grads_in: dict = {}  # (stage, micro-batch) -> (gradient of its output, its event)
    saved: dict = {}  # (stage, micro-batch) -> (input, output) kept for the backward
    timed, memory, stored = [], [[] for _ in range(num_gpus)], [0] * num_gpus

    def send(tensor, event, src: int, dst: int):
        """Move `tensor` to GPU `dst` on both GPUs' communication streams after `event`; (copy, its event)."""
        if src == dst:
            return tensor, event
        if (src, dst) not in links:
            links[(src, dst)] = (torch.cuda.Stream(device=src), torch.cuda.Stream(device=dst))
        on_src, on_dst = links[(src, dst)]
        on_src.wait_event(event)
        with torch.cuda.stream(on_dst), torch.cuda.stream(on_src):
            moved = tensor.detach().to(f"cuda:{dst}")
        done = torch.cuda.Event()
        done.record(on_dst)
        moved.record_stream(torch.cuda.current_stream(dst))  # read there later: keep its memory until then
        return moved, done

    def run(kind: str, stage: int, i: int) -> None:
        g = gpu_of[stage]
        stream = torch.cuda.current_stream(g)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(g):
            if kind == "F":
                tensor, event = arrived.pop((stage, i))
                if event is not None:
                    stream.wait_event(event)
                x = tensor.detach().requires_grad_(stage > 0)
                start.record(stream)
                y = stages[stage](x)
                end.record(stream)
                saved[(stage, i)] = (x, y)
                if stage + 1 < num_stages:
                    arrived[(stage + 1, i)] = send(y, end, g, gpu_of[stage + 1])
            else:
                x, y = saved.pop((stage, i))
                grad, event = grads_in.pop((stage, i), (None, None))
                if event is not None:
                    stream.wait_event(event)
                start.record(stream)
                if grad is None:
                    loss_fn(y).backward()
                else:
                    torch.autograd.backward(y, grad)
                end.record(stream)
                if stage > 0:
                    grads_in[(stage - 1, i)] = send(x.grad, end, g, gpu_of[stage - 1])
                del x, y, grad
        timed.append((g, kind, stage, i, start, end))
        memory[g].append((end, torch.cuda.memory_allocated(g) - baseline[g]))
        if kind == "F" and not stored[g]:
            stored[g] = torch.cuda.memory_allocated(g) - baseline[g]

    def ready(kind: str, stage: int, i: int) -> bool:
        if kind == "F":
            return (stage, i) in arrived
        return (stage, i) in saved and (stage == num_stages - 1 or (stage, i) in grads_in)

    queues = [deque(a) for a in actions]
    while any(queues):
        progressed = False
        for queue in queues:
            if queue and ready(*queue[0]):
                run(*queue.popleft())
                progressed = True
        if not progressed:
            stuck = {g: q[0] for g, q in enumerate(queues) if q}
            raise RuntimeError(f"the schedule is stuck: each GPU's next action waits for one that never comes: {stuck}")
    synchronize_all()
    spans = [Span(g, kind, stage, i, origin[g].elapsed_time(start), origin[g].elapsed_time(end))
             for g, kind, stage, i, start, end in timed]
    samples = [[(origin[g].elapsed_time(event), held) for event, held in memory[g]] for g in range(num_gpus)]
    return PipelineRun(name, num_gpus, micro_batches, num_stages // num_gpus, spans, samples, stored)


# -- the picture --------------------------------------------------------------------------------------------
COLOURS = {("F", False): "tab:blue", ("B", False): "tab:orange", ("F", True): "#9ecae1", ("B", True): "#fdae6b"}


def plot_runs(runs: list[PipelineRun], memory: bool = True):
    """Each run in a column: its timeline (one row per GPU, forwards blue, backwards orange, numbered by micro-batch;
    a GPU's later virtual stages paler) above, if `memory`, the memory each GPU holds beyond its weights and
    gradients after each of its forwards and backwards.

    Timelines share one time axis and memory plots one memory axis, so the columns compare at a glance.
    Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    rows = 2 if memory else 1
    figure, axes = plt.subplots(rows, len(runs), figsize=(5.2 * len(runs), 2.6 + 3 * memory), squeeze=False,
                                sharex=True, sharey="row", layout="constrained", height_ratios=[1, 1.1][:rows])
    longest = 1.02 * max(span.end_ms for run in runs for span in run.spans)  # room to see the last drop
    lines = plt.get_cmap("viridis")
    for column, run in enumerate(runs):
        top = axes[0][column]
        for span in run.spans:
            width = span.end_ms - span.start_ms
            later = span.stage >= run.num_gpus  # a GPU's second (third...) virtual stage
            top.broken_barh([(span.start_ms, width)], (span.gpu - 0.4, 0.8), edgecolor="white", linewidth=0.5,
                            facecolors=COLOURS[(span.kind, later)])
            if width > longest / 60:
                top.text(span.start_ms + width / 2, span.gpu, str(span.micro_batch), ha="center", va="center",
                         fontsize=6, color="black" if later else "white")
        top.set_yticks(range(run.num_gpus), [f"cuda:{g}" for g in range(run.num_gpus)])
        top.set_ylim(run.num_gpus - 0.5, -0.5)
        top.set_title(f"{run.name}: {run.total_ms:.0f} ms, idle {run.bubble:.0%}", fontsize=10)
        top.set_xlim(0, longest)
        if not memory:
            top.set_xlabel("simulated time (ms)")
            continue
        bottom = axes[1][column]
        for g in range(run.num_gpus):
            xs, ys = [0.0], [0.0]
            for ms, held in run.memory[g]:
                xs += [ms, ms]
                ys += [ys[-1], held / 2**20]
            bottom.plot(xs, ys, color=lines(g / max(1, run.num_gpus - 1)), linewidth=1.3,
                        label=f"cuda:{g}: at most {run.most_held_bytes(g) / 2**20:,.0f} MiB")
        bottom.legend(fontsize=7, loc="upper right")
        bottom.set_xlabel("simulated time (ms)")
        bottom.set_title("memory held beyond weights and gradients", fontsize=9)
        axes[1][0].set_ylabel("allocated (MiB)")
    axes[0][0].set_ylabel("GPU")
    keys = [("F", False), ("B", False)] + ([("F", True), ("B", True)] if any(r.virtual > 1 for r in runs) else [])
    names = {"F": "forward", "B": "backward"}
    axes[0][-1].legend([plt.Rectangle((0, 0), 1, 1, color=COLOURS[key]) for key in keys],
                       [names[kind] + (", later stage" if later else "") for kind, later in keys],
                       fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, not over them
    return figure
