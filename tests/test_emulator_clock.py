"""The simulated clock, memory accounting, streams, events and shape-only mode."""
import warnings

import pytest
import torch

import course
from course.machine import costs, hardware


def _kernels(emu, name):
    return [e for e in emu.trace if e.kind == "kernel" and e.name == name]


def test_launches_are_asynchronous_and_item_blocks_the_host():
    with course.emulate(gpus=1) as emu:
        a = torch.randn(1024, 1024, device="cuda:0")
        before = emu.clock.host_ns
        b = a @ a
        mm = _kernels(emu, "aten::mm")[0]
        assert emu.clock.host_ns == before + costs.HOST_LAUNCH_NS  # the host only paid the launch
        assert mm.end_ns > emu.clock.host_ns  # ... while the GPU is still busy
        b[0, 0].item()
        assert emu.clock.host_ns >= mm.end_ns
        waits = [e for e in emu.trace if e.kind == "host"]
        assert waits and waits[-1].end_ns >= mm.end_ns


def test_printing_and_cpu_block_the_host():
    with course.emulate(gpus=1) as emu:
        a = torch.randn(2048, 2048, device="cuda:0")
        b = a @ a
        end = _kernels(emu, "aten::mm")[0].end_ns
        repr(b)
        assert emu.clock.host_ns >= end
        c = b @ b
        c.cpu()
        assert emu.clock.host_ns > _kernels(emu, "aten::mm")[1].end_ns


def test_matmul_time_follows_the_roofline_and_dtype():
    gpu = hardware.gpu("A100-80GB")
    with course.emulate(gpus=1, gpu="A100-80GB") as emu:
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(1024, 1024, device="cuda:0", dtype=dtype)
            a @ a
        fp32, bf16 = _kernels(emu, "aten::mm")
    assert fp32.flops == bf16.flops == 2 * 1024**3
    expected = costs.kernel_ns(gpu, fp32.flops, fp32.bytes, torch.float32, True, False, gemm=(1, 1024, 1024, 1024))
    assert fp32.duration_ns == expected
    assert bf16.duration_ns < fp32.duration_ns / 5  # tensor cores: 312 vs 19.5 TFLOP/s peak


def test_tf32_switch_speeds_up_fp32_matmuls():
    """Timed at the TF32 rate, but the numbers stay full float32 (the CPU's), and a warning says so rather than
    let the speed-up pass for a GPU's TF32 rounding (not for convolutions, where cuDNN's TF32 is the default); Volta
    has no TF32, so there the numbers are a GPU's."""
    with course.emulate(gpus=1) as emu:
        a = torch.randn(2048, 2048, device="cuda:0")
        want = a @ a
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            with pytest.warns(UserWarning, match="computes them in full float32"):
                got = a @ a
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
        plain, tf32 = _kernels(emu, "aten::mm")
        assert torch.equal(got.cpu(), want.cpu())
        a = a.cpu()
    assert tf32.duration_ns < plain.duration_ns / 4
    with course.emulate(gpus=1), warnings.catch_warnings():
        warnings.simplefilter("error")  # cuDNN's TF32 is on by default: no warning for every convolution
        torch.nn.functional.conv2d(torch.randn(1, 3, 8, 8).cuda(), torch.randn(4, 3, 3, 3).cuda())
    with course.emulate(gpus=1, gpu="V100"):
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                a.cuda() @ a.cuda()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False


def test_peer_copies_wait_for_the_source_and_use_the_link():
    timings = {}
    for link in ("nvlink3", "pcie4"):
        with course.emulate(gpus=2, link=link) as emu:
            a = torch.randn(2048, 2048, device="cuda:0")
            b = a @ a
            b.to("cuda:1")
            mm = _kernels(emu, "aten::mm")[0]
            copy = [e for e in emu.trace if e.kind == "copy"][-1]
            assert copy.start_ns >= mm.end_ns  # the copy waited for the matmul that produced b
            assert (copy.device, copy.peer) == ("cuda:0", "cuda:1")
            assert copy.bytes == b.numel() * 4
            timings[link] = copy.duration_ns
    assert timings["nvlink3"] * 5 < timings["pcie4"]


