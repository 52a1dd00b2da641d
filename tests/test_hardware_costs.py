"""Checks that the hardware presets are complete and the cost model agrees with torch and with calibration."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import course
from course.machine import costs, hardware

DTYPE_KEYS = {"fp64", "fp32", "tf32", "bf16", "fp16"}
LOW_PRECISION_KEYS = {"fp8", "int8"}  # only where the datasheet quotes them


class RecordOps(TorchDispatchMode):
    """Records every aten call so a test can price exactly what PyTorch ran."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def recorded_call(fn, op):
    with RecordOps() as recorder:
        fn()
    return next(call for call in recorder.calls if call[0] is op)


@pytest.mark.parametrize("preset", hardware.GPUS.values(), ids=list(hardware.GPUS))
def test_gpu_presets_are_complete_and_positive(preset):
    assert DTYPE_KEYS <= set(preset.peak_tflops) <= DTYPE_KEYS | LOW_PRECISION_KEYS
    assert ("fp8" in preset.peak_tflops) == (preset.compute_capability >= (8, 9))  # where _scaled_mm runs
    assert all(value > 0 for value in preset.peak_tflops.values())
    assert preset.memory_bytes > 0 and preset.multi_processor_count > 0
    assert preset.memory_bandwidth_gbps > 0 and preset.kernel_min_us > 0
    assert 0 < preset.matmul_efficiency <= 1 and 0 < preset.memory_efficiency <= 1


@pytest.mark.parametrize("preset", hardware.LINKS.values(), ids=list(hardware.LINKS))
def test_link_presets_are_positive(preset):
    assert preset.bandwidth_gbps > 0 and preset.latency_us > 0
    assert 0 < preset.pageable_efficiency <= preset.efficiency <= 1


def test_lookup_accepts_names_instances_and_any_case():
    h100 = hardware.GPUS["H100"]
    assert hardware.gpu("H100") is h100
    assert hardware.gpu("h100") is h100
    assert hardware.gpu(h100) is h100
    assert hardware.link("NVLink4") is hardware.LINKS["nvlink4"]


@pytest.mark.parametrize("lookup, presets", [(hardware.gpu, hardware.GPUS), (hardware.link, hardware.LINKS)])
def test_unknown_name_lists_valid_names(lookup, presets):
    with pytest.raises(ValueError) as error:
        lookup("A100")
    assert "'A100'" in str(error.value)
    assert all(name in str(error.value) for name in presets)


def test_mm_flops_match_flop_counter():
    a, b = torch.randn(6, 5), torch.randn(5, 7)
    func, args, kwargs, out = recorded_call(lambda: a @ b, torch.ops.aten.mm.default)
    assert costs.op_flops(func, args, kwargs, out) == counted_flops(lambda: a @ b)
    assert costs.op_flops(torch.ops.aten.add.Tensor, (a, a), {}, a + a) == 0


def test_sdpa_flops_match_explicit_matmuls():
    q = torch.randn(2, 3, 5, 8, requires_grad=True)
    k = torch.randn(2, 3, 7, 8, requires_grad=True)
    v = torch.randn(2, 3, 7, 8, requires_grad=True)
    sdpa = costs.op_flops(*recorded_call(lambda: F.scaled_dot_product_attention(q, k, v),
                                         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default))
    scores = lambda: q @ k.transpose(-2, -1)
    forward = counted_flops(lambda: torch.softmax(scores(), -1) @ v)
    assert sdpa == forward > 0

    out = F.scaled_dot_product_attention(q, k, v)
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    sdpa_backward = costs.op_flops(*recorded_call(lambda: out.sum().backward(), backward_op))
    explicit = torch.softmax(scores(), -1) @ v
    backward = counted_flops(lambda: explicit.sum().backward())
    assert sdpa_backward == backward + counted_flops(scores)  # flash recomputes the scores in backward


