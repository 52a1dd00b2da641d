"""Simulated timing of one DistributedDataParallel training step on emulated GPUs, from the cost model.

Real DDP runs on emulated GPUs (`course.run_threads(fn, n, backend="nccl")`), but it needs every rank's
values; for what-ifs at real scale (8 GPUs, shapes only) this replays what its reducer does: backward runs
on cuda:0, each gradient joins a bucket the moment autograd finishes it, and a full bucket's ring
all-reduce starts on a separate communication stream while backward carries on. The optimizer step
waits for the last all-reduce. Everything is integer nanoseconds, so runs are identical.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from course.cuda.emulator import emulate
from course.machine import costs, plots
from course.machine.trace import TraceEvent, merge_intervals

MIB = 2**20
DDP_BUCKET_CAP_MB = 25  # DistributedDataParallel's default bucket_cap_mb
DDP_FIRST_BUCKET_MB = 1  # its default cap for the first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


class Bucket(NamedTuple):
    """One bucket's all-reduce, in the emulator's clock: when its last gradient was ready, when it ran."""

    nbytes: int
    ready_ns: int
    allreduce_start_ns: int
    allreduce_end_ns: int


@dataclass
class DDPStep:
    """What one simulated DDP step took. `exposed_comm_ms` is all-reduce time with no compute beside it."""

    num_gpus: int
    gpu: str
    link: str
    step_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    buckets: list[Bucket]
    start_ns: int
    emulator: object
    trace: list[TraceEvent]

    def plot_timeline(self, **kwargs):
        kwargs.setdefault("title", f"one DDP step: {self.num_gpus} x {self.gpu}, {self.link}")
        return plots.plot_timeline(self.trace, **kwargs)


def simulate_ddp_step(model, batch_shape, num_gpus: int, gpu="A100-80GB", link="nvlink3",
                      bucket_cap_mb: float | None = None, materialize: bool = False, optimizer=None,
                      autocast_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> DDPStep:
    """Time forward, backward with bucketed all-reduce, and an optimizer step, on `num_gpus` emulated GPUs.

    `optimizer(parameters)` makes the optimizer (built before the clock starts); by default SGD, lr 0.01.
    `autocast_dtype` runs forward under `torch.autocast("cuda", dtype=autocast_dtype)`: matmuls in that dtype,
    weights and gradients still fp32. `reduce_dtype` all-reduces the gradients in that dtype, as DDP's
    `bf16_compress_hook` / `fp16_compress_hook` do: a full bucket is cast to it and divided by the world size on
    the compute stream, all-reduced, and cast back into the fp32 bucket on a stream of its own.

    `model` is a factory (class or function, built directly on the emulated cuda:0, so large models
    cost no real memory with materialize=False) or an nn.Module (copied). `batch_shape` is the
    per-GPU input batch of random floats; the loss is the mean square of the output. Buckets follow
    DDP from iteration 2 on: gradients in the order they become ready, cut once a bucket reaches
    `bucket_cap_mb`; with None, DDP's defaults (25 MiB, and 1 MiB for the first bucket). DDP's
    iteration 1 puts all gradients in one bucket, which is why real measurements need a warm-up step.
    Every GPU runs the same compute, so cuda:0's kernels are copied to the other GPUs' lanes.
    """
    cap_bytes = round((DDP_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
    first_cap_bytes = DDP_FIRST_BUCKET_MB * MIB if bucket_cap_mb is None else cap_bytes
    with emulate(gpus=num_gpus, gpu=gpu, link=link, materialize=materialize, force=True) as emu:
        if isinstance(model, nn.Module):
            module = copy.deepcopy(model).to("cuda:0")
        else:
            with torch.device("cuda:0"):
                module = model()
        inputs = torch.randn(batch_shape, device="cuda:0")
        optimizer = (optimizer or (lambda parameters: torch.optim.SGD(parameters, lr=0.01)))(list(module.parameters()))
        comm_streams = [torch.cuda.Stream(device=d) for d in range(num_gpus)]
        hook_stream = torch.cuda.Stream(device=0) if reduce_dtype is not None else None
        torch.cuda.synchronize()
        start_ns = emu.clock.host_ns
        buckets: list[Bucket] = []
        open_buckets: dict[torch.dtype, list[int]] = {}  # dtype -> [bytes, ready_ns]

        parameter_of = {p.dtype: p for p in module.parameters()}

        def all_reduce(dtype: torch.dtype, nbytes: int, ready_ns: int) -> None:
            compressed = None
            if reduce_dtype is not None:  # bf16_compress_hook: buffer.to(bf16).div_(world_size), all-reduce, copy_ back
                # new_empty on a parameter, not torch.empty: inside backward only tensor ops reach the emulator
                bucket_buffer = parameter_of[dtype].new_empty(nbytes // dtype.itemsize)
                compressed = bucket_buffer.to(reduce_dtype).div_(num_gpus)
                nbytes, ready_ns = compressed.numel() * compressed.element_size(), max(ready_ns, compressed.ready_ns)
            duration_ns = costs.ring_allreduce_ns(emu.collective_link(range(num_gpus)), nbytes, num_gpus)
            end_ns = emu.clock.launch_collective(
                "nccl:all_reduce", lanes=[(d, s.stream_id) for d, s in enumerate(comm_streams)],
                duration_ns=duration_ns, inputs_ready_ns=ready_ns, nbytes=nbytes)
            buckets.append(Bucket(nbytes, ready_ns, end_ns - duration_ns, end_ns))
            if compressed is not None:
                compressed._block.ready_ns = end_ns  # the all-reduce wrote it
                with torch.cuda.stream(hook_stream):
                    bucket_buffer.copy_(compressed)

        def grad_ready(param: torch.Tensor) -> None:
            bucket = open_buckets.setdefault(param.dtype, [0, 0])
            bucket[0] += param.grad.numel() * param.grad.element_size()
            bucket[1] = max(bucket[1], param.grad.ready_ns)
            if bucket[0] >= (first_cap_bytes if not buckets else cap_bytes) and num_gpus > 1:
                all_reduce(param.dtype, *open_buckets.pop(param.dtype))

        handles = [p.register_post_accumulate_grad_hook(grad_ready)
                   for p in module.parameters() if p.requires_grad]
        with torch.autocast("cuda", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            outputs = module(inputs)
        outputs.float().square().mean().backward()
        for handle in handles:
            handle.remove()
        if num_gpus > 1:
            for dtype, (nbytes, ready_ns) in open_buckets.items():
                all_reduce(dtype, nbytes, ready_ns)
        for device, comm in enumerate(comm_streams):
            torch.cuda.current_stream(device).wait_stream(comm)
        if hook_stream is not None:
            torch.cuda.current_stream(0).wait_stream(hook_stream)
        optimizer.step()
        torch.cuda.synchronize(0)
        _copy_compute_to_other_gpus(emu, start_ns)
    trace = [e for e in emu.trace if e.start_ns >= start_ns]
    return _summarise(emu, trace, buckets, start_ns)


def _copy_compute_to_other_gpus(emu, start_ns: int) -> None:
    """Ranks are symmetric: show cuda:0's kernels of the step on every GPU's compute lane too."""
    kernels = [e for e in emu.clock.trace if e.kind == "kernel" and e.device == "cuda:0"
               and e.start_ns >= start_ns]
    emu.clock.record(e._replace(device=f"cuda:{device}") for device in range(1, emu.num_gpus)
                     for e in kernels)


def _summarise(emu, trace, buckets, start_ns) -> DDPStep:
    gpu0 = [e for e in trace if e.device == "cuda:0"]
    compute = merge_intervals((e.start_ns, e.end_ns) for e in gpu0 if e.kind == "kernel")
    comm = merge_intervals((e.start_ns, e.end_ns) for e in gpu0 if e.kind == "collective")
    overlap_ns = sum(max(0, min(ce, ke) - max(cs, ks)) for cs, ce in comm for ks, ke in compute)
    comm_ns = sum(end - start for start, end in comm)
    end_ns = max(e.end_ns for e in trace)
    return DDPStep(
        num_gpus=emu.num_gpus, gpu=emu.gpu.name, link=emu.link.name,
        step_ms=(end_ns - start_ns) / 1e6,
        compute_ms=sum(e.duration_ns for e in gpu0 if e.kind == "kernel") / 1e6,
        comm_ms=comm_ns / 1e6, exposed_comm_ms=(comm_ns - overlap_ns) / 1e6,
        buckets=buckets, start_ns=start_ns, emulator=emu, trace=trace)


def ddp_scaling(model, batch_shape, gpu_counts=(1, 2, 4, 8), links=("nvlink3", "pcie4"),
                gpu="A100-80GB", bucket_cap_mb: float | None = None, autocast_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None) -> list[dict]:
    """Weak scaling: the per-GPU batch stays `batch_shape`, so more GPUs train on more samples per step.

    One row per (link, GPU count): step_ms, samples_per_s, speedup over one GPU and efficiency
    (speedup / gpus; 1.0 means communication is completely hidden). `autocast_dtype` and `reduce_dtype` go to
    `simulate_ddp_step` for every step, the one-GPU baseline included.
    """
    precision = {"autocast_dtype": autocast_dtype, "reduce_dtype": reduce_dtype}
    one_gpu = simulate_ddp_step(model, batch_shape, 1, gpu=gpu, bucket_cap_mb=bucket_cap_mb, **precision)
    one_gpu_samples_per_s = batch_shape[0] / (one_gpu.step_ms / 1e3)
    rows = []
    for link in links:
        for num_gpus in gpu_counts:
            step = one_gpu if num_gpus == 1 else simulate_ddp_step(
                model, batch_shape, num_gpus, gpu=gpu, link=link, bucket_cap_mb=bucket_cap_mb, **precision)
            samples_per_s = num_gpus * batch_shape[0] / (step.step_ms / 1e3)
            speedup = samples_per_s / one_gpu_samples_per_s
            rows.append({"gpus": num_gpus, "link": link, "step_ms": step.step_ms,
                         "samples_per_s": samples_per_s, "speedup": speedup,
                         "efficiency": speedup / num_gpus})
    return rows