def test_pinned_memory_is_faster_and_non_blocking_lets_the_host_go_on():
    with course.emulate(gpus=1) as emu:
        pageable = torch.randn(1024, 1024)
        pinned = pageable.pin_memory()
        assert pinned.is_pinned() and not pageable.is_pinned()
        pageable.to("cuda:0")
        slow = emu.trace[-2]
        assert emu.clock.host_ns >= slow.end_ns  # a pageable copy blocks the host
        host_before = emu.clock.host_ns
        pinned.to("cuda:0", non_blocking=True)
        fast = [e for e in emu.trace if e.kind == "copy"][-1]
        assert fast.duration_ns < slow.duration_ns
        assert emu.clock.host_ns == host_before + costs.HOST_LAUNCH_NS < fast.end_ns


def test_factories_make_pinned_buffers_as_on_a_cuda_machine():
    """`torch.empty(..., pin_memory=True)` (a staging buffer for async copies) fails on CPU torch alone."""
    with course.emulate(gpus=1) as emu:
        buffer = torch.empty(256, 256, pin_memory=True)
        assert buffer.is_pinned() and buffer.device == torch.device("cpu")
        buffer.copy_(torch.ones(256, 256))
        moved = buffer.to("cuda:0", non_blocking=True)
        assert not [e for e in emu.trace if e.kind == "host"], "a copy from pinned memory must not block the host"
        assert torch.equal(moved.cpu(), torch.ones(256, 256))


def test_streams_overlap_and_events_time_them():
    with course.emulate(gpus=1) as emu:
        a = torch.randn(2048, 2048, device="cuda:0")
        torch.cuda.synchronize()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.cuda.stream(s1):
            a @ a
        with torch.cuda.stream(s2):
            a @ a
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)
        end.record()
        with pytest.raises(RuntimeError, match="Both events must be completed before calculating elapsed time"):
            start.elapsed_time(end)  # the classic mistake: reading the time before synchronising
        end.synchronize()
        k1, k2 = _kernels(emu, "aten::mm")
        assert (k1.stream, k2.stream) == (s1.stream_id, s2.stream_id)
        assert k2.start_ns < k1.end_ns  # the two streams ran at the same time
        assert start.elapsed_time(end) == pytest.approx((k2.end_ns - start.time_ns) / 1e6)


def test_same_stream_work_is_serialised():
    with course.emulate(gpus=1) as emu:
        a = torch.randn(1024, 1024, device="cuda:0")
        a @ a
        a @ a
        k1, k2 = _kernels(emu, "aten::mm")
        assert k2.start_ns >= k1.end_ns


def test_events_need_enable_timing():
    with course.emulate(gpus=1):
        start, end = torch.cuda.Event(), torch.cuda.Event()
        start.record(), end.record()
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="enable_timing=True"):
            start.elapsed_time(end)


def test_memory_counts_live_and_peak_and_gives_memory_back():
    with course.emulate(gpus=2):
        assert torch.cuda.memory_allocated(0) == 0
        a = torch.empty(1024, 1024, device="cuda:0")
        assert torch.cuda.memory_allocated(0) == 4 * 2**20
        assert torch.cuda.memory_allocated(1) == 0
        view = a[:10]
        assert torch.cuda.memory_allocated(0) == 4 * 2**20  # a view allocates nothing
        b = a * 2
        assert torch.cuda.memory_allocated(0) == 8 * 2**20
        del a, view, b
        assert torch.cuda.memory_allocated(0) == 0
        assert torch.cuda.max_memory_allocated(0) == 8 * 2**20
        torch.cuda.reset_peak_memory_stats(0)
        assert torch.cuda.max_memory_allocated(0) == 0
        small = torch.empty(1, device="cuda:1")
        assert torch.cuda.memory_allocated(1) == 512  # rounded like the caching allocator
        del small