def test_tensor_core_ops():
    assert costs.uses_tensor_cores(torch.ops.aten.mm.default)
    assert costs.uses_tensor_cores(torch.ops.aten.convolution_backward.default)
    assert costs.uses_tensor_cores(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not costs.uses_tensor_cores(torch.ops.aten.add.Tensor)


def test_peak_flops_follows_dtype_and_tf32():
    a100 = hardware.gpu("A100-80GB")
    tflops = a100.peak_tflops
    assert costs.peak_flops_per_s(a100, torch.float32, True, allow_tf32=True) == tflops["tf32"] * 1e12
    assert costs.peak_flops_per_s(a100, torch.float32, True, allow_tf32=False) == tflops["fp32"] * 1e12
    assert costs.peak_flops_per_s(a100, torch.bfloat16, True, False) == tflops["bf16"] * 1e12
    assert costs.peak_flops_per_s(a100, torch.bfloat16, False, False) == tflops["fp32"] * 1e12
    assert costs.peak_flops_per_s(a100, torch.float64, True, False) == tflops["fp64"] * 1e12


def test_low_precision_gemms_take_their_inputs_rate_where_the_datasheet_quotes_one():
    h100, a100, v100 = hardware.gpu("H100"), hardware.gpu("A100-80GB"), hardware.gpu("V100")
    assert costs.peak_flops_per_s(h100, torch.float8_e4m3fn, True, False) == h100.peak_tflops["fp8"] * 1e12
    assert costs.peak_flops_per_s(h100, torch.float8_e5m2, True, False) == h100.peak_tflops["fp8"] * 1e12
    assert costs.peak_flops_per_s(a100, torch.int8, True, False) == a100.peak_tflops["int8"] * 1e12
    assert costs.peak_flops_per_s(v100, torch.int8, True, False) == v100.peak_tflops["fp32"] * 1e12  # none quoted
    assert costs.peak_flops_per_s(h100, torch.int8, False, False) == h100.peak_tflops["fp32"] * 1e12  # elementwise
    a8, i8 = torch.empty(64, 32, dtype=torch.float8_e4m3fn), torch.empty(64, 32, dtype=torch.int8)
    one = torch.ones(())
    assert costs.operand_dtype(torch.ops.aten._scaled_mm.default, (a8, a8.t(), one, one), torch.float32) == a8.dtype
    assert costs.operand_dtype(torch.ops.aten._int_mm.default, (i8, i8.t()), torch.int32) == torch.int8
    assert costs.operand_dtype(torch.ops.aten.mm.default, (a8, a8.t()), torch.bfloat16) == torch.bfloat16
    assert costs.gemm_shape(torch.ops.aten._int_mm.default, (i8, i8.t())) == (1, 64, 64, 32)
    assert costs.op_flops(torch.ops.aten._int_mm.default, (i8, i8.t()), {}, None) == 2 * 64 * 64 * 32


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_and_int8_gemms_on_an_h100_run_faster_than_bf16_by_the_ratio_of_the_peaks(out_dtype):
    """A compute-bound GEMM: torch._scaled_mm (float8 in) and torch._int_mm (int8 in) run at the FP8 and INT8
    tensor-core peaks, whatever dtype they return, where the same bf16 GEMM runs at the BF16 peak."""
    n = 4096  # shapes only: a real 4096^3 GEMM would take the CPU seconds
    with course.emulate(gpus=1, gpu="H100", materialize=False) as emu:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        scale = torch.ones((), device="cuda")
        a8, i8 = a.to(torch.float8_e4m3fn), a.to(torch.int8)

        def kernel_ns(run):
            before = len(emu.trace)
            run()
            (kernel,) = emu.trace[before:]
            return kernel.duration_ns - emu.gpu.kernel_min_us * 1000

        bf16 = kernel_ns(lambda: a @ a.t())
        fp8 = kernel_ns(lambda: torch._scaled_mm(a8, a8.t(), scale_a=scale, scale_b=scale, out_dtype=out_dtype))
        int8 = kernel_ns(lambda: torch._int_mm(i8, i8.t()))
    peaks = emu.gpu.peak_tflops
    assert bf16 / fp8 == pytest.approx(peaks["fp8"] / peaks["bf16"], rel=1e-4)
    assert bf16 / int8 == pytest.approx(peaks["int8"] / peaks["bf16"], rel=1e-4)


def mm_cost_ns(gpu, n, dtype=torch.bfloat16):
    a = torch.empty(n, n, dtype=dtype, device="meta")
    flops = costs.op_flops(torch.ops.aten.mm.default, (a, a), {}, a)
    return flops, costs.kernel_ns(gpu, flops, 3 * a.nbytes, dtype, True, False, gemm=(1, n, n, n))


def test_kernel_ns_is_monotone_in_size():
    h100 = hardware.gpu("H100")
    times = [mm_cost_ns(h100, n)[1] for n in (16, 256, 1024, 4096, 8192)]
    assert times == sorted(times) and times[0] < times[-1]
    copies = [costs.device_copy_ns(h100, 2**p) for p in range(10, 32, 4)]
    assert copies == sorted(copies) and copies[0] < copies[-1]


def test_roofline_switches_regime():
    h100 = hardware.gpu("H100")
    numel = 1024
    add = dict(dtype=torch.float32, tensor_cores=False, allow_tf32=False)
    assert costs.kernel_ns(h100, numel, 3 * 4 * numel, **add) == costs.kernel_ns(h100, 0, 3 * 4 * numel, **add)
    flops, _ = mm_cost_ns(h100, 8192)
    mm = dict(dtype=torch.bfloat16, tensor_cores=True, allow_tf32=False)
    assert costs.kernel_ns(h100, flops, 3 * 2 * 8192**2, **mm) == costs.kernel_ns(h100, flops, 0, **mm)


@pytest.mark.parametrize("key, measured_tflops", [("H100", 798), ("H200", 788)])
def test_matmul_calibration(key, measured_tflops):
    flops, ns = mm_cost_ns(hardware.gpu(key), 8192)
    assert flops / ns / 1e3 == pytest.approx(measured_tflops, rel=0.03)


@pytest.mark.parametrize("key, measured_tbps", [("H100", 3.0), ("H200", 4.3)])
def test_copy_calibration(key, measured_tbps):
    nbytes = 2**30
    ns = costs.device_copy_ns(hardware.gpu(key), nbytes)
    assert 2 * nbytes / ns / 1e3 == pytest.approx(measured_tbps, rel=0.03)


def test_pinned_is_faster_than_pageable():
    for preset in ("pcie3", "pcie4", "pcie5"):
        pcie = hardware.link(preset)
        assert costs.copy_ns(pcie, 2**28, pinned=True) < costs.copy_ns(pcie, 2**28, pinned=False)


@pytest.mark.parametrize("collective", [costs.ring_allreduce_ns, costs.ring_allgather_ns,
                                        costs.ring_reduce_scatter_ns, costs.broadcast_ns])
def test_collectives_on_one_gpu_are_free(collective):
    assert collective(hardware.link("nvlink3"), 2**30, 1) == 0


@pytest.mark.parametrize("num_gpus", [2, 4, 8])
def test_allreduce_bus_bandwidth_approaches_link(num_gpus):
    nvlink = hardware.link("nvlink3")  # a ring: no NVLink SHARP
    reachable_gbps = nvlink.bandwidth_gbps * nvlink.efficiency
    busbw = []
    for nbytes in (2**20, 2**26, 2**34):
        algbw_gbps = nbytes / costs.ring_allreduce_ns(nvlink, nbytes, num_gpus)
        busbw.append(algbw_gbps * 2 * (num_gpus - 1) / num_gpus)
    assert busbw[0] < busbw[1] < busbw[2] <= reachable_gbps  # bandwidth grows with the message, as in nccl-tests
    assert busbw[2] == pytest.approx(reachable_gbps, rel=0.01)


def test_allreduce_uses_nvls_where_the_link_has_it_and_rings_elsewhere():
    nvlink4 = hardware.link("nvlink4")
    nbytes, n = 2**34, 8
    allreduce_busbw = nbytes / costs.ring_allreduce_ns(nvlink4, nbytes, n) * 2 * (n - 1) / n
    allgather_busbw = nbytes / costs.ring_allgather_ns(nvlink4, nbytes, n) * (n - 1) / n
    assert allreduce_busbw == pytest.approx(nvlink4.nvls_busbw_gbps, rel=0.01)
    assert allgather_busbw == pytest.approx(nvlink4.bandwidth_gbps * nvlink4.efficiency, rel=0.01)


def test_small_collectives_cost_the_launches_and_the_hops():
    for key in ("nvlink3", "pcie4"):
        link = hardware.link(key)
        expected_ns = (hardware.NCCL_LAUNCH_US + 14 * link.hop_latency_us) * 1000
        assert costs.ring_allreduce_ns(link, 8, 8) == pytest.approx(expected_ns, rel=0.01)
    assert costs.ring_allreduce_ns(hardware.link("pcie4"), 8, 8) > costs.ring_allreduce_ns(hardware.link("nvlink3"), 8, 8)


def test_one_thread_driving_every_gpu_launches_each_gpus_kernel_in_turn():
    """torch.cuda.nccl from one thread (nccl-tests -g n) pays a kernel launch per GPU; a rank driving its own GPU,
    one: the difference for 8 GPUs is 7 launches."""
    link = hardware.link("nvlink3")
    one_thread, per_rank = costs.ring_allreduce_ns(link, 8, 8, launches=8), costs.ring_allreduce_ns(link, 8, 8)
    assert one_thread - per_rank == pytest.approx(7 * hardware.NCCL_LAUNCH_US * 1000, abs=1)
    with course.emulate(gpus=8, materialize=False, force=True):
        tensors = [torch.empty(2, device=f"cuda:{i}") for i in range(8)]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda.nccl.all_reduce(tensors)
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) * 1e6 >= one_thread


