"""How right is the emulator's clock? Published measurements of real GPUs next to what the emulator predicts.

Every prediction runs the same work under `course.emulate(..., materialize=False)` and times it with
`torch.cuda.Event`, exactly as a notebook would. Calibration lives in course/machine/hardware.py, never here: this
script only runs the emulator and compares. Every row cites where its number was read (URL, and which table
or post) and its configuration.

The rows are split in two halves by a rule fixed before any error was looked at (see `assign_halves`):
rows a preset had already been fitted to are "calibration"; rows added after the split (to check model changes
made after them) are "held-out"; every other row alternates held-out, calibration, held-out, ... in the order
listed within its category (GEMM, device copy, host copy, peer copy, all-reduce, all-gather, eager decode,
convolution, end-to-end). Presets may be fitted to the calibration half only, so the held-out median
and worst error are the headline: the clock is right where it was fitted, and only the error on the other
half says how right it is elsewhere.
Run: PYTHONPATH=. python benchmarks/fidelity.py
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import course
import decode_replicas

GB = 1e9
WORKPLACE = "measured in this workplace (course design notes)"


def _timed_ms(work: Callable[[], None]) -> float:
    """Simulated milliseconds of `work`, between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def matmul_tflops(gpu: str, m: int, n: int, k: int, dtype=torch.bfloat16, allow_tf32=False, reps=10) -> float:
    """TFLOP/s of an (m x k) @ (k x n) matmul, averaged over `reps` back-to-back calls as benchmarks time it."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        with course.emulate(gpus=1, gpu=gpu, materialize=False, force=True):
            a = torch.empty(m, k, device="cuda:0", dtype=dtype)
            b = torch.empty(k, n, device="cuda:0", dtype=dtype)
            ms = _timed_ms(lambda: [a @ b for _ in range(reps)]) / reps
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return 2 * m * n * k / (ms / 1e3) / 1e12


def gemm_over_gemv_bandwidth(gpu: str, m: int, k: int, n: int, dtype=torch.float16, reps=10) -> float:
    """Effective bandwidth of an (m x k) @ (k x n) matmul over that of the same matmul with m = 1: both read the same
    k x n weight, so it is the time at m = 1 over the time at m (pytorch#195716's 'rel. M=1' column)."""
    with course.emulate(gpus=1, gpu=gpu, materialize=False, force=True):
        weight = torch.empty(k, n, device="cuda:0", dtype=dtype)
        one, many = (torch.empty(rows, k, device="cuda:0", dtype=dtype) for rows in (1, m))
        return (_timed_ms(lambda: [one @ weight for _ in range(reps)])
                / _timed_ms(lambda: [many @ weight for _ in range(reps)]))


def device_copy_tbps(gpu: str, nbytes: int) -> float:
    """TB/s of `src.clone()` within one GPU, counting bytes read + written (as bandwidthTest does)."""
    with course.emulate(gpus=1, gpu=gpu, materialize=False, force=True):
        src = torch.empty(nbytes, device="cuda:0", dtype=torch.uint8)
        ms = _timed_ms(lambda: src.clone())
    return 2 * nbytes / (ms / 1e3) / 1e12


def host_to_device_gbps(host_link: str, nbytes: int, pinned: bool) -> float:
    """GB/s of one host-to-device copy of a pinned or pageable CPU tensor."""
    with course.emulate(gpus=1, gpu="A100-80GB", host_link=host_link, materialize=False, force=True):
        host = torch.empty(nbytes, dtype=torch.uint8)
        if pinned:
            host = host.pin_memory()
        ms = _timed_ms(lambda: host.to("cuda:0", non_blocking=pinned))
    return nbytes / (ms / 1e3) / GB


def allreduce_busbw_gbps(gpu: str, link: str, num_gpus: int, nbytes: int) -> float:
    """nccl-tests bus bandwidth of `torch.cuda.nccl.all_reduce`: algbw * 2(n-1)/n."""
    with course.emulate(gpus=num_gpus, gpu=gpu, link=link, materialize=False, force=True):
        tensors = [torch.empty(nbytes // 4, device=f"cuda:{i}") for i in range(num_gpus)]
        ms = _timed_ms(lambda: torch.cuda.nccl.all_reduce(tensors))
    return nbytes / (ms / 1e3) * 2 * (num_gpus - 1) / num_gpus / GB


def _bert_large_like(layers=24, width=1024, ffn=4096):
    """BERT-large-shaped stack (24 layers, hidden 1024, FFN 4096: ~300M parameters) as plain linears."""
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 3 * width), nn.Linear(3 * width, width),  # attention projections
                   nn.Linear(width, ffn), nn.GELU(), nn.Linear(ffn, width)]
    return nn.Sequential(*blocks)


def ddp_weak_scaling(gpu: str, link: str, num_gpus: int, batch_shape) -> float:
    """Throughput on num_gpus over throughput on 1 GPU, same per-GPU batch (DDP weak scaling)."""
    from course.lessons.ddp import simulate_ddp_step

    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the published run is TF32
    try:
        one = simulate_ddp_step(_bert_large_like, batch_shape, 1, gpu=gpu, link=link).step_ms
        many = simulate_ddp_step(_bert_large_like, batch_shape, num_gpus, gpu=gpu, link=link).step_ms
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return num_gpus * one / many


def device_to_host_gbps(host_link: str, nbytes: int) -> float:
    """GB/s of one device-to-host copy (`.to("cpu", non_blocking=True)`, which lands in pinned memory)."""
    with course.emulate(gpus=1, gpu="A100-80GB", host_link=host_link, materialize=False, force=True):
        dev = torch.empty(nbytes, device="cuda:0", dtype=torch.uint8)
        ms = _timed_ms(lambda: dev.to("cpu", non_blocking=True))
    return nbytes / (ms / 1e3) / GB


def peer_copy_gbps(gpu: str, link: str, nbytes: int) -> float:
    """GB/s of one copy from GPU 0 to GPU 1 (p2pBandwidthLatencyTest's unidirectional figure)."""
    with course.emulate(gpus=2, gpu=gpu, link=link, materialize=False, force=True):
        src = torch.empty(nbytes, device="cuda:0", dtype=torch.uint8)
        ms = _timed_ms(lambda: src.to("cuda:1"))
    return nbytes / (ms / 1e3) / GB


def machine_peer_copy_gbps(machine: str, src: int, dst: int, nbytes: int) -> float:
    """GB/s of one copy from GPU src to GPU dst of a machine preset, over the NVLinks that join that pair."""
    with course.emulate(machine=machine, materialize=False, force=True):
        tensor = torch.empty(nbytes, device=f"cuda:{src}", dtype=torch.uint8)
        ms = _timed_ms(lambda: tensor.to(f"cuda:{dst}"))
    return nbytes / (ms / 1e3) / GB


def bidirectional_peer_gbps(a: int, b: int, nbytes: int, **machine) -> float:
    """GB/s of p2pBandwidthLatencyTest's bidirectional figure: five copies a->b on one stream and five copies b->a on
    another, queued together (its `repeat = 5`), bytes of both over the time until all have landed on GPU a's clock.
    `machine` is what `course.emulate` takes."""
    repeat = 5
    with course.emulate(**machine, materialize=False, force=True):
        x = torch.empty(nbytes, device=f"cuda:{a}", dtype=torch.uint8)
        y = torch.empty(nbytes, device=f"cuda:{b}", dtype=torch.uint8)
        streams = [(torch.cuda.Stream(a), torch.cuda.Stream(b)) for _ in range(2)]

        def both():
            for _ in range(repeat):
                with torch.cuda.stream(streams[0][0]), torch.cuda.stream(streams[0][1]):
                    x.to(f"cuda:{b}", non_blocking=True)
            for _ in range(repeat):
                with torch.cuda.stream(streams[1][1]), torch.cuda.stream(streams[1][0]):
                    y.to(f"cuda:{a}", non_blocking=True)
            for pair in streams:
                for stream in pair:
                    torch.cuda.current_stream(a).wait_stream(stream)

        with torch.cuda.device(a):  # the events are recorded on GPU a, which waits for every copy
            ms = _timed_ms(both)
    return 2 * repeat * nbytes / (ms / 1e3) / GB


def host_to_device_while_device_to_host_gbps(host_link: str, nbytes: int, gpu: str = "RTX4090") -> float:
    """GB/s of the host-to-device copy in nvbandwidth's host_to_device_bidirectional_memcpy_ce: a pinned H2D copy
    measured while a D2H copy runs on another stream of the same GPU. nvbandwidth makes the D2H copy twice as long,
    so that it covers the whole measured copy (https://github.com/NVIDIA/nvbandwidth/issues/11)."""
    with course.emulate(gpus=1, gpu=gpu, host_link=host_link, materialize=False, force=True):
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty(2 * nbytes, device="cuda:0", dtype=torch.uint8)
        up, down = torch.cuda.Stream(0), torch.cuda.Stream(0)
        torch.cuda.synchronize()
        with torch.cuda.stream(down):
            dev.to("cpu", non_blocking=True)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(up):
            start.record()
            host.to("cuda:0", non_blocking=True)
            end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
    return nbytes / (ms / 1e3) / GB


def allreduce_us(gpu: str, link: str, num_gpus: int, nbytes: int) -> float:
    """Microseconds of one `torch.cuda.nccl.all_reduce` of nbytes per GPU (nccl-tests' "time" column)."""
    with course.emulate(gpus=num_gpus, gpu=gpu, link=link, materialize=False, force=True):
        tensors = [torch.empty(max(nbytes // 4, 1), device=f"cuda:{i}") for i in range(num_gpus)]
        ms = _timed_ms(lambda: torch.cuda.nccl.all_reduce(tensors))
    return ms * 1e3


def allgather_busbw_gbps(gpu: str, link: str, num_gpus: int, nbytes: int) -> float:
    """nccl-tests bus bandwidth of `torch.cuda.nccl.all_gather` with an nbytes output: algbw * (n-1)/n."""
    with course.emulate(gpus=num_gpus, gpu=gpu, link=link, materialize=False, force=True):
        inputs = [torch.empty(nbytes // 4 // num_gpus, device=f"cuda:{i}") for i in range(num_gpus)]
        outputs = [torch.empty(nbytes // 4, device=f"cuda:{i}") for i in range(num_gpus)]
        ms = _timed_ms(lambda: torch.cuda.nccl.all_gather(inputs, outputs))
    return nbytes / (ms / 1e3) * (num_gpus - 1) / num_gpus / GB


def decode_step_ms(gpu: str, replica: str, layers: int, width: int, heads: int, kv_heads: int, ffn: int,
                   vocab: int, context: int) -> float:
    """Simulated milliseconds of one eager batch-1 decode step (bf16, no_grad) after `context` tokens.

    From one synchronisation to the next, as a generation loop that picks each token before the next step
    spends it: the host issues every op of the step, and the GPU runs them as they come. `replica` names the
    code that was measured (benchmarks/decode_replicas.py): "hf" (transformers' Qwen2 and greedy generate) or
    "gpt-fast" (its model.py and decode_one_token; its cache holds the prompt plus generate.py's default 200 new
    tokens, rounded up to 8: the row times the step at position `context` = 104 of a 208-token cache).
    """
    saved = torch.get_default_dtype()
    with course.emulate(gpus=1, gpu=gpu, materialize=False, force=True), torch.no_grad():
        torch.set_default_dtype(torch.bfloat16)  # as both load their weights: made in bf16, never in fp32 first
        try:
            with torch.device("cuda:0"):
                if replica == "hf":
                    model = decode_replicas.HFQwen2(layers, width, heads, kv_heads, ffn, vocab, context)
                else:
                    model = decode_replicas.GptFast(layers, width, heads, kv_heads, ffn, vocab, context + 104,
                                                    context)
        finally:
            torch.set_default_dtype(saved)
        return _timed_ms(model.step)


def decode_weight_bytes(layers, width, heads, kv_heads, ffn, vocab, qkv_bias=True) -> int:
    """bf16 bytes of a decoder's weights (embedding and output head untied), as a memory floor counts them."""
    kv_width = kv_heads * width // heads
    per_layer = width * (width + 2 * kv_width) + width * width + 3 * width * ffn + 2 * width
    per_layer += (width + 2 * kv_width) if qkv_bias else 0
    return 2 * (layers * per_layer + 2 * vocab * width + width)


# Qwen-2.5-7B (https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json): 28 layers, hidden 3584, 28 query
# heads, 4 key/value heads, intermediate 18944, vocab 152064, q/k/v biases; Hugging Face's eager code path.
QWEN25_7B = dict(replica="hf", layers=28, width=3584, heads=28, kv_heads=4, ffn=18944, vocab=152064)
# Llama-2-7B as gpt-fast runs it (https://github.com/pytorch-labs/gpt-fast, model.py "7B": 32 layers, dim 4096,
# 32 heads, intermediate 11008, vocab 32000).
LLAMA2_7B_GPT_FAST = dict(replica="gpt-fast", layers=32, width=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000)
PHYSICAL_AI = ("https://arxiv.org/abs/2605.30571 (abstract: batch-1 decode, bf16, SDPA, Hugging Face eager, "
               "Qwen-2.5-7B, ctx 2048)")
GPT_FAST_BLOG = ("https://pytorch.org/blog/accelerating-generative-ai-2/ ('Starting Point (25.5 tok/s)': eager "
                 "Llama-7B, batch 1, A100-80GB power-limited to 330 W)")


def qwen_decode_floor_fraction(gpu: str) -> float:
    """The paper's R_floor: (weights + KV cache bytes) / peak bandwidth, over the simulated decode step."""
    from course.machine.hardware import gpu as gpu_preset

    q = QWEN25_7B
    kv_bytes = 2 * q["layers"] * 2 * q["kv_heads"] * (q["width"] // q["heads"]) * 2048
    weights = decode_weight_bytes(q["layers"], q["width"], q["heads"], q["kv_heads"], q["ffn"], q["vocab"])
    floor_ms = (weights + kv_bytes) / (gpu_preset(gpu).memory_bandwidth_gbps * 1e9) * 1e3
    return floor_ms / decode_step_ms(gpu, context=2048, **QWEN25_7B)


class _Bottleneck(nn.Module):
    """ResNet-50 v1.5's bottleneck block: 1x1, 3x3 (strided, the v1.5 change), 1x1 convolutions, each with batch
    norm, and a projection on the skip path where the shape changes."""

    def __init__(self, channels_in: int, width: int, stride: int):
        super().__init__()
        channels_out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(channels_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, channels_out, 1, bias=False), nn.BatchNorm2d(channels_out))
        self.skip = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.skip = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                      nn.BatchNorm2d(channels_out))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.skip(x))


def _resnet50() -> nn.Sequential:
    """ResNet-50 v1.5 for 224x224 ImageNet: stem, 3-4-6-3 bottlenecks of width 64-128-256-512, 1000 classes."""
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    channels = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(_Bottleneck(channels, width, stride if i == 0 else 1))
            channels = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def resnet50_training_images_per_s(gpu: str, batch: int, amp: bool) -> float:
    """Images/s of one ResNet-50 training step as NVIDIA's DeepLearningExamples runs it on one GPU: SGD with
    momentum 0.875 and weight decay, label smoothing 0.1; AMP means fp16 autocast on channels-last tensors, else
    fp32 (TF32 where the GPU has it, PyTorch's cuDNN default). Its static loss scaling is left out (a multiply of
    the loss and one pass over the gradients)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        with course.emulate(gpus=1, gpu=gpu, materialize=False, force=True):
            layout = torch.channels_last if amp else torch.contiguous_format
            model = _resnet50().cuda().to(memory_format=layout)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.256, momentum=0.875, weight_decay=3.0517578125e-05)
            images = torch.empty(batch, 3, 224, 224, device="cuda").to(memory_format=layout)
            labels = torch.zeros(batch, dtype=torch.long, device="cuda")

            def step():
                with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                    loss = nn.functional.cross_entropy(model(images), labels, label_smoothing=0.1)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            step()  # the optimizer's momentum buffers are made on the first step
            ms = _timed_ms(step)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    return batch / (ms / 1e3)


def resnet50_inference_images_per_s(gpu: str, batch: int, amp: bool) -> float:
    """Images/s of one ResNet-50 forward in eval mode under no_grad, as DeepLearningExamples' benchmark_inference
    runs it: AMP means fp16 autocast on channels-last tensors (configs.yml: memory_format nhwc), else fp32."""
    with course.emulate(gpus=1, gpu=gpu, materialize=False, force=True), torch.no_grad():
        layout = torch.channels_last if amp else torch.contiguous_format
        model = _resnet50().cuda().to(memory_format=layout).eval()
        images = torch.empty(batch, 3, 224, 224, device="cuda").to(memory_format=layout)

        def forward():
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                model(images)

        forward()
        ms = _timed_ms(forward)
    return batch / (ms / 1e3)


def ddp_resnet50_scaling(gpu: str, link: str, num_gpus: int, batch: int) -> float:
    """Throughput on num_gpus over throughput on 1 GPU of ResNet-50 v1.5 fp32 (TF32 where the GPU has it) training
    under DDP, same per-GPU batch: the README's "Strong Scaling" column, whose per-GPU batch is fixed."""
    from course.lessons.ddp import simulate_ddp_step

    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        shape = (batch, 3, 224, 224)
        one = simulate_ddp_step(_resnet50, shape, 1, gpu=gpu, link=link).step_ms
        many = simulate_ddp_step(_resnet50, shape, num_gpus, gpu=gpu, link=link).step_ms
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return num_gpus * one / many


def machine_without_p2p(gpu: str, link: str, host_link: str) -> "course.machine.hardware.Machine":
    """An 8-GPU box whose peers cannot reach each other's memory (p2pBandwidthLatencyTest's P2P=Disabled rows):
    every peer copy is staged through host memory."""
    from course.machine.hardware import Machine

    return Machine(f"8x{gpu}, P2P disabled", gpu, 8, link, host_link)


RN50_DLE = ("https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets/"
            "resnet50v1.5 (README 'Training performance results', 1 GPU, pytorch-21.03; batch sizes from "
            "ConvNets/configs.yml)")


CALIBRATION, HELD_OUT = "calibration", "held-out"


@dataclass
class Row:
    category: str
    what: str
    hardware: str
    published: float
    unit: str
    source: str
    predict: Callable[[], float]
    fitted_before: bool = False  # a preset was already fitted to this row before the split existed
    added_later: bool = False  # added after the split, before the model changes it was meant to check
    fitted_later: bool = False  # added after the split as the row a new constant is fitted to: calibration
    half: str = ""
    predicted: float = float("nan")

    @property
    def error_pct(self) -> float:
        return 100 * (self.predicted - self.published) / self.published


AZURE_A100 = "https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/ND_A100_v4_results.md"
AZURE_H200 = "https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/ND_H200_v5_results.md"
AZURE_A100_GEMM = AZURE_A100 + " (GEMM CuBLASLt table: FP16, random init, 10,000 warmup iterations)"
AZURE_A100_NCCL = AZURE_A100 + " (NCCL table: all_reduce_perf in-place busbw, 8 GPUs, NCCL 2.18.5)"
AZURE_H200_NCCL = AZURE_H200 + " (NCCL table: all_reduce_perf in-place busbw, NVLS, 8 GPUs, NCCL 2.20.5)"
MAMF = ("https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md "
        "(MAMF table, CUDA 12.1)")
TF32_DOCS = ("https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices "
             "(10240^3 matmul on GA100)")
MLI_4090 = ("https://github.com/mli/transformers-benchmarks/issues/4 (first post: RTX 4090, CUDA 12.0, "
            "'Matrix Multiplication' table, n x n @ n x n)")
CHSASANK = ("https://github.com/chsasank/device-benchmarks (README summary table, Memory Bandwidth column; "
            "benchmark.py copies up to 0.38 GB and counts 2x bytes)")
NCCL_1530 = ("https://github.com/NVIDIA/nccl/issues/1530 (8x RTX 4090 PCIe, all_reduce_perf -g 8 -b 8, "
             "NCCL_BUFFSIZE=8388608 run, out-of-place time at 8 B)")
TINYGRAD_P2P = ("https://github.com/tinygrad/open-gpu-kernel-modules (README: 6x RTX 4090 on PCIe 4 with the "
                "P2P driver; simpleP2P, p2pBandwidthLatencyTest, all_reduce_perf -g 6)")
TINYGRAD_6 = ("https://github.com/tinygrad/open-gpu-kernel-modules/issues/6 (3x RTX 4090, all slots PCIe 4 x16, "
              "p2pBandwidthLatencyTest bidirectional matrices, GPU0<->GPU1)")
NVBANDWIDTH_15 = ("https://github.com/NVIDIA/nvbandwidth/issues/15 (8x RTX 4090, nvbandwidth v0.2 defaults, "
                  "CPU -> GPU 0 column)")
NVBANDWIDTH_11 = ("https://github.com/NVIDIA/nvbandwidth/issues/11 (A100 on PCIe 4: host_to_device_memcpy_ce "
                  "25-26 GB/s alone, host_to_device_bidirectional_memcpy_ce 12-13 GB/s; default 512 MiB buffers)")
NVBANDWIDTH_53 = ("https://github.com/NVIDIA/nvbandwidth/issues/53 (A100-SXM4-80GB, device 20b2, on PCIe 4: "
                  "host_to_device_bidirectional_memcpy_ce ~11 GB/s while the D2H copy keeps ~25 GB/s)")
NVBANDWIDTH_50 = ("https://github.com/NVIDIA/nvbandwidth/issues/50 (6x RTX A6000 on PCIe 4, no NVLink, "
                  "device_to_device_memcpy_read_ce, GPU0 -> GPU1, same PCIe group)")
TINYGRAD_36 = ("https://github.com/tinygrad/open-gpu-kernel-modules/issues/36 (4x RTX 4090 with the P2P driver, "
               "all_reduce_perf -b 256M -e 2G -g 4, out-of-place busbw)")

NCCL_583 = ("https://github.com/NVIDIA/nccl/issues/583 (first post: all_reduce_perf -g 2 on two A100-SXM4-40GB of an "
            "8-GPU NVSwitch node, NCCL of 2021, out-of-place time at 32 B)")
NCCL_1439 = ("https://github.com/NVIDIA/nccl/issues/1439 (8x RTX 3090 on PCIe 4 across two CPU sockets, "
             "all_reduce_perf -b 8 -e 128M -f 2 -g 8, out-of-place time at 8 B)")
NCCL_TESTS_44 = ("https://github.com/NVIDIA/nccl-tests/issues/44 (two RTX 2080 Ti joined by an NVLink bridge, "
                 "all_reduce_perf -g 2, out-of-place time at 32 KiB; the same run is in "
                 "https://github.com/NVIDIA/nccl/issues/340)")
NCCL_1264 = ("https://github.com/NVIDIA/nccl/issues/1264 (first post: HGX H100 SXM, p2pBandwidthLatencyTest "
             "'Unidirectional P2P=Disabled Bandwidth Matrix', GPU0 -> GPU1)")
NCCL_TESTS_100 = ("https://github.com/NVIDIA/nccl-tests/issues/100 (ShrimpLau, 2021-12-16: HGX A100-SXM-80GB, "
                  "NVSwitch, p2pBandwidthLatencyTest 'Bidirectional P2P=Enabled Bandwidth Matrix')")
AZURE_H100 = ("https://github.com/samuel-bohman/AI-benchmarking-guide/blob/main/Azure_Results/ND_H100_v5_results.md "
              "(a fork of Azure/AI-benchmarking-guide: ND H100 v5, 8x H100 80GB HBM3, NCCL 2.18.5, CUDA 12.6)")
AZURE_H100_NCCL = AZURE_H100 + " (NCCL table: all_reduce_perf in-place busbw, NVLS, 8 GPUs)"
CUDA_DEMO_T4 = ("https://github.com/router-gao/cuda-demo/blob/main/cuda-samples/02-cuda-bandwidth.md ('T4 bandwidth "
                "output': bandwidthTest quick mode, pinned, 32,000,000 bytes, Tesla T4 on PCIe 3 x16)")
NCCL_814 = ("https://github.com/NVIDIA/nccl/issues/814 (first post, 'Without --sm_copy': six GPUs with ~920 GB/s "
            "device copies, p2pBandwidthLatencyTest P2P=Disabled matrices; staged rates of 22 GB/s exceed PCIe 3 x16, "
            "so the host links are taken as PCIe 4 x16)")
PYTORCH_195716 = ("https://github.com/pytorch/pytorch/issues/195716 (first post: fp16 [M,896] @ [896,4864] on a "
                  "Tesla T4, effective bandwidth at M = 8 is 0.83x that at M = 1: 88.5 vs 106.7 GiB/s)")
RN50_DLE_INFERENCE = ("https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets/"
                      "resnet50v1.5 (README 'Inference performance results', pytorch-21.03, batch 256, "
                      "Throughput Avg)")
RN50_DLE_SCALING = ("https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets/"
                    "resnet50v1.5 (README 'Training performance: NVIDIA DGX A100 (8x A100 80GB)', 'TF32 Strong "
                    "Scaling' 7.72x: 7248 img/s on 8 GPUs over 938 on 1, batch 256 per GPU)")


def _rows() -> list[Row]:
    n10k = 10240
    gemm, dev, host, peer, ar, ag, e2e, eager, conv = ("gemm", "device copy", "host copy", "peer copy",
                                                       "all-reduce", "all-gather", "end-to-end", "eager", "conv")
    f16 = torch.float16
    return [
        # ---- matmuls (TFLOP/s) ----
        Row(gemm, "bf16 matmul 8192^3", "H100 SXM", 798, "TFLOP/s", WORKPLACE,
            lambda: matmul_tflops("H100", 8192, 8192, 8192), fitted_before=True),
        Row(gemm, "bf16 matmul 8192^3", "H200 SXM", 788, "TFLOP/s", WORKPLACE,
            lambda: matmul_tflops("H200", 8192, 8192, 8192), fitted_before=True),
        Row(gemm, "bf16 matmul 6912x16384x2048", "A100 SXM", 267.9, "TFLOP/s", MAMF,
            lambda: matmul_tflops("A100-80GB", 6912, 16384, 2048), fitted_before=True),
        Row(gemm, "bf16 matmul 6144x17920x2816", "H100 SXM", 792.1, "TFLOP/s", MAMF,
            lambda: matmul_tflops("H100", 6144, 17920, 2816)),
        Row(gemm, "fp16 matmul 1024^3 (cuBLASLt)", "A100 SXM 80GB", 119.4, "TFLOP/s", AZURE_A100_GEMM,
            lambda: matmul_tflops("A100-80GB", 1024, 1024, 1024, f16)),
        Row(gemm, "fp16 matmul 2048^3 (cuBLASLt)", "A100 SXM 80GB", 221.8, "TFLOP/s", AZURE_A100_GEMM,
            lambda: matmul_tflops("A100-80GB", 2048, 2048, 2048, f16)),
        Row(gemm, "fp16 matmul 4096^3 (cuBLASLt)", "A100 SXM 80GB", 228.0, "TFLOP/s", AZURE_A100_GEMM,
            lambda: matmul_tflops("A100-80GB", 4096, 4096, 4096, f16)),
        Row(gemm, "fp16 matmul 8192^3 (cuBLASLt)", "A100 SXM 80GB", 253.7, "TFLOP/s", AZURE_A100_GEMM,
            lambda: matmul_tflops("A100-80GB", 8192, 8192, 8192, f16)),
        Row(gemm, "fp16 matmul 16384^3 (cuBLASLt)", "A100 SXM 80GB", 256.5, "TFLOP/s", AZURE_A100_GEMM,
            lambda: matmul_tflops("A100-80GB", 16384, 16384, 16384, f16)),
        Row(gemm, "fp16 matmul 1024x2145x1024 (m n k, cuBLASLt)", "A100 SXM 80GB", 132.8, "TFLOP/s",
            AZURE_A100_GEMM, lambda: matmul_tflops("A100-80GB", 1024, 2145, 1024, f16)),
        Row(gemm, "fp16 matmul 6144x12288x12288 (m n k, cuBLASLt)", "A100 SXM 80GB", 250.8, "TFLOP/s",
            AZURE_A100_GEMM, lambda: matmul_tflops("A100-80GB", 6144, 12288, 12288, f16)),
        Row(gemm, "fp16 matmul 802816x192x768 (m n k, skinny, cuBLASLt)", "A100 SXM 80GB", 157.8, "TFLOP/s",
            AZURE_A100_GEMM, lambda: matmul_tflops("A100-80GB", 802816, 192, 768, f16)),
        Row(gemm, "fp32 matmul 10240^3, TF32 off (0.11 s)", "A100", 2 * n10k**3 / 0.11 / 1e12, "TFLOP/s",
            TF32_DOCS, lambda: matmul_tflops("A100-80GB", n10k, n10k, n10k, torch.float32, allow_tf32=False)),
        Row(gemm, "fp32 matmul 10240^3, TF32 on (0.016 s)", "A100", 2 * n10k**3 / 0.016 / 1e12, "TFLOP/s",
            TF32_DOCS, lambda: matmul_tflops("A100-80GB", n10k, n10k, n10k, torch.float32, allow_tf32=True)),
        Row(gemm, "fp16 matmul 512^3 (torch)", "RTX 4090", 46.890, "TFLOP/s", MLI_4090,
            lambda: matmul_tflops("RTX4090", 512, 512, 512, f16)),
        Row(gemm, "fp16 matmul 2048^3 (torch)", "RTX 4090", 167.112, "TFLOP/s", MLI_4090,
            lambda: matmul_tflops("RTX4090", 2048, 2048, 2048, f16)),
        Row(gemm, "fp16 matmul 8192^3 (torch)", "RTX 4090", 158.596, "TFLOP/s", MLI_4090,
            lambda: matmul_tflops("RTX4090", 8192, 8192, 8192, f16)),
        Row(gemm, "fp16 [8, 896] @ [896, 4864] bandwidth over the same at M = 1 (tensor-core GEMM vs GEMV)", "Tesla T4",
            0.83, "x", PYTORCH_195716, lambda: gemm_over_gemv_bandwidth("T4", 8, 896, 4864), fitted_later=True),
        # ---- copies within one GPU (TB/s, bytes read + written) ----
        Row(dev, "device-to-device copy", "H100 SXM", 3.0, "TB/s", WORKPLACE,
            lambda: device_copy_tbps("H100", 2**30), fitted_before=True),
        Row(dev, "device-to-device copy", "H200 SXM", 4.3, "TB/s", WORKPLACE,
            lambda: device_copy_tbps("H200", 2**30), fitted_before=True),
        Row(dev, "STREAM Copy", "A100 SXM 80GB", 1.61, "TB/s", AZURE_A100,
            lambda: device_copy_tbps("A100-80GB", 2**30), fitted_before=True),
        Row(dev, "STREAM Copy", "H200 SXM", 4.01, "TB/s", AZURE_H200,
            lambda: device_copy_tbps("H200", 2**30)),
        Row(dev, "copy of 0.38 GB (theirs: copy_, ours: clone)", "A100 80GB", 1.49, "TB/s", CHSASANK,
            lambda: device_copy_tbps("A100-80GB", 379_625_060)),
        Row(dev, "copy of 0.38 GB (theirs: copy_, ours: clone)", "V100 32GB", 0.766, "TB/s", CHSASANK,
            lambda: device_copy_tbps("V100", 379_625_060)),
        Row(dev, "copy of 0.38 GB (theirs: copy_, ours: clone)", "T4", 0.240, "TB/s", CHSASANK,
            lambda: device_copy_tbps("T4", 379_625_060)),
        Row(dev, "copy of 0.38 GB (theirs: copy_, ours: clone)", "RTX 4090", 0.912, "TB/s", CHSASANK,
            lambda: device_copy_tbps("RTX4090", 379_625_060)),
        # ---- host <-> device (GB/s) ----
        Row(host, "H2D pageable, 32 MB (bandwidthTest)", "PCIe 4 x16 (DGX A100)", 10.0, "GB/s",
            "https://github.com/gengwg/gpu/blob/main/nvda_gpu_benchmark.md",
            lambda: host_to_device_gbps("pcie4", 32_000_000, pinned=False), fitted_before=True),
        Row(host, "H2D pinned, 32 MiB (bandwidthTest, numactl -m0 -N0)", "PCIe 3 x16 (P100 PCIe)", 12.1507,
            "GB/s", "https://github.com/mpicbg-scicomp/gearshifft/pull/82 (psteinb comment, 12150.7 MB/s)",
            lambda: host_to_device_gbps("pcie3", 33_554_432, pinned=True)),
        Row(host, "H2D pinned, 1 GB (bandwidthTest)", "PCIe 3 x16 (P100 host)", 12.4, "GB/s",
            "https://github.com/jdh4/della-gpu-A100 (README, TIGER node)",
            lambda: host_to_device_gbps("pcie3", 10**9, pinned=True)),
        Row(host, "H2D pinned, 32 MB (bandwidthTest)", "PCIe 4 x16 (DGX A100)", 25.7, "GB/s",
            "https://github.com/gengwg/gpu/blob/main/nvda_gpu_benchmark.md",
            lambda: host_to_device_gbps("pcie4", 32_000_000, pinned=True)),
        Row(host, "H2D pinned, 1 GB (bandwidthTest)", "PCIe 4 x16 (A100 PCIe)", 25.9, "GB/s",
            "https://github.com/jdh4/della-gpu-A100 (README, DELLA node)",
            lambda: host_to_device_gbps("pcie4", 10**9, pinned=True)),
        Row(host, "H2D pinned, 512 MiB (nvbandwidth host_to_device_memcpy_sm)", "PCIe 4 x16 (A100-SXM4-40GB)",
            25.13, "GB/s", "https://github.com/NVIDIA/nvbandwidth/issues/42 (-b 512)",
            lambda: host_to_device_gbps("pcie4", 2**29, pinned=True)),
        Row(host, "H2D pinned (nvbandwidth CE)", "PCIe 4 x16 (ND A100 v4)", 26.28, "GB/s", AZURE_A100,
            lambda: host_to_device_gbps("pcie4", 2**29, pinned=True)),
        Row(host, "H2D pinned (nvbandwidth CE)", "PCIe 5 x16 (ND H200 v5)", 52.0, "GB/s", AZURE_H200,
            lambda: host_to_device_gbps("pcie5", 2**29, pinned=True)),
        Row(host, "D2H pinned (nvbandwidth CE)", "PCIe 5 x16 (ND H200 v5)", 52.0, "GB/s", AZURE_H200,
            lambda: device_to_host_gbps("pcie5", 2**29)),
        Row(host, "H2D pinned, 64 MiB (nvbandwidth host_to_device_memcpy_ce)", "PCIe 4 x16 (8x RTX 4090)", 25.50,
            "GB/s", NVBANDWIDTH_15, lambda: host_to_device_gbps("pcie4", 2**26, pinned=True), added_later=True),
        Row(host, "H2D pinned while a D2H runs on the same GPU (nvbandwidth host_to_device_bidirectional_memcpy_ce)",
            "PCIe 4 x16 (8x RTX 4090)", 11.24, "GB/s", NVBANDWIDTH_15,
            lambda: host_to_device_while_device_to_host_gbps("pcie4", 2**26), added_later=True),
        Row(host, "H2D pinned while a D2H runs on the same GPU (nvbandwidth host_to_device_bidirectional_memcpy_ce)",
            "PCIe 4 x16 (A100 PCIe)", 12.5, "GB/s", NVBANDWIDTH_11,
            lambda: host_to_device_while_device_to_host_gbps("pcie4", 2**29, gpu="A100-80GB"), fitted_later=True),
        Row(host, "H2D pinned while a D2H runs on the same GPU (nvbandwidth host_to_device_bidirectional_memcpy_ce)",
            "PCIe 4 x16 (A100-SXM4-80GB)", 11.0, "GB/s", NVBANDWIDTH_53,
            lambda: host_to_device_while_device_to_host_gbps("pcie4", 2**29, gpu="A100-80GB"), added_later=True),
        Row(host, "H2D pinned (nvbandwidth CE)", "PCIe 5 x16 (ND H100 v5)", 51.0, "GB/s", AZURE_H100,
            lambda: host_to_device_gbps("pcie5", 2**29, pinned=True), added_later=True),
        Row(host, "H2D pinned, 32 MB (bandwidthTest)", "PCIe 3 x16 (Tesla T4, cloud VM)", 9.7, "GB/s", CUDA_DEMO_T4,
            lambda: host_to_device_gbps("pcie3", 32_000_000, pinned=True), added_later=True),
        Row(host, "D2H pinned, 32 MB (bandwidthTest)", "PCIe 3 x16 (Tesla T4, cloud VM)", 11.1, "GB/s", CUDA_DEMO_T4,
            lambda: device_to_host_gbps("pcie3", 32_000_000), added_later=True),
        # ---- GPU to GPU copies (GB/s) ----
        Row(peer, "P2P write, unidirectional (p2pBandwidthLatencyTest, GPU0->GPU2)", "HGX H100 SXM, NVLink 4",
            376.65, "GB/s", "https://github.com/NVIDIA/nccl/issues/1264 (first post, P2P=Enabled Writes matrix)",
            lambda: peer_copy_gbps("H100", "nvlink4", 40_000_000 * 4)),
        Row(peer, "P2P unidirectional, 2 NVLink 2 bricks between the pair (ours: DGX-1V GPU0->GPU3, 2 bricks)",
            "4x V100-SXM2 (PowerEdge C4130 config K)", 47.88, "GB/s",
            "Dell EMC Ready Solutions for AI, Deep Learning with NVIDIA, reference guide v1.0, section 3.1 Table 3 "
            "(p2pBandwidthLatencyTest, unidirectional P2P=Enabled)",
            lambda: machine_peer_copy_gbps("DGX-1V", 0, 3, 40_000_000 * 4)),
        Row(peer, "P2P write, unidirectional (p2pBandwidthLatencyTest, GPU0->GPU2; ours: DGX-A100 GPU0->GPU2)",
            "8x A100-SXM4-80GB, NVSwitch (NV12 to every peer)", 269.36, "GB/s",
            "https://github.com/LLMServe/DistServe/issues/3 (interestingLSY, 2024-06-11: P2P=Enabled Writes "
            "matrix and nvidia-smi topo -m)",
            lambda: machine_peer_copy_gbps("DGX-A100", 0, 2, 40_000_000 * 4)),
        Row(peer, "P2P copy over PCIe 4, CE read (ours: 8xL4 GPU0->GPU1, PCIe 4 P2P)", "6x RTX A6000, PCIe 4",
            26.34, "GB/s", NVBANDWIDTH_50, lambda: machine_peer_copy_gbps("8xL4", 0, 1, 2**26), added_later=True),
        Row(peer, "cudaMemcpyPeer GPU0->GPU1, 64 MB (simpleP2P)", "RTX 4090, PCIe 4, P2P driver", 24.44, "GB/s",
            TINYGRAD_P2P, lambda: peer_copy_gbps("RTX4090", "pcie4", 64 * 2**20), added_later=True),
        Row(peer, "P2P bidirectional GPU0<->GPU1 (p2pBandwidthLatencyTest, P2P=Enabled)",
            "6x RTX 4090, PCIe 4, P2P driver", 50.11, "GB/s", TINYGRAD_P2P,
            lambda: bidirectional_peer_gbps(0, 1, 40_000_000 * 4, gpus=2, gpu="RTX4090", link="pcie4"),
            added_later=True),
        Row(peer, "P2P bidirectional GPU0<->GPU1 (p2pBandwidthLatencyTest, P2P=Enabled)",
            "3x RTX 4090, PCIe 4, P2P driver", 41.38, "GB/s", TINYGRAD_6,
            lambda: bidirectional_peer_gbps(0, 1, 40_000_000 * 4, gpus=2, gpu="RTX4090", link="pcie4"),
            added_later=True),
        Row(peer, "bidirectional GPU0<->GPU1 through host memory (p2pBandwidthLatencyTest, P2P=Disabled; "
            "ours: 4xRTX4090)", "3x RTX 4090, PCIe 4", 25.76, "GB/s", TINYGRAD_6,
            lambda: bidirectional_peer_gbps(0, 1, 40_000_000 * 4, machine="4xRTX4090"), added_later=True),
        Row(peer, "P2P=Disabled unidirectional GPU0->GPU1, staged through host memory (p2pBandwidthLatencyTest; "
            "ours: 8x H100 on PCIe 5 without peer access)", "HGX H100 SXM", 37.19, "GB/s", NCCL_1264,
            lambda: machine_peer_copy_gbps(machine_without_p2p("H100", "nvlink4", "pcie5"), 0, 1, 40_000_000 * 4),
            added_later=True),
        Row(peer, "P2P bidirectional GPU4<->GPU5 over NVSwitch (p2pBandwidthLatencyTest; ours: DGX-A100)",
            "HGX A100-SXM-80GB", 519.04, "GB/s", NCCL_TESTS_100,
            lambda: bidirectional_peer_gbps(4, 5, 40_000_000 * 4, machine="DGX-A100"), added_later=True),
        Row(peer, "P2P bidirectional GPU3<->GPU4 over NVSwitch (p2pBandwidthLatencyTest; ours: DGX-A100)",
            "HGX A100-SXM-80GB", 424.52, "GB/s", NCCL_TESTS_100,
            lambda: bidirectional_peer_gbps(3, 4, 40_000_000 * 4, machine="DGX-A100"), added_later=True),
        Row(peer, "P2P=Disabled unidirectional GPU0->GPU2, staged through host memory (p2pBandwidthLatencyTest; "
            "ours: 8 GPUs on PCIe 4 without peer access)", "6 GPUs on PCIe 4 (nccl#814)", 22.16, "GB/s", NCCL_814,
            lambda: machine_peer_copy_gbps(machine_without_p2p("RTX4090", "pcie4", "pcie4"), 0, 2, 40_000_000 * 4),
            fitted_later=True),
        # Added before STAGED_COPY_STALL_NS_PER_BYTE existed, from the post whose unidirectional figure (the row above)
        # that constant was then fitted on: same machine, so not independent of it.
        Row(peer, "P2P=Disabled bidirectional GPU0<->GPU2 through host memory (p2pBandwidthLatencyTest; ours: 8 GPUs "
            "on PCIe 4 without peer access)", "6 GPUs on PCIe 4 (nccl#814)", 30.53, "GB/s", NCCL_814,
            lambda: bidirectional_peer_gbps(0, 2, 40_000_000 * 4,
                                            machine=machine_without_p2p("RTX4090", "pcie4", "pcie4")),
            added_later=True),
        # ---- NCCL all-reduce (busbw GB/s, or time) ----
        Row(ar, "ring busbw, 8 GPUs, 8 GiB (ours: all-gather, which the maintainer says shows it too)",
            "8x H100 SXM, NVLink 4", 370, "GB/s",
            "https://github.com/NVIDIA/nccl-tests/issues/212 (NCCL maintainer: 370 GB/s with NCCL_ALGO=RING or "
            "on non-allreduce operations)",
            lambda: allgather_busbw_gbps("H100", "nvlink4", 8, 8 * 2**30), fitted_before=True),
        Row(ar, "all-reduce time, 8 GPUs, 8 B", "8x RTX 4090, PCIe 4", 42.14, "us", NCCL_1530,
            lambda: allreduce_us("RTX4090", "pcie4", 8, 8)),
        Row(ar, "all-reduce busbw, 8 GPUs, 1 KiB", "8x A100 SXM, NVLink 3", 0.04, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**10)),
        Row(ar, "all-reduce busbw, 8 GPUs, 8 KiB", "8x A100 SXM, NVLink 3", 0.33, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**13)),
        Row(ar, "all-reduce busbw, 8 GPUs, 64 KiB", "8x A100 SXM, NVLink 3", 2.70, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**16)),
        Row(ar, "all-reduce busbw, 8 GPUs, 1 MiB", "8x A100 SXM, NVLink 3", 36.22, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**20)),
        Row(ar, "all-reduce busbw, 8 GPUs, 16 MiB", "8x A100 SXM, NVLink 3", 109.22, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**24)),
        Row(ar, "all-reduce busbw, 8 GPUs, 128 MiB", "8x A100 SXM, NVLink 3", 174.18, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**27)),
        Row(ar, "all-reduce busbw, 8 GPUs, 1 GiB", "8x A100 SXM, NVLink 3", 228.10, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**30)),
        Row(ar, "all-reduce busbw, 8 GPUs, 8 GiB", "8x A100 SXM, NVLink 3", 231.58, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 8 * 2**30)),
        Row(ar, "all-reduce busbw, 8 GPUs, 1 KiB, NVLS", "8x H200 SXM, NVLink 4", 0.06, "GB/s", AZURE_H200_NCCL,
            lambda: allreduce_busbw_gbps("H200", "nvlink4", 8, 2**10)),
        Row(ar, "all-reduce busbw, 8 GPUs, 64 KiB, NVLS", "8x H200 SXM, NVLink 4", 3.72, "GB/s", AZURE_H200_NCCL,
            lambda: allreduce_busbw_gbps("H200", "nvlink4", 8, 2**16)),
        Row(ar, "all-reduce busbw, 8 GPUs, 1 MiB, NVLS", "8x H200 SXM, NVLink 4", 52.96, "GB/s", AZURE_H200_NCCL,
            lambda: allreduce_busbw_gbps("H200", "nvlink4", 8, 2**20)),
        Row(ar, "all-reduce busbw, 8 GPUs, 16 MiB, NVLS", "8x H200 SXM, NVLink 4", 240.41, "GB/s",
            AZURE_H200_NCCL, lambda: allreduce_busbw_gbps("H200", "nvlink4", 8, 2**24)),
        Row(ar, "all-reduce busbw, 8 GPUs, 1 GiB, NVLS", "8x H200 SXM, NVLink 4", 467.58, "GB/s",
            AZURE_H200_NCCL, lambda: allreduce_busbw_gbps("H200", "nvlink4", 8, 2**30)),
        Row(ar, "all-reduce busbw, 8 GPUs, 8 GiB, NVLS", "8x H200 SXM, NVLink 4", 479.98, "GB/s",
            AZURE_H200_NCCL, lambda: allreduce_busbw_gbps("H200", "nvlink4", 8, 8 * 2**30)),
        Row(ar, "all-reduce busbw, 4 GPUs, 256 MiB", "4x RTX 4090, PCIe 4", 25.72, "GB/s", TINYGRAD_36,
            lambda: allreduce_busbw_gbps("RTX4090", "pcie4", 4, 2**28)),
        Row(ar, "all-reduce busbw, 4 GPUs, 1 GiB", "4x RTX 4090, PCIe 4", 25.95, "GB/s", TINYGRAD_36,
            lambda: allreduce_busbw_gbps("RTX4090", "pcie4", 4, 2**30)),
        Row(ar, "all-reduce busbw, 6 GPUs, 32 MiB", "6x RTX 4090, PCIe 4, P2P driver", 24.58, "GB/s", TINYGRAD_P2P,
            lambda: allreduce_busbw_gbps("RTX4090", "pcie4", 6, 2**25), added_later=True),
        Row(ar, "all-reduce busbw, 8 GPUs, 4 KiB", "8x A100 SXM, NVLink 3", 0.17, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**12), added_later=True),
        Row(ar, "all-reduce busbw, 8 GPUs, 256 KiB", "8x A100 SXM, NVLink 3", 10.11, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**18), added_later=True),
        Row(ar, "all-reduce busbw, 8 GPUs, 4 MiB", "8x A100 SXM, NVLink 3", 71.43, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**22), added_later=True),
        Row(ar, "all-reduce busbw, 8 GPUs, 256 MiB", "8x A100 SXM, NVLink 3", 213.87, "GB/s", AZURE_A100_NCCL,
            lambda: allreduce_busbw_gbps("A100-80GB", "nvlink3", 8, 2**28), added_later=True),
        Row(ar, "all-reduce time, 2 GPUs, 32 KiB (ours: V100 preset on NVLink 2; at 32 KiB the GPU does no work)",
            "2x RTX 2080 Ti, NVLink bridge", 13.39, "us", NCCL_TESTS_44,
            lambda: allreduce_us("V100", "nvlink2", 2, 2**15), fitted_later=True),
        Row(ar, "all-reduce time, 2 GPUs, 32 B", "2x A100-SXM4-40GB, NVSwitch", 10.14, "us", NCCL_583,
            lambda: allreduce_us("A100-40GB", "nvlink3", 2, 32), added_later=True),
        Row(ar, "all-reduce time, 8 GPUs, 8 B (ours: RTX 4090 preset; at 8 B the GPU does no work)",
            "8x RTX 3090, PCIe 4", 54.18, "us", NCCL_1439, lambda: allreduce_us("RTX4090", "pcie4", 8, 8),
            added_later=True),
        Row(ar, "all-reduce busbw, 8 GPUs, 8 KiB, NVLS", "8x H100 SXM, NVLink 4", 0.53, "GB/s", AZURE_H100_NCCL,
            lambda: allreduce_busbw_gbps("H100", "nvlink4", 8, 2**13), added_later=True),
        Row(ar, "all-reduce busbw, 8 GPUs, 256 KiB, NVLS", "8x H100 SXM, NVLink 4", 10.86, "GB/s", AZURE_H100_NCCL,
            lambda: allreduce_busbw_gbps("H100", "nvlink4", 8, 2**18), added_later=True),
        Row(ar, "all-reduce busbw, 8 GPUs, 4 MiB, NVLS", "8x H100 SXM, NVLink 4", 128.73, "GB/s", AZURE_H100_NCCL,
            lambda: allreduce_busbw_gbps("H100", "nvlink4", 8, 2**22), added_later=True),
        # ---- NCCL all-gather (busbw GB/s) ----
        Row(ag, "all-gather busbw, 8 GPUs, 16 GiB (\"saturated at ~360 GB/s\")", "8x H100, NVLink 4", 360,
            "GB/s", "https://github.com/NVIDIA/nccl-tests/issues/326 (all_gather_perf -b 128M -e 16384M -g 8; "
            "maintainer: 'exactly what we'd expect on H100')",
            lambda: allgather_busbw_gbps("H100", "nvlink4", 8, 16 * 2**30)),
        # ---- eager batch-1 decode (host-bound where the GPU is fast), by GPU memory bandwidth ----
        Row(eager, "decode step, Qwen-2.5-7B bf16, batch 1, ctx 2048 (62.32 ms)", "L4", 62.32, "ms",
            PHYSICAL_AI + " (L4 bf16 baseline)", lambda: decode_step_ms("L4", context=2048, **QWEN25_7B)),
        Row(eager, "decode tokens/s, Llama-2-7B bf16, batch 1, eager", "A100 SXM 80GB (330 W)", 25.5, "tok/s",
            GPT_FAST_BLOG, lambda: 1e3 / decode_step_ms("A100-80GB", context=104, **LLAMA2_7B_GPT_FAST)),
        Row(eager, "decode step as a fraction of its memory floor, Qwen-2.5-7B, ctx 2048", "H100 SXM", 0.27,
            "R_floor", PHYSICAL_AI + " (H100: 27% of the analytic memory floor)",
            lambda: qwen_decode_floor_fraction("H100")),
        # ---- convolutions: ResNet-50 v1.5 training and inference, one GPU ----
        Row(conv, "ResNet-50 training, TF32, batch 256, NCHW", "A100 SXM 80GB (DGX A100)", 938, "img/s", RN50_DLE,
            lambda: resnet50_training_images_per_s("A100-80GB", 256, amp=False)),
        Row(conv, "ResNet-50 training, AMP, batch 256, NHWC", "A100 SXM 80GB (DGX A100)", 2470, "img/s", RN50_DLE,
            lambda: resnet50_training_images_per_s("A100-80GB", 256, amp=True)),
        Row(conv, "ResNet-50 training, FP32, batch 112, NCHW", "V100 SXM2 32GB (DGX-1)", 356, "img/s", RN50_DLE,
            lambda: resnet50_training_images_per_s("V100", 112, amp=False)),
        Row(conv, "ResNet-50 training, AMP, batch 256, NHWC", "V100 SXM2 32GB (DGX-1)", 1156, "img/s", RN50_DLE,
            lambda: resnet50_training_images_per_s("V100", 256, amp=True)),
        Row(conv, "ResNet-50 inference, FP32, batch 256", "V100 SXM2 16GB (DGX-1)", 1261, "img/s",
            RN50_DLE_INFERENCE, lambda: resnet50_inference_images_per_s("V100", 256, amp=False), added_later=True),
        Row(conv, "ResNet-50 inference, AMP, batch 256, NHWC", "V100 SXM2 16GB (DGX-1)", 3382, "img/s",
            RN50_DLE_INFERENCE, lambda: resnet50_inference_images_per_s("V100", 256, amp=True), added_later=True),
        Row(conv, "ResNet-50 inference, FP32, batch 256", "T4", 415, "img/s", RN50_DLE_INFERENCE,
            lambda: resnet50_inference_images_per_s("T4", 256, amp=False), added_later=True),
        Row(conv, "ResNet-50 inference, AMP, batch 256, NHWC", "T4", 1198, "img/s", RN50_DLE_INFERENCE,
            lambda: resnet50_inference_images_per_s("T4", 256, amp=True), added_later=True),
        # ---- DDP ----
        Row(e2e, "DDP weak scaling 1->8 GPUs, BERT-large, TF32", "8x A100 80GB (DGX A100)", 7.90, "x",
            "NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT README (pre-training, seq 128)",
            lambda: ddp_weak_scaling("A100-80GB", "nvlink3", 8, (16384, 1024))),
        Row(e2e, "DDP scaling 1->8 GPUs, ResNet-50 v1.5, TF32, batch 256 per GPU", "8x A100 80GB (DGX A100)", 7.72,
            "x", RN50_DLE_SCALING, lambda: ddp_resnet50_scaling("A100-80GB", "nvlink3", 8, 256), added_later=True),
    ]


