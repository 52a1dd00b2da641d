"""torch.profiler with CUDA activity and torch.cuda.nvtx under the emulator, read against its trace."""
import json
import os
from collections import Counter, defaultdict

import pytest
import torch
import torch.cuda.nccl
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.autograd.profiler_util import _format_time
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

import course
from course.cuda.profiling import device_event_name

CPU_AND_CUDA = [ProfilerActivity.CPU, ProfilerActivity.CUDA]


def _model(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    # foreach=True: the multi-tensor path SGD takes by default on a GPU, so CPU and emulated runs match.
    return model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)


def _train_step(model, optimizer, device):
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    with record_function("train_step"):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def _gpu_work_since(emu, before: Counter) -> list:
    """The kernels, copies and collectives the emulator recorded since `before` was taken."""
    return [e for e in (Counter(emu.trace) - before).elements() if e.device != "host"]


def _durations_ns(events) -> dict:
    totals = defaultdict(int)
    for e in events:
        totals[device_event_name(e)] += e.duration_ns
    return dict(totals)


def test_table_cuda_columns_are_the_simulated_gpu_times(capfd):
    with course.emulate(gpus=2) as emu:
        model, optimizer = _model("cuda")
        _train_step(model, optimizer, "cuda")
        before = Counter(emu.trace)
        with profile(activities=CPU_AND_CUDA) as prof:
            for _ in range(2):
                _train_step(model, optimizer, "cuda")
        gpu_work = _gpu_work_since(emu, before)
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total", row_limit=10)
    assert capfd.readouterr().err == ""  # no C++ warnings, no kineto chatter: notebooks stay clean
    assert "Self CUDA" in table and "CUDA total" in table

    expected = _durations_ns(gpu_work)
    device_rows = {a.key: round(a.self_device_time_total * 1e3) for a in averages
                   if a.device_type == DeviceType.CUDA}
    assert device_rows == expected
    total_ns = sum(expected.values())
    assert f"Self CUDA time total: {_format_time(total_ns / 1e3)}" in table
    rows = {a.key: a for a in averages if a.device_type == DeviceType.CPU}
    # the op that launched a kernel carries its time, and a record_function range sums its ops
    assert round(rows["aten::addmm"].self_device_time_total * 1e3) == expected["aten::addmm (GPU kernel)"]
    assert round(rows["train_step"].device_time_total * 1e3) == total_ns - expected["copy cuda:0->cpu"]
    assert round(rows["aten::item"].device_time_total * 1e3) == expected["copy cuda:0->cpu"]  # loss.item()
    assert rows["cudaLaunchKernel"].count == sum(e.kind == "kernel" for e in gpu_work)
    assert "PythonSubclass" not in table


def test_cpu_rows_are_those_of_a_plain_cpu_profile():
    def profiled_names(device, activities):
        model, optimizer = _model(device)
        with profile(activities=activities) as prof:
            _train_step(model, optimizer, device)
        return {a.key for a in prof.key_averages() if a.device_type == DeviceType.CPU}

    plain = profiled_names("cpu", [ProfilerActivity.CPU])
    with course.emulate(gpus=1):
        cpu_only = profiled_names("cuda", [ProfilerActivity.CPU])
        with_cuda = profiled_names("cuda", CPU_AND_CUDA)
    assert {"train_step", "aten::linear", "aten::addmm", "Optimizer.step#SGD.step"} <= cpu_only <= plain
    assert with_cuda - cpu_only <= {"cudaLaunchKernel", "cudaMemcpyAsync"}


def test_chrome_trace_has_cpu_ops_and_gpu_kernels_with_simulated_durations(tmp_path):
    path = str(tmp_path / "trace.json")
    with course.emulate(gpus=2) as emu:
        model, optimizer = _model("cuda")
        before = Counter(emu.trace)
        with profile(activities=CPU_AND_CUDA) as prof:
            _train_step(model, optimizer, "cuda")
            torch.ones(256, device="cuda:0").to("cuda:1").mul_(2)
        gpu_work = _gpu_work_since(emu, before)
    prof.export_chrome_trace(path)
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"]
    on_gpus = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    assert sorted((e["pid"], e["tid"], e["name"], round(e["dur"] * 1e3)) for e in on_gpus) == sorted(
        (int(e.device.split(":")[1]), e.stream, device_event_name(e), e.duration_ns) for e in gpu_work)
    assert {e["pid"] for e in on_gpus} == {0, 1}
    labels = {e["pid"]: e["args"]["labels"] for e in events if e.get("name") == "process_labels"}
    assert labels[0] == "GPU 0" and labels[1] == "GPU 1"
    names = Counter(e["name"] for e in events if e.get("ph") == "X" and e.get("cat") != "kernel")
    assert names["train_step"] == 1 and names["aten::addmm"] >= 1 and names["PythonSubclass"] == 0
    launches = [e for e in events if e.get("cat") == "cuda_runtime"]
    assert len(launches) == len(gpu_work)
    assert [d["name"] for d in data["deviceProperties"]] == [emu.gpu.name] * 2