def test_gather_and_scatter_cost_half_an_allreduce():
    nvlink = hardware.link("nvlink3")
    allreduce = costs.ring_allreduce_ns(nvlink, 2**30, 8)
    # Half the bus bytes; a little slower than half, as a smaller message fills less of NCCL's pipeline.
    assert costs.ring_allgather_ns(nvlink, 2**30, 8) == pytest.approx(allreduce / 2, rel=0.1)
    assert costs.ring_reduce_scatter_ns(nvlink, 2**30, 8) == pytest.approx(allreduce / 2, rel=0.1)


def test_gemm_shape_efficiency_quantizes_waves_and_tiles():
    a100 = hardware.gpu("A100-80GB")
    large = costs.gemm_shape_efficiency(a100, 1, 6912, 16384, 2048)  # whole waves of 256x128 tiles
    assert large == pytest.approx(1.0)
    assert costs.gemm_shape_efficiency(a100, 1, 1024, 1024, 1024) < 0.8 * large  # fewer tiles than SMs
    assert costs.gemm_shape_efficiency(a100, 1, 4096, 100, 4096) <= 0.8 * 100 / 128  # 100 columns in 128-wide tiles
    assert costs.gemm_shape_efficiency(a100, 8, 1024, 1024, 1024) > costs.gemm_shape_efficiency(a100, 1, 1024, 1024, 1024)
    flops_1k, ns_1k = mm_cost_ns(a100, 1024)
    flops_8k, ns_8k = mm_cost_ns(a100, 8192)
    assert flops_1k / ns_1k < 0.7 * flops_8k / ns_8k  # 1024^3 is not predicted at the large-GEMM rate