def test_storage_resize_frees_and_takes_back_gpu_memory():
    """`untyped_storage().resize_(0)` (how FSDP and ZeRO-3 free a parameter's memory and keep the tensor) gave the
    bytes back to nothing: memory_allocated stayed where a GPU's drops. Now it drops, comes back with resize_(n),
    and the tensor and its views still work; what dies after is counted once."""
    with course.emulate(gpus=1):
        buf = torch.zeros(2**16, device="cuda")
        view = buf[:10]
        nbytes = buf.untyped_storage().nbytes()
        assert torch.cuda.memory_allocated() == nbytes
        buf.untyped_storage().resize_(0)
        assert torch.cuda.memory_allocated() == 0 and buf.untyped_storage().nbytes() == 0
        buf.untyped_storage().resize_(nbytes)
        assert torch.cuda.memory_allocated() == nbytes
        buf.fill_(2.0)
        assert view.sum().item() == 20.0
        buf._typed_storage()._resize_(0)  # FSDP1's _free_storage
        assert torch.cuda.memory_allocated() == 0
        del buf, view
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_stats()["active.all.current"] == 0


def test_out_of_memory_is_raised_before_the_cpu_allocates():
    with course.emulate(gpus=1, gpu="T4") as emu:
        capacity = emu.gpu.memory_bytes
        assert torch.cuda.get_device_properties(0).total_memory == capacity
        with pytest.raises(torch.cuda.OutOfMemoryError,
                           match=r"CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                 r"capacity of 16.00 GiB of which 16.00 GiB is free"):
            torch.empty(20 * 2**30, dtype=torch.uint8, device="cuda:0")
        assert torch.cuda.memory_allocated(0) == 0


def test_device_api_reports_the_preset():
    with course.emulate(gpus=3, gpu="H100"):
        props = torch.cuda.get_device_properties(2)
        preset = hardware.gpu("H100")
        assert torch.cuda.get_device_name() == preset.name == props.name
        assert props.multi_processor_count == preset.multi_processor_count
        assert torch.cuda.device_count() == 3 and torch.cuda.is_available()
        assert torch.cuda.get_device_capability() == preset.compute_capability


def _stub_fields(class_name: str) -> set[str]:
    """The fields torch's own type stub (torch/_C/__init__.pyi) gives a C++ class; a CPU build does not bind it."""
    import ast
    from pathlib import Path
    tree = ast.parse((Path(torch.__file__).parent / "_C" / "__init__.pyi").read_text())
    stub = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.target.id for n in stub.body if isinstance(n, ast.AnnAssign)}


@pytest.mark.parametrize("preset", list(hardware.GPUS))
def test_device_properties_have_every_field_of_pytorchs(preset):
    """torch 2.13's _CudaDeviceProperties fields, and those torch's Python reads beyond its stub (the profiler's
    trace export: max_threads_per_block, regs_per_multiprocessor; inductor: shared_memory_per_block_optin), each
    from the preset: the memory clock and bus width give the datasheet bandwidth by CUDA's formula, the SM clock
    the FP32 peak; a UUID that is stable across emulators and distinct per GPU."""
    gpu = hardware.gpu(preset)
    with course.emulate(gpus=2, gpu=preset):
        props, other = torch.cuda.get_device_properties(1), torch.cuda.get_device_properties(0)
    with course.emulate(gpus=2, gpu=preset):
        again = torch.cuda.get_device_properties("cuda:1")
    fields = _stub_fields("_CudaDeviceProperties") | {"max_threads_per_block", "regs_per_multiprocessor",
                                                      "shared_memory_per_block_optin"}
    assert all(getattr(props, name) is not None for name in fields)
    assert 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8 == pytest.approx(
        gpu.memory_bandwidth_gbps * 1e9, rel=1e-5)
    lanes = hardware.FP32_LANES_PER_SM[gpu.compute_capability]
    assert 2 * lanes * props.multi_processor_count * props.clock_rate * 1e3 == pytest.approx(
        gpu.peak_tflops["fp32"] * 1e12, rel=1e-5)
    assert props.warp_size == 32 and props.L2_cache_size > 2**20 and props.gcnArchName == gpu.name
    assert props.shared_memory_per_block < props.shared_memory_per_block_optin <= props.shared_memory_per_multiprocessor
    assert str(props.uuid) == str(again.uuid) != str(other.uuid) and len(props.uuid.bytes) == 16
    assert f"uuid={props.uuid}" in repr(props)