def test_schedule_step_and_tensorboard_handler(tmp_path):
    with course.emulate(gpus=1) as emu:
        model, optimizer = _model("cuda")
        with profile(activities=CPU_AND_CUDA, schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                     on_trace_ready=tensorboard_trace_handler(str(tmp_path))) as prof:
            for step in range(5):
                if step == 2:
                    before = Counter(emu.trace)
                if step == 4:
                    active = _gpu_work_since(emu, before)
                _train_step(model, optimizer, "cuda")
                prof.step()
    (written,) = os.listdir(tmp_path)
    with open(tmp_path / written) as f:
        events = json.load(f)["traceEvents"]
    kernels = Counter((e["name"], round(e["dur"] * 1e3)) for e in events if e.get("cat") == "kernel")
    assert kernels == Counter((device_event_name(e), e.duration_ns) for e in active if e.kind == "kernel")
    averages = prof.key_averages()
    steps = [a for a in averages if a.key == "ProfilerStep*"]
    assert steps[0].count == 2
    assert round(steps[0].device_time_total * 1e3) == sum(e.duration_ns for e in active)


def test_autograd_profiler_with_cuda():
    with course.emulate(gpus=1) as emu:
        model, _ = _model("cuda")
        x = torch.randn(16, 32, device="cuda")
        before = Counter(emu.trace)
        with torch.autograd.profiler.profile(use_device="cuda") as by_device:
            model(x)
        expected = _durations_ns(_gpu_work_since(emu, before))
        with pytest.warns(FutureWarning):  # deprecated in PyTorch, as on a GPU
            with torch.autograd.profiler.profile(use_cuda=True) as by_flag:
                model(x)
    for prof in (by_device, by_flag):
        rows = {a.key: round(a.self_device_time_total * 1e3) for a in prof.key_averages()
                if a.device_type == DeviceType.CUDA}
        assert rows == expected


def test_collectives_and_cuda_only_profiles():
    with course.emulate(gpus=2) as emu:
        tensors = [torch.ones(1024, device=f"cuda:{i}") for i in range(2)]
        before = Counter(emu.trace)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda.nccl.all_reduce(tensors)
        gpu_work = _gpu_work_since(emu, before)
        assert tensors[1].cpu().tolist() == [2.0] * 1024
    assert {e.kind for e in gpu_work} == {"collective"}
    averages = prof.key_averages()
    assert all(a.device_type == DeviceType.CUDA for a in averages)  # only what was asked for
    assert {a.key: round(a.self_device_time_total * 1e3) for a in averages} == _durations_ns(gpu_work)


def test_stopping_the_emulator_restores_the_profiler_and_keeps_results(capfd):
    real_init = torch.autograd.profiler.profile.__init__
    real_supported = torch.autograd._supported_activities()
    emu = course.emulate(gpus=1).start()
    try:
        assert ProfilerActivity.CUDA in torch.profiler.supported_activities()
        model, optimizer = _model("cuda")
        prof = profile(activities=CPU_AND_CUDA)
        prof.start()
        _train_step(model, optimizer, "cuda")
    finally:
        emu.stop()  # the profile still running ends here...
    torch.ones(3).add(1)
    prof.stop()  # ... so its own stop has nothing left to do
    assert capfd.readouterr().err == ""
    assert torch.autograd.profiler.profile.__init__ is real_init
    assert torch.autograd._supported_activities() == real_supported
    assert not {"launch", "launch_collective", "record"} & set(vars(emu.clock))
    keys = {a.key for a in prof.key_averages()}
    assert "aten::addmm (GPU kernel)" in keys and "aten::ones" not in keys