def test_skinny_gemms_are_memory_bound_and_grow_with_their_rows():
    """Decode-like and small micro-batch GEMMs run split-K narrow tiles: no partial waves, padding to 16 rows."""
    a100 = hardware.gpu("A100-80GB")

    def ms(rows):
        flops, nbytes = 2 * rows * 8192 * 8192, 2 * (2 * rows * 8192 + 8192 * 8192)
        return costs.kernel_ns(a100, flops, nbytes, torch.bfloat16, True, False, (1, rows, 8192, 8192)) / 1e6

    memory_ms = 2 * 8192 * 8192 / (a100.memory_bandwidth_gbps * 1e9 * a100.memory_efficiency) * 1e3
    assert ms(1) == pytest.approx(memory_ms + a100.kernel_min_us / 1e3, rel=0.01)
    times = [ms(rows) for rows in range(1, 64)]
    assert times == sorted(times)
    assert costs.gemm_shape_efficiency(a100, 1, 8, 8192, 8192) == pytest.approx(0.8 * 8 / 16)


def test_split_k_fills_the_gpu_when_few_tiles_have_a_long_k():
    a100 = hardware.gpu("A100-80GB")
    long_k = costs.gemm_shape_efficiency(a100, 1, 128, 8192, 8192)  # 32 tiles of 128x256 on 108 SMs, k split
    short_k = costs.gemm_shape_efficiency(a100, 1, 128, 8192, 1024)  # too short to split: one partial wave
    assert long_k > 0.85 and short_k < 0.7
    assert abs(costs.gemm_shape_efficiency(a100, 1, 64, 8192, 8192)
               - costs.gemm_shape_efficiency(a100, 1, 63, 8192, 8192)) < 0.05  # no cliff at the skinny threshold