def assign_halves(result: list[Row]) -> list[Row]:
    """Split the rows into a calibration half and a held-out half, by a rule fixed before any error was seen.

    Rows a preset was already fitted to (`fitted_before`), and rows added later for a new constant to be fitted to
    (`fitted_later`, from sources other than the held-out rows that check it), are calibration; rows added after the split
    (`added_later`: sourced and predicted before the model changes they check) are held-out. Every other row, in
    the order listed within its category (shapes and sizes ascending within one machine), alternates held-out,
    calibration, held-out, ... per category. Presets in course/machine/hardware.py may be fitted to calibration rows
    only; the held-out half is the figure that means something.
    """
    counters: dict[str, int] = {}
    for row in result:
        if row.fitted_before or row.fitted_later or row.added_later:
            row.half = HELD_OUT if row.added_later else CALIBRATION
            continue
        k = counters.get(row.category, 0)
        counters[row.category] = k + 1
        row.half = HELD_OUT if k % 2 == 0 else CALIBRATION
    return result


def rows() -> list[Row]:
    """Every row with its half and its prediction filled in."""
    result = assign_halves(_rows())
    for row in result:
        row.predicted = row.predict()
    return result


def summary(result: list[Row]) -> dict:
    """Median and worst absolute error (%) over all rows and over each half."""
    def stats(subset):
        errors = [abs(r.error_pct) for r in subset]
        return (statistics.median(errors), max(errors)) if errors else (float("nan"), float("nan"))

    out = {}
    for key, subset in (("all", result), ("calibration", [r for r in result if r.half == CALIBRATION]),
                        ("held_out", [r for r in result if r.half == HELD_OUT])):
        out[f"{key}_median"], out[f"{key}_worst"] = stats(subset)
        out[f"{key}_count"] = len(subset)
    return out


def main() -> None:
    result = rows()
    header = ("half", "category", "what", "hardware", "published", "predicted", "unit", "error %", "source")
    table = [header] + [(r.half, r.category, r.what, r.hardware, f"{r.published:.4g}", f"{r.predicted:.4g}",
                         r.unit, f"{r.error_pct:+.1f}", r.source) for r in result]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    right = {4, 5, 7}
    for line in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        print("  ".join(cells + [line[-1]]))
    s = summary(result)
    print(f"\nHELD-OUT ({s['held_out_count']} rows): median error {s['held_out_median']:.1f}%, "
          f"worst {s['held_out_worst']:.1f}%   <- the figure that means something")
    print(f"calibration ({s['calibration_count']} rows): median error {s['calibration_median']:.1f}%, "
          f"worst {s['calibration_worst']:.1f}%")
    worst = max((r for r in result if r.half == HELD_OUT), key=lambda r: abs(r.error_pct))
    print(f"worst held-out row: {worst.what} on {worst.hardware} ({worst.error_pct:+.1f}%)")


if __name__ == "__main__":
    main()