def _workload():
    torch.manual_seed(0)
    a = torch.randn(512, 512, device="cuda:0", requires_grad=True)
    b = a.to("cuda:1") @ torch.randn(512, 256, device="cuda:1")
    b.sum().backward()
    return a.grad.sum().item()


def test_the_trace_is_identical_run_after_run():
    traces = []
    for _ in range(2):
        with course.emulate(gpus=2) as emu:
            _workload()
        traces.append(emu.trace)
    assert traces[0] == traces[1]


def test_shape_only_mode_times_like_the_real_run_without_values():
    with course.emulate(gpus=2) as real:
        _workload()
    with course.emulate(gpus=2, materialize=False) as shapes:
        with pytest.raises(RuntimeError, match="shape-only"):
            _workload()
        shape_kernels = [(e.kind, e.name, e.start_ns, e.end_ns) for e in shapes.trace if e.kind != "host"]
        assert "shape only" in repr(torch.ones(3, device="cuda:0"))
    kernels = [(e.kind, e.name, e.start_ns, e.end_ns) for e in real.trace if e.kind != "host"]
    assert shape_kernels == kernels[:len(shape_kernels)] and len(shape_kernels) > 5


def test_shape_only_mode_handles_real_scale_without_memory():
    with course.emulate(gpus=8, gpu="H100", link="nvlink4", materialize=False) as emu:
        layers = [torch.nn.Linear(16384, 16384, device=f"cuda:{i}") for i in range(8)]
        x = torch.randn(64, 16384, device="cuda:0")
        for i, layer in enumerate(layers):
            x = layer(x.to(f"cuda:{i}"))
        torch.cuda.synchronize(7)
        assert x.shape == (64, 16384) and x.device.index == 7
        assert torch.cuda.memory_allocated(3) >= 16384 * 16384 * 4  # 8 GiB of weights, none on the CPU
    assert emu.now_ms() > 0


def test_ops_without_a_shape_only_version_name_the_op():
    with course.emulate(gpus=1, materialize=False):
        x = torch.randn(10, device="cuda:0")
        with pytest.raises(NotImplementedError, match="aten.nonzero"):
            torch.nonzero(x)


def test_bad_arguments_get_clear_messages():
    with pytest.raises(ValueError, match="unknown GPU preset 'A100'; choose one of: V100, A100-40GB"):
        course.emulate(gpu="A100", force=True)
    with pytest.raises(ValueError, match="unknown link preset 'nvlink9'"):
        course.emulate(link="nvlink9", force=True)
    with pytest.raises(ValueError, match="gpus must be a whole number of GPUs, 1 or more; got 0"):
        course.emulate(gpus=0, force=True)


def test_a_copy_within_a_gpu_moves_its_bytes_twice_not_three_times():
    with course.emulate(gpus=1) as emu:
        src = torch.randn(1024, 1024, device="cuda:0")
        dst = torch.empty(1024, 1024, device="cuda:0")
        dst.copy_(src)
        clone = src.clone()
        copy_event, clone_event = _kernels(emu, "aten::copy_")[0], _kernels(emu, "aten::clone")[0]
    assert copy_event.bytes == clone_event.bytes == 2 * src.numel() * 4
    assert copy_event.duration_ns == clone_event.duration_ns