def test_gemm_shape_of_aten_matmuls():
    a, b = torch.empty(3, 5, device="meta"), torch.empty(5, 7, device="meta")
    aten = torch.ops.aten
    assert costs.gemm_shape(aten.mm.default, (a, b)) == (1, 3, 7, 5)
    assert costs.gemm_shape(aten.addmm.default, (torch.empty(7, device="meta"), a, b)) == (1, 3, 7, 5)
    assert costs.gemm_shape(aten.bmm.default, (a.expand(2, 3, 5), b.expand(2, 5, 7))) == (2, 3, 7, 5)
    assert costs.gemm_shape(aten.add.Tensor, (a, a)) is None


def test_results_are_deterministic_ints():
    h100, nvlink = hardware.gpu("H100"), hardware.link("nvlink4")
    calls = [
        lambda: costs.kernel_ns(h100, 10**12, 10**9, torch.bfloat16, True, False),
        lambda: costs.copy_ns(hardware.link("pcie4"), 12345, pinned=False),
        lambda: costs.device_copy_ns(h100, 12345),
        lambda: costs.ring_allreduce_ns(nvlink, 12345, 8),
        lambda: costs.ring_allgather_ns(nvlink, 12345, 8),
        lambda: costs.ring_reduce_scatter_ns(nvlink, 12345, 8),
        lambda: costs.broadcast_ns(nvlink, 12345, 8),
    ]
    for call in calls:
        first = call()
        assert type(first) is int and first > 0
        assert all(call() == first for _ in range(3))
    assert type(costs.HOST_LAUNCH_NS) is int and costs.HOST_LAUNCH_NS > 0


def test_tensor_core_convolutions_run_below_gemm_speed_and_pay_for_nchw():
    """A convolution on tensor cores reaches CONV_TENSOR_CORE_EFFICIENCY of a GEMM's rate; on channels-first data
    it also pays cuDNN's transposes to NHWC and back; fp32 on a V100 (no tensor cores for it) keeps GEMM speed."""
    a100, v100 = hardware.gpu("A100-80GB"), hardware.gpu("V100")
    flops, nbytes = 10**12, 10**8
    half = dict(dtype=torch.float16, tensor_cores=True, allow_tf32=False)
    gemm_ns = costs.kernel_ns(a100, flops, nbytes, **half) - a100.kernel_min_us * 1000
    conv_ns = costs.kernel_ns(a100, flops, nbytes, **half, conv=True) - a100.kernel_min_us * 1000
    assert conv_ns == pytest.approx(gemm_ns / hardware.CONV_TENSOR_CORE_EFFICIENCY, rel=1e-6)
    nchw_ns = costs.kernel_ns(a100, flops, nbytes, **half, conv=True, channels_last=False) - a100.kernel_min_us * 1000
    bandwidth = a100.memory_bandwidth_gbps * a100.memory_efficiency  # bytes per ns
    assert nchw_ns == pytest.approx(conv_ns + 2 * nbytes / bandwidth, rel=1e-6)
    fp32 = dict(dtype=torch.float32, tensor_cores=True, allow_tf32=True)
    assert costs.kernel_ns(v100, flops, nbytes, **fp32, conv=True, channels_last=False) == costs.kernel_ns(
        v100, flops, nbytes, **fp32)