def test_nvtx_ranges_on_the_host_timeline(tmp_path):
    nvtx = torch.cuda.nvtx
    with course.emulate(gpus=2) as emu:
        assert nvtx.range_pop() < 0  # nothing pushed: NVTX reports an error with a negative value
        model, optimizer = _model("cuda")
        depths = [nvtx.range_push("epoch 0")]
        for step in range(2):
            with nvtx.range("step {}", step):
                depths.append(nvtx.range_push("forward"))
                model(torch.randn(16, 32, device="cuda")).sum().backward()
                depths.append(nvtx.range_pop())
                nvtx.mark("optimizer")
                optimizer.step()
        depths.append(nvtx.range_pop())
        handle = nvtx.range_start("copy to cuda:1")
        torch.ones(4096, device="cuda:0").to("cuda:1").sum().item()
        nvtx.range_end(handle)
        trace = emu.trace
        ax = emu.plot_timeline()
        image = tmp_path / "nvtx_timeline.png"
        ax.figure.savefig(image)
        chrome = json.loads(open(emu.export_chrome_trace(str(tmp_path / "emu.json"))).read())
    assert depths == [0, 2, 2, 2, 2, 0]
    ranges = {(e.name, e.stream): e for e in trace if e.kind == "nvtx"}
    assert set(ranges) == {("epoch 0", 0), ("step 0", 1), ("step 1", 1), ("forward", 2),
                           ("optimizer", 2), ("copy to cuda:1", 0)}
    epoch, step0 = ranges[("epoch 0", 0)], ranges[("step 0", 1)]
    assert epoch.start_ns <= step0.start_ns < step0.end_ns <= epoch.end_ns
    assert ranges[("optimizer", 2)].duration_ns == 0
    copy = [e for e in trace if e.kind == "copy" and e.peer == "cuda:1"][0]
    assert ranges[("copy to cuda:1", 0)].end_ns >= copy.end_ns  # .item() waited for the copy
    assert "NVTX" in [label.get_text() for label in ax.get_yticklabels()]
    assert image.stat().st_size > 10_000
    nvtx_events = [e for e in chrome["traceEvents"] if e.get("cat") == "nvtx"]
    assert Counter(e["name"] for e in nvtx_events) == Counter(e.name for e in trace if e.kind == "nvtx")
    with pytest.raises(RuntimeError, match="NVTX functions not installed"):
        nvtx.range_push("after stop")  # a CPU build of torch, as before


def test_gpu_columns_keep_the_cuda_columns_and_gpu_rows_of_the_real_table():
    """gpu_columns drops the CPU columns and rows without GPU time from a real table; the CUDA numbers are kept as
    printed, rows ordered by CUDA total then name, so two runs of the same program print the same text."""
    from course.lessons.profile_table import gpu_columns

    tables = []
    for _ in range(2):
        with course.emulate(gpus=2, materialize=False) as emu:
            a = torch.empty(512, 512, device="cuda:0")
            torch.cuda.synchronize()
            with profile(activities=CPU_AND_CUDA) as prof:
                (a.to("cuda:1") @ a.to("cuda:1")).to("cuda:0")
                torch.cuda.synchronize()
        tables.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    shown = [gpu_columns(table) for table in tables]
    assert shown[0] == shown[1]
    lines = shown[0].split("\n")
    assert "CPU" not in lines[1] and "CUDA total" in lines[1] and "# of Calls" in lines[1]
    assert lines[-1].startswith("Self CUDA time total:") and "Self CPU" not in shown[0]
    gpu_time = {a.key: _format_time(a.device_time_total) for a in prof.key_averages() if a.device_time_total > 0}
    name_width = lines[0].index("  ")
    rows = {line[:name_width].strip(): line for line in lines[3:-2]}
    assert sorted(rows) == sorted(gpu_time)  # every row that ran GPU work, and only those
    for name, line in rows.items():
        assert gpu_time[name] in line
    totals = [a.device_time_total for name in rows for a in prof.key_averages() if a.key == name]
    assert totals == sorted(totals, reverse=True)
    with pytest.raises(ValueError, match="ProfilerActivity.CUDA"):
        gpu_columns(tables[0].replace("CUDA total", "CPU  total"))


def test_emit_nvtx_and_capture_range_calls_run_as_on_a_gpu():
    """NVIDIA's scripts wrap steps in torch.cuda.profiler.profile() and autograd's emit_nvtx for Nsight Systems:
    neither changes a number; on the emulator the block is one NVTX range and the capture calls are marks (a CPU
    build refused both: 'compiled without CUDA', 'cudart is not modelled')."""
    x = torch.randn(8, 8)
    with course.emulate(gpus=1) as emu:
        with torch.cuda.profiler.profile(), pytest.warns(UserWarning, match="emit_nvtx is not modelled op by op"):
            with torch.autograd.profiler.emit_nvtx(record_shapes=True):
                y = (x.to("cuda") @ x.to("cuda")).relu().sum().item()
        with torch.autograd.profiler.emit_nvtx(enabled=False):
            pass
        marks = [(e.name, e.end_ns > e.start_ns) for e in emu.trace if e.kind == "nvtx"]
    assert y == pytest.approx((x @ x).relu().sum().item(), rel=1e-6)
    assert marks == [("cudaProfilerStart", False), ("emit_nvtx", True), ("cudaProfilerStop", False)]
    assert torch.autograd.profiler.emit_nvtx.__module__ == "torch.autograd.profiler"  # PyTorch's own again