def test_views_cost_the_host_but_launch_nothing():
    """Views (and `_unsafe_view`, which `linear` reshapes with) cost the host a dispatch and the GPU nothing."""
    with course.emulate(gpus=1, materialize=False) as emu:
        a = torch.empty(64, 4, 32, device="cuda:0")
        launched = len(emu.trace)
        before = emu.clock.host_ns
        b = a.view(64, 128).t()
        assert emu.clock.host_ns == before + 2 * costs.HOST_VIEW_NS
        c = torch.ops.aten._unsafe_view(b, (128, 64))
        assert emu.clock.host_ns == before + 3 * costs.HOST_VIEW_NS
        assert len(emu.trace) == launched and c.device == torch.device("cuda:0")


def test_many_small_ops_make_the_host_the_bottleneck():
    """Eager code of tiny ops is host-bound: the step takes the host's time, and the GPU idles between kernels."""
    with course.emulate(gpus=1, gpu="H100") as emu:
        x = torch.randn(1, 64, device="cuda:0")
        torch.cuda.synchronize()
        start = emu.clock.host_ns
        for _ in range(100):
            x = (x.view(64, 1) * 1.0).view(1, 64)
        torch.cuda.synchronize()
        host_cost = 100 * (costs.HOST_LAUNCH_NS + 2 * costs.HOST_VIEW_NS)
        gpu_busy = sum(e.end_ns - e.start_ns for e in _kernels(emu, "aten::mul"))
        assert gpu_busy < host_cost
        assert emu.clock.host_ns - start >= host_cost


def test_an_embedding_lookup_reads_its_rows_not_the_table():
    """`nn.Embedding` on a GPU reads the rows it returns: a lookup into a 1 GB table is not a 1 GB read."""
    with course.emulate(gpus=1, gpu="A100-80GB", materialize=False) as emu:
        table = torch.empty(250_000, 1024, device="cuda:0")
        tokens = torch.zeros(8, dtype=torch.long, device="cuda:0")
        out = torch.nn.functional.embedding(tokens, table)
        lookup = _kernels(emu, "aten::embedding")[0]
        row_bytes = out.numel() * out.element_size()
        assert lookup.bytes == 2 * row_bytes + tokens.numel() * tokens.element_size()


def test_shape_only_convolutions_keep_channels_last_as_cudnn_does():
    """cuDNN returns channels-last results for channels-last inputs, forward and backward; shape-only mode must
    too, or every later layer would be costed as channels-first."""
    with course.emulate(gpus=1, materialize=False) as emu:
        conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda().to(memory_format=torch.channels_last)
        x = torch.empty(4, 16, 8, 8, device="cuda:0", requires_grad=True).to(memory_format=torch.channels_last)
        y = conv(x)
        assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
        y.sum().backward()
        assert _kernels(emu, "aten::convolution_backward")
        plain = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()(torch.empty(4, 16, 8, 8, device="cuda:0"))
        assert plain.is_contiguous()


def test_compute_idle_and_host_waits_read_a_loop_from_the_trace():
    """compute_idle_ns is the time between a device's kernels (overlapping streams count once, from start_ns
    when given); host_waits_before_last_kernel names the syncs that stopped the host before the last launch."""
    from course.machine.trace import compute_idle_ns, host_waits_before_last_kernel

    with course.emulate(gpus=1, materialize=False) as emu:
        a = torch.empty(4096, 4096, device="cuda:0")
        torch.cuda.synchronize()
        start_ns = emu.clock.host_ns
        a @ a
        torch.cuda.synchronize()  # the GPU drains, then waits for the host's next launch
        a @ a
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            a @ a  # overlaps the previous matmul on the default stream
        torch.cuda.synchronize()
    first, second, third = _kernels(emu, "aten::mm")
    assert third.start_ns < second.end_ns  # the side stream's matmul does overlap
    assert compute_idle_ns(emu.trace, "cuda:0") == second.start_ns - first.end_ns > 0
    assert compute_idle_ns(emu.trace, "cuda:0", start_ns) == (first.start_ns - start_ns) + (second.start_ns - first.end_ns)
    assert host_waits_before_last_kernel(emu.trace, "cuda:0") == ["synchronize"]
    assert compute_idle_ns([], "cuda:0") == 0 and host_waits_before_last_kernel([], "cuda:0") == []