def test_dgx1v_cube_mesh_gives_every_gpu_six_nvlink_bricks():
    """The DGX-1V preset's hybrid cube mesh: six NVLink 2 bricks per V100, one or two per joined pair, none for
    the rest, the same seen from either end."""
    dgx1 = hardware.machine("DGX-1V")
    for gpu_index in range(dgx1.num_gpus):
        bricks = [dgx1.bricks_between(gpu_index, other) for other in range(dgx1.num_gpus) if other != gpu_index]
        assert sum(bricks) == 6 and sorted(set(bricks)) == [0, 1, 2]
    assert all(dgx1.bricks_between(a, b) == dgx1.bricks_between(b, a) for a in range(8) for b in range(8))


def test_peer_copies_follow_the_bricks_between_the_pair():
    """Two bricks copy twice as fast as one; a pair without NVLink goes through host memory over PCIe."""
    dgx1 = hardware.machine("DGX-1V")
    nvlink2, pcie3 = hardware.link("nvlink2"), hardware.link("pcie3")
    nbytes = 2**30
    one, two, none = (costs.peer_copy_ns(dgx1, nvlink2, pcie3, 0, dst, nbytes) for dst in (1, 3, 5))
    assert two < one < none
    assert (one - nvlink2.latency_us * 1000) == pytest.approx(2 * (two - nvlink2.latency_us * 1000), rel=1e-6)
    assert none > costs.copy_ns(pcie3, nbytes, pinned=True)


def test_emulating_a_machine_takes_its_gpus_and_refuses_more():
    import course

    with course.emulate(machine="DGX-1V", materialize=False) as emu:
        assert emu.num_gpus == 8 and emu.gpu.key == "V100" and emu.link.key == "nvlink2"
    with pytest.raises(ValueError, match="DGX-1V has 8 GPUs"):
        course.emulate(gpus=9, machine="DGX-1V")
    with pytest.raises(ValueError, match="choose one of: DGX-1V"):
        course.emulate(machine="DGX-2")


def _peer_copy_ms(emulate_kwargs: dict, src: int, dst: int, nbytes: int) -> float:
    """Simulated milliseconds of one copy from cuda:src to cuda:dst, timed with CUDA events as a notebook would."""
    import course

    # CUDA runs a peer copy on the source's stream, so the events go there too.
    with course.emulate(materialize=False, **emulate_kwargs), torch.cuda.device(src):
        tensor = torch.empty(nbytes, device=f"cuda:{src}", dtype=torch.uint8)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        tensor.to(f"cuda:{dst}")
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


@pytest.mark.parametrize("key, gpu, num_gpus, link, host_link", [
    ("DGX-A100", "A100-80GB", 8, "nvlink3", "pcie4"),
    ("DGX-H100", "H100", 8, "nvlink4", "pcie5"),
    ("8xL4", "L4", 8, "pcie4", "pcie4"),
    ("4xRTX4090", "RTX4090", 4, "pcie4", "pcie4"),
])
def test_each_machine_emulates_its_gpus_and_links(key, gpu, num_gpus, link, host_link):
    """A machine preset starts its own GPU model, count, peer link and host link, whatever the defaults say."""
    import course

    with course.emulate(machine=key, materialize=False) as emu:
        assert (emu.gpu.key, emu.num_gpus, emu.link.key, emu.host_link.key) == (gpu, num_gpus, link, host_link)
        assert torch.cuda.device_count() == num_gpus


@pytest.mark.parametrize("key", ["DGX-A100", "DGX-H100", "8xL4"])
def test_switched_machines_give_every_pair_the_whole_link(key):
    """Behind an NVSwitch (or a PCIe switch with peer-to-peer) every pair copies as fast as any other: over NVLink
    at the copy engines' efficiency, over PCIe at the same link's rate without a machine preset."""
    machine = hardware.machine(key)
    link = hardware.link(machine.link)
    nbytes = 2**28
    expected = _peer_copy_ms(dict(gpus=machine.num_gpus, gpu=machine.gpu, link=machine.link,
                                  host_link=machine.host_link), 0, 1, nbytes)
    if link.key.startswith("nvlink"):  # the same copy, at the copy engines' rate instead of the link's
        copy_engine_ns = link.latency_us * 1000 + nbytes / (link.bandwidth_gbps * hardware.NVLINK_P2P_COPY_EFFICIENCY)
        expected += (math.ceil(copy_engine_ns) - costs.copy_ns(link, nbytes, pinned=True)) / 1e6
    times = {_peer_copy_ms(dict(machine=key), src, dst, nbytes)
             for src, dst in ((0, 1), (0, machine.num_gpus - 1), (3, 5))}
    assert len(times) == 1 and times.pop() == pytest.approx(expected)


def test_rtx4090_peer_copies_go_through_host_memory():
    """GeForce cards have no peer-to-peer: a 4090 peer copy goes up one PCIe 4 link and down another, paying the
    host link's latency twice and the host's handoff of every staged chunk, where two L4s on the same PCIe 4 reach
    each other directly and pay the latency once."""
    nbytes = 2**28
    pcie4 = hardware.link("pcie4")
    through_host = _peer_copy_ms(dict(machine="4xRTX4090"), 0, 1, nbytes)
    direct_pcie4 = _peer_copy_ms(dict(machine="8xL4"), 0, 1, nbytes)
    handoffs_ns = math.ceil(nbytes * hardware.STAGED_COPY_STALL_NS_PER_BYTE)
    staged_ns = costs.copy_ns(pcie4, nbytes, pinned=True) + pcie4.latency_us * 1000 + handoffs_ns
    assert costs.peer_copy_ns(hardware.machine("4xRTX4090"), pcie4, pcie4, 0, 1, nbytes) == staged_ns
    assert through_host - direct_pcie4 == pytest.approx((pcie4.latency_us * 1000 + handoffs_ns) / 1e6, abs=1e-6)
    assert {_peer_copy_ms(dict(machine="4xRTX4090"), a, b, nbytes) for a, b in ((1, 0), (2, 3), (0, 3))} == {
        through_host}


def test_workers_of_a_machine_start_the_same_machine():
    """torchrun's workers rebuild the emulator from the published config: the machine must travel with it, or
    a 4090 box's workers would copy peer to peer over the whole link."""
    import json
    import os

    import course
    from course import autostart

    with course.emulate(machine="4xRTX4090", materialize=False):
        config = json.loads(os.environ[autostart.ENV])
    assert config["machine"] == "4xRTX4090"


def test_a_machine_preset_that_would_be_priced_wrongly_is_refused():
    """Bricks are costed as NVLink 2 bricks and a switch has none: presets saying otherwise fail at once."""
    with pytest.raises(ValueError, match="either every_pair_direct=True or nvlink_bricks"):
        hardware.Machine("odd", "A100-80GB", 2, "nvlink3", "pcie4", ((0, 1, 12),), every_pair_direct=True)
    with pytest.raises(ValueError, match="costed at NVLINK2_BRICK_GBPS"):
        hardware.Machine("odd", "A100-80GB", 2, "nvlink3", "pcie4", ((0, 1, 12),))


def _trace_names_during(emu, fn):
    before = len(emu.trace)
    out = fn()
    return out, [event.name for event in emu.trace[before:]]


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(mask="bool"), dict(mask="float"),
                                  dict(mask="bool", empty_row=True), dict(kv_heads=2, gqa=True),
                                  dict(kv_heads=2, gqa=True, length=1), dict(kv_heads=2, gqa=True, causal=True)],
                         ids=["plain", "causal", "bool-mask", "float-mask", "masked-row", "gqa", "gqa-decode",
                              "gqa-causal"])
def test_sdpa_on_an_emulated_gpu_is_one_fused_kernel_with_cpu_torchs_values_and_grads(case):
    """CUDA runs SDPA as one flash or memory-efficient kernel; the emulator does too, and gets the same numbers and
    gradients as plain CPU PyTorch (grouped-query heads folded into the sequence, or repeated under a causal mask).
    A query row whose every key is masked gives zeros, as CUDA's memory-efficient kernel (the one a mask sends an
    A100 to) and the math path's `_safe_softmax` do since PyTorch 2.5 (pytorch/pytorch PRs 131867, 131844)."""
    import course

    torch.manual_seed(0)
    length, kv_heads = case.get("length", 5), case.get("kv_heads", 8)
    q = torch.randn(2, 8, length, 16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 9, 16, requires_grad=True) for _ in range(2))
    mask = {"bool": torch.rand(length, 9) > 0.3, "float": torch.randn(2, 1, length, 9)}.get(case.get("mask"))
    if mask is not None and mask.dtype == torch.bool:
        mask[:, 0] = True
        if case.get("empty_row"):
            mask[2] = False
    kwargs = dict(attn_mask=mask, is_causal=case.get("causal", False), enable_gqa=case.get("gqa", False))
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    expected.sum().backward()
    with course.emulate(gpus=1) as emu:
        qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
        mc = None if mask is None else mask.cuda()
        out, names = _trace_names_during(
            emu, lambda: F.scaled_dot_product_attention(qc, kc, vc, **dict(kwargs, attn_mask=mc)))
        out.sum().backward()
        assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 1
        assert not any("bmm" in name or "softmax" in name for name in names)
        torch.testing.assert_close(out.cpu(), expected)
        for emulated, plain in zip((qc, kc, vc), (q, k, v)):
            torch.testing.assert_close(emulated.grad.cpu(), plain.grad, atol=1e-4, rtol=1e-4)
        if case.get("empty_row"):
            assert torch.count_nonzero(out[:, :, 2].cpu()) == 0


def test_shape_only_sdpa_reads_keys_once_unless_the_math_backend_is_asked_for():
    """At batch-1 decode the fused kernel moves q, k, v and the output once; `sdpa_kernel(SDPBackend.MATH)` (as
    gpt-fast's decode loop asks) runs the math path's kernels instead, with its fp32 attention matrix."""
    import course
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with course.emulate(gpus=1, materialize=False) as emu:
        q = torch.empty(1, 28, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(1, 4, 2048, 128, device="cuda", dtype=torch.bfloat16)
        before = len(emu.trace)
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        (fused,) = emu.trace[before:]
        assert fused.bytes < 1.1 * (2 * k.numel() * 2 + 2 * q.numel() * 2 + 28 * 4)
        before = len(emu.trace)
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        assert len(emu.trace) - before > 3


def test_module_calls_and_the_ops_inside_them_cost_the_host():
    """The same op costs the host HOST_MODULE_OP_NS more inside a module's forward than in a bare loop, and each
    module call HOST_MODULE_CALL_NS; ops outside any module (and every op outside the emulator) pay neither."""
    import course

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    with course.emulate(gpus=1, materialize=False) as emu:
        x = torch.empty(4, device="cuda")
        start = emu.clock.host_ns
        x * 2
        bare = emu.clock.host_ns - start
        start = emu.clock.host_ns
        Double()(x)
        in_module = emu.clock.host_ns - start
    assert bare == costs.HOST_LAUNCH_NS
    assert in_module == costs.HOST_LAUNCH_NS + costs.HOST_MODULE_OP_NS + costs.HOST_MODULE_CALL_NS
    assert torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl  # PyTorch's own once the emulator stops


def test_a_non_blocking_copy_to_the_host_lands_in_pinned_memory():
    """PyTorch's `_to_copy` allocates pinned memory for a non-blocking device-to-host copy, so it runs at the pinned
    rate; a blocking one lands in pageable memory."""
    import course

    def copy_ms(non_blocking):
        with course.emulate(gpus=1, host_link="pcie4", materialize=False) as emu:
            x = torch.empty(2**28, device="cuda", dtype=torch.uint8)
            x.to("cpu", non_blocking=non_blocking)
            (event,) = [e for e in emu.trace if e.name.startswith("copy cuda:0->cpu")]
            return event.end_ns - event.start_ns

    link = hardware.link("pcie4")
    assert copy_ms(True) == costs.copy_ns(link, 2**28, pinned=True)
    assert copy_ms(False) == costs.copy_ns(link, 2**28, pinned=False)


def test_shape_only_ops_that_wrap_a_python_scalar_run_as_on_a_gpu():
    """`torch.where(mask, -inf, logits)` (gpt-fast's top-k sampling) wraps the scalar in a 0-dim tensor on the
    wrapper's C++ device, meta in shape-only mode: like a 0-dim CPU tensor, it joins the GPU op."""
    import course

    with course.emulate(gpus=1, materialize=False):
        logits = torch.empty(32000, device="cuda")
        out = torch.where(logits < logits[:1], -float("inf"), logits)
        assert out.device == torch.device("cuda", 0) and out.shape == logits.shape
