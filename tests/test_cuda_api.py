"""The wider `torch.cuda` surface public scripts call, under the emulator: memory statistics and summary,
stream contexts, RNG state, legacy constructors, allocator settings, and clear errors for what is not
modelled (CUDA graphs, memory history) or runs eagerly (torch.compile)."""
from __future__ import annotations

import inspect
import io
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import course
from course.cuda import cuda_api


@pytest.fixture
def emu():
    with course.emulate(gpus=4) as emulator:
        yield emulator


# -- memory statistics -------------------------------------------------------------------------------
def test_memory_stats_count_the_bytes_of_the_tensors_made(emu):
    before = torch.cuda.memory_stats(1)
    a = torch.empty(1000, device="cuda:1")          # 4000 bytes -> 4096, small pool
    b = torch.empty(2**19, device="cuda:1")          # 2 MiB, large pool
    stats = torch.cuda.memory_stats(1)
    grew = stats["allocated_bytes.all.current"] - before["allocated_bytes.all.current"]
    assert grew == 4096 + 2**21 == torch.cuda.memory_allocated(1) - before["allocated_bytes.all.current"]
    assert stats["allocated_bytes.large_pool.current"] - before["allocated_bytes.large_pool.current"] == 2**21
    assert stats["requested_bytes.all.current"] - before["requested_bytes.all.current"] == 4000 + 2**21
    assert stats["allocation.all.current"] - before["allocation.all.current"] == 2
    assert stats["reserved_bytes.all.current"] == stats["allocated_bytes.all.current"]  # nothing cached
    assert stats["num_ooms"] == stats["num_alloc_retries"] == 0
    # every key torch.cuda.memory_summary reads is there
    for metric in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes",
                   "allocation", "active", "segment", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            for kind in ("current", "peak", "allocated", "freed"):
                assert isinstance(stats[f"{metric}.{pool}.{kind}"], int)
    del a, b
    after = torch.cuda.memory_stats(1)
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["allocated_bytes.all.freed"] - before["allocated_bytes.all.freed"] == 4096 + 2**21
    assert after["allocated_bytes.all.peak"] >= before["allocated_bytes.all.current"] + 4096 + 2**21
    assert torch.cuda.memory_stats(2)["allocated_bytes.all.current"] == 0  # other GPUs untouched


def test_memory_summary_prints_the_allocated_figure(emu):
    x = torch.empty(3 * 2**20, dtype=torch.uint8, device="cuda:2")  # 3 MiB
    summary = torch.cuda.memory_summary(device=2)
    assert "PyTorch CUDA memory summary, device ID 2" in summary
    allocated_line = next(line for line in summary.splitlines() if line.startswith("| Allocated memory"))
    assert "3072 KiB" in allocated_line
    assert "CUDA OOMs: 0" in summary
    del x


def test_peaks_and_accumulated_stats_reset(emu):
    x = torch.empty(2**20, device="cuda:0")
    del x
    assert torch.cuda.max_memory_allocated(0) >= 4 * 2**20
    with pytest.warns(FutureWarning):
        torch.cuda.reset_max_memory_allocated(0)
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)
    torch.cuda.reset_accumulated_memory_stats(0)
    stats = torch.cuda.memory_stats(0)
    assert stats["allocated_bytes.all.allocated"] == stats["allocated_bytes.all.freed"] == 0

def test_torch_accelerator_memory_functions_answer_for_the_gpus_under_both_names(emu):
    """Device-agnostic scripts call torch.accelerator's memory API, some through torch.accelerator.memory, where
    the functions live: both names read the emulated GPU's counts (unpatched, the latter asked a CPU build's
    accelerator bindings and raised "Cannot access accelerator device when none is available")."""
    before = torch.cuda.memory_allocated(2)
    x = torch.empty(2**19, device="cuda:2")
    for api in (torch.accelerator, torch.accelerator.memory):
        assert api.memory_allocated(2) - before == 2**21 == x.nbytes
        assert api.max_memory_allocated(2) >= api.memory_allocated(2) == api.memory_stats(2)[
            "allocated_bytes.all.current"]
        assert api.get_memory_info(2) == torch.cuda.mem_get_info(2)


def test_torch_accelerator_device_capability_stops_as_cudas_device_guard_does(emu):
    """torch 2.13's CUDA device guard does not override getDeviceCapability (c10/cuda/impl/CUDAGuardImpl.h), so a
    GPU box raises c10's default error, not the CPU build's "Cannot access accelerator device"."""
    with pytest.raises(RuntimeError, match="^Backend doesn't support getting device capabilities.$"):
        torch.accelerator.get_device_capability()
    assert torch.accelerator.current_accelerator() == torch.device("cuda")



def test_memory_fraction_limits_allocations_and_counts_the_oom(emu):
    capacity = torch.cuda.get_device_properties(3).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25, device=3)
    assert torch.cuda.get_per_process_memory_fraction(3) == 0.25
    with pytest.raises(TypeError, match="Invalid type for fraction"):  # PyTorch's own check
        torch.cuda.set_per_process_memory_fraction(1, device=3)
    big = torch.empty(int(capacity * 0.2), dtype=torch.uint8, device="cuda:3")
    with pytest.raises(torch.cuda.OutOfMemoryError, match="allowed;"):
        torch.empty(int(capacity * 0.1), dtype=torch.uint8, device="cuda:3")
    assert torch.cuda.memory_stats(3)["num_ooms"] == 1
    torch.empty(int(capacity * 0.1), dtype=torch.uint8, device="cuda:2")  # other GPUs keep their whole memory
    del big


def test_memory_snapshot_lists_live_blocks(emu):
    x = torch.empty(256, device="cuda:1")
    segments = torch.cuda.memory_snapshot()
    mine = [s for s in segments if s["device"] == 1 and s["requested_size"] == 1024]
    assert mine and mine[0]["total_size"] == 1024 and mine[0]["blocks"][0]["state"] == "active_allocated"
    assert torch.cuda.get_allocator_backend() == "native"
    # empty_cache synchronizes every GPU's streams first, and the caching allocator counts it
    syncs = [torch.cuda.memory_stats(device)["num_sync_all_streams"] for device in range(4)]
    torch.cuda.empty_cache()
    torch.cuda.memory.empty_cache()
    assert [torch.cuda.memory_stats(device)["num_sync_all_streams"] for device in range(4)] == [n + 2 for n in syncs]
    torch.cuda.reset_accumulated_memory_stats(1)
    assert torch.cuda.memory_stats(1)["num_sync_all_streams"] == 0
    del x


def test_memory_history_records_allocations_with_their_python_stack(emu, tmp_path):
    """_record_memory_history, _snapshot and _dump_snapshot as memory-profiling tutorials use them: the trace has
    each allocation and free of the emulated GPU, with the learner's line and none of the emulator's."""
    torch.cuda.memory._record_memory_history(max_entries=100)
    x = torch.empty(256, device="cuda:1")
    y = torch.empty(512, device="cuda:1")
    del y
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.empty(8, device="cuda:1")
    trace = snapshot["device_traces"][1]
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "segment_alloc", "alloc",
                                            "free_requested", "free_completed", "segment_free"]
    assert [e["size"] for e in trace[:4:2]] == [1024, 2048] and trace[1]["addr"] != trace[3]["addr"]
    assert trace[1]["frames"][0] == {"filename": __file__, "line": trace[1]["frames"][0]["line"],
                                     "name": "test_memory_history_records_allocations_with_their_python_stack"}
    assert not any("/course/" in f["filename"] for e in trace for f in e["frames"])
    assert [e["time_us"] for e in trace] == sorted(e["time_us"] for e in trace)
    block = [s for s in snapshot["segments"] if s["device"] == 1 and s["requested_size"] == 1024][0]["blocks"][0]
    assert block["frames"][0]["name"] == trace[1]["frames"][0]["name"]
    assert len(torch.cuda.memory._snapshot()["device_traces"][1]) == 7  # stopped: nothing more recorded
    torch.cuda.memory._dump_snapshot(str(tmp_path / "snapshot.pickle"))
    from torch.cuda import _memory_viz
    assert "segments: " in _memory_viz.segsum(snapshot) and _memory_viz.trace_plot(snapshot)
    del x


def test_raw_allocations_are_counted_until_deleted(emu):
    """caching_allocator_alloc / _delete (which raised "not modelled"): the bytes count on the device asked for,
    at the address memory_snapshot() shows, until deleted; a second delete is refused as CUDA refuses it."""
    before = torch.cuda.memory_allocated(1)
    ptr = torch.cuda.caching_allocator_alloc(3000, device=1)
    assert torch.cuda.memory_allocated(1) - before == 3072 and torch.cuda.memory_allocated(0) == 0
    assert ptr in [s["address"] for s in torch.cuda.memory_snapshot() if s["device"] == 1]
    torch.cuda.caching_allocator_delete(ptr)
    assert torch.cuda.memory_allocated(1) == before
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        torch.cuda.caching_allocator_delete(ptr)


def test_cuda_profiler_ranges_and_check_error_run_on_the_emulated_runtime(emu):
    """torch.cuda.profiler.profile() (Nsight Systems' capture range) raised "not modelled" at torch.cuda.cudart():
    with no profiler attached CUDA answers success; check_error raises CudaError with CUDA's string; other runtime
    calls are refused by name."""
    with torch.cuda.profiler.profile():
        torch.ones(4, device="cuda").sum()
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
    assert [e.name for e in emu.trace if e.kind == "nvtx"].count("cudaProfilerStart") == 2  # profile()'s and this
    with pytest.raises(torch.cuda.CudaError, match=r"out of memory \(2\)"):
        torch.cuda.check_error(2)
    with pytest.raises(RuntimeError, match=r"cudart\(\).cudaHostRegister is not modelled"):
        torch.cuda.cudart().cudaHostRegister(0, 0, 0)


def test_clearing_cublas_workspaces_frees_nothing(emu):
    """torch._C._cuda_clearCublasWorkspaces, which PyTorch's test harness calls before every CUDA memory-leak check
    (CudaMemoryLeakCheck), raised "not modelled": no cuBLAS workspace is modelled, so it frees nothing."""
    x = torch.randn(64, 64, device="cuda:1")
    x @ x
    before = torch.cuda.memory_allocated(1)
    torch._C._cuda_clearCublasWorkspaces()
    assert torch.cuda.memory_allocated(1) == before


def test_unmodelled_allocator_calls_name_themselves(emu):
    with pytest.raises(RuntimeError, match=r"torch.cuda.memory.host_memory_stats .*not modelled"):
        torch.cuda.host_memory_stats()
    with pytest.raises(RuntimeError, match=r"torch.cuda.MemPool \(a private memory pool\) is not modelled"):
        torch.cuda.MemPool()  # a CPU build's "Tried to instantiate dummy base class" named nothing
    with pytest.raises(RuntimeError, match=r"torch.cuda.ExternalStream \(a stream made outside PyTorch\) is not"):
        torch.cuda.get_stream_from_external(1234, device=1)
    with pytest.raises(RuntimeError, match=r"torch.cuda._set_rng_state_offset \(the Philox offset.* is not modelled"):
        torch.cuda._set_rng_state_offset(100)
    assert not hasattr(torch._C, "_cuda_getDeviceCount")  # hasattr probes still see a CPU build
    assert not torch.cuda._is_compiled()


# -- streams, events, devices ------------------------------------------------------------------------
def test_stream_context_switches_to_the_streams_device_and_back(emu):
    s = torch.cuda.Stream(device=2)
    with torch.cuda.stream(s):
        assert torch.cuda.current_device() == 2
        assert torch.cuda.current_stream() == s
        y = torch.ones(2, device="cuda")
    assert y.device == torch.device("cuda", 2)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.current_stream(2) == torch.cuda.default_stream(2)
    with torch.cuda.StreamContext(s):
        assert torch.cuda.current_device() == 2
    with s:
        assert torch.cuda.current_device() == 2
    assert torch.cuda.current_device() == 0
    with torch.cuda.stream(None):
        assert torch.cuda.current_device() == 0


def test_set_stream_device_of_and_events(emu):
    s = torch.cuda.Stream(device=1)
    torch.cuda.set_stream(s)
    assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() == s
    torch.cuda.set_device(0)
    x = torch.ones(2, device="cuda:3")
    with torch.cuda.device_of(x):
        assert torch.cuda.current_device() == 3
    with torch.cuda.device_of(torch.ones(2)):
        assert torch.cuda.current_device() == 0
    event = torch.cuda.Event()
    assert event.device is None  # created lazily, on first record, as on CUDA
    event.record(s)
    assert event.device == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="does not match recording stream's device"):
        event.record(torch.cuda.current_stream(0))
    assert torch.cuda.Stream.priority_range() == (0, -3)
    assert torch.cuda.Stream(priority=-10).priority == -3
    with pytest.raises(ValueError, match="Expected a cuda device, but got: cpu"):
        torch.cuda.synchronize("cpu")


def test_streams_and_events_by_handle_and_id(emu):
    """A stream named by its id (`torch.cuda.Stream(stream_id=...)`) or its handle (`ExternalStream`, the
    `__cuda_stream__` protocol) is that stream, so work put on it queues behind the original's; events get a handle
    on first record and are `torch.Event`s; an out-of-range index asks c10's stream check, timing checks are
    ValueErrors."""
    side = torch.Stream("cuda")
    same = torch.cuda.Stream(stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type)
    assert same == side and torch.cuda.ExternalStream(same.cuda_stream) == side
    assert same.__cuda_stream__() == (0, same.cuda_stream)
    a = torch.randn(256, 256, device="cuda")
    with torch.cuda.stream(side):
        a @ a
    assert not same.query()  # the matmul queued on side is the work `same` sees
    same.synchronize()
    assert side.query()
    event = torch.cuda.Event(enable_timing=True)
    assert isinstance(event, torch.Event) and event.cuda_event == event.event_id == 0
    event.record()
    assert event.cuda_event == event.event_id != 0
    with pytest.raises(ValueError, match="Both events must be recorded"):
        event.elapsed_time(torch.cuda.Event(enable_timing=True))
    with pytest.raises(ValueError, match="enable_timing=True"):
        event.elapsed_time(torch.cuda.Event())
    with pytest.raises(RuntimeError, match=r"Device index value 4 is out of index range \[0, 4\)"):
        torch.cuda.current_stream(4)
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
        torch.cuda.set_device(4)


# -- tensors -------------------------------------------------------------------------------------------
def test_new_and_legacy_constructors_land_on_the_gpu(emu):
    x = torch.ones(3, device="cuda:1", dtype=torch.float64)
    made = x.new([1.0, 2.0])
    assert made.device == torch.device("cuda", 1) and made.dtype == torch.float64
    torch.testing.assert_close(made.cpu(), torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert x.new(2, 3).shape == (2, 3) and x.new(2, 3).device == x.device
    assert x.new_tensor([1]).device == x.device and x.new_zeros(2).device == x.device
    assert torch.ones(2).new([1.0]).device.type == "cpu"
    assert x.new(2, device="cuda:0").device == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="^legacy constructor expects device type: cuda but device type: cpu was"):
        x.new(2, device="cpu")  # tensor_new.cpp's checks, which C++ made against the wrapper's CPU device
    with pytest.raises(RuntimeError, match=r"^Legacy tensor new of the form tensor.new\(tensor, device=device\)"):
        torch.ones(1).new(x, device="cuda")
    torch.cuda.set_device(2)
    torch.set_warn_always(True)  # PyTorch warns once a process
    try:
        with pytest.warns(UserWarning, match=r"^The torch.cuda.\*DtypeTensor constructors are no longer recommended"):
            floats = torch.cuda.FloatTensor(4)
    finally:
        torch.set_warn_always(False)
    assert floats.device == torch.device("cuda", 2) and floats.dtype == torch.float32 and floats.shape == (4,)
    longs = torch.cuda.LongTensor([1, 2])
    assert longs.dtype == torch.int64 and longs.cpu().tolist() == [1, 2]
    assert isinstance(longs, torch.cuda.LongTensor) and not isinstance(longs, torch.cuda.FloatTensor)
    assert not isinstance(torch.tensor([1, 2]), torch.cuda.LongTensor)


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type")
def test_a_cuda_default_tensor_type_makes_factories_make_gpu_tensors(emu):
    """`torch.set_default_tensor_type(torch.cuda.DoubleTensor)` (deprecated, still in PyTorch's tests) sets the dtype
    and puts new tensors on the current GPU; a CPU type, or its name, brings them back to the host."""
    saved = torch.tensor([]).type()
    torch.set_default_tensor_type(torch.cuda.DoubleTensor)
    try:
        made = torch.zeros(2)
        assert (made.device, made.dtype, made.type()) == (torch.device("cuda", 0), torch.float64,
                                                          "torch.cuda.DoubleTensor")
        # the legacy constructor too (old SSD code: `torch.Tensor(mean).view(-1, 4)`), and what wraps it
        legacy, listed = torch.Tensor(2, 3), nn.Parameter(torch.Tensor([1.0, 2.0]))
        assert (legacy.device, legacy.dtype, legacy.shape) == (torch.device("cuda", 0), torch.float64, (2, 3))
        assert (listed.device, listed.dtype, listed.cpu().tolist()) == (torch.device("cuda", 0), torch.float64,
                                                                       [1.0, 2.0])
        # a device named, as tensor_new.cpp's check_legacy_ctor_device wants it: of the default type's device type
        assert torch.Tensor(2, device="cuda:1").device == torch.device("cuda", 1)
        with pytest.raises(RuntimeError, match="^legacy constructor expects device type: cuda but device type: cpu"):
            torch.Tensor(2, device="cpu")
        with pytest.raises(TypeError, match="only floating-point types are supported as the default type"):
            torch.set_default_tensor_type(torch.cuda.IntTensor)
    finally:
        torch.set_default_tensor_type(saved)
    assert (torch.tensor(0.5).device, torch.get_default_dtype()) == (torch.device("cpu"), torch.float32)
    assert torch.Tensor(2).device == torch.device("cpu")


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type")
def test_a_cuda_default_tensor_type_reaches_normal_and_sparse_tensors():
    """`torch.normal(0.0, 1.0, size)` (GAN noise) takes a CUDA default tensor type's GPU in C++, where the mode of
    `torch.device`/`set_default_device` does not reach (PyTorch's list of constructors leaves it out, also on the
    host); `torch.sparse_coo_tensor` of GPU parts made under such a type runs."""
    torch.manual_seed(0)
    want = [torch.normal(0.0, 1.0, (2, 3)), torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (3,))]
    with torch.device("meta"):
        host_under_a_default_device = torch.normal(0.0, 1.0, (2,)).device
    with course.emulate(gpus=2):
        torch.set_default_tensor_type(torch.cuda.FloatTensor)
        try:
            torch.manual_seed(0)
            got = [torch.normal(0.0, 1.0, (2, 3)), torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (3,))]
        finally:
            torch.set_default_tensor_type(torch.FloatTensor)
        assert [t.device for t in got] == [torch.device("cuda", 0)] * 2
        got = [t.cpu() for t in got]
        with torch.device("cuda"):
            assert torch.normal(0.0, 1.0, (2,)).device == host_under_a_default_device == torch.device("cpu")
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs)


def _packed_gru(device):
    torch.manual_seed(0)
    gru = nn.GRU(3, 4).to(device)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(4, 3, 3).to(device), [2, 4, 3], enforce_sorted=False)
    out, hidden = gru(packed)
    return nn.utils.rnn.pad_packed_sequence(out)[0].cpu(), hidden.cpu()


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type")
def test_old_rnn_code_runs_under_a_cuda_default_tensor_type():
    """A 2018 seq2seq script after `set_default_tensor_type(torch.cuda.FloatTensor)`: packing with a list of lengths
    (made a host tensor, beside the GPU input) matches plain CPU torch, and `Tensor.__new__` keeps the signature
    `import torch._dynamo` checks (a mismatch broke that import, so torch.compile and `torch.eye` too)."""
    want = _packed_gru("cpu")
    with course.emulate(gpus=1):
        torch.set_default_tensor_type(torch.cuda.FloatTensor)
        try:
            got = _packed_gru("cuda")
            params = inspect.signature(torch.Tensor.__new__).parameters.values()
            assert {p.kind for p in params} == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
        finally:
            torch.set_default_tensor_type(torch.FloatTensor)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs)


# -- random numbers ------------------------------------------------------------------------------------
def test_rng_state_round_trips_and_equals_plain_cpu_torch(emu):
    torch.manual_seed(0)
    expected = torch.randn(5)                       # plain CPU torch, the same seed
    torch.manual_seed(0)
    state = torch.cuda.get_rng_state()
    first = torch.randn(5, device="cuda")
    torch.testing.assert_close(first.cpu(), expected)
    torch.cuda.set_rng_state(state)
    torch.testing.assert_close(torch.randn(5, device="cuda").cpu(), expected)
    states = torch.cuda.get_rng_state_all()
    assert len(states) == 4 and all(torch.equal(s, states[0]) for s in states)
    again = torch.randn(3, device="cuda:2")
    torch.cuda.set_rng_state_all(states)
    torch.testing.assert_close(torch.randn(3, device="cuda:2"), again)
    with pytest.raises(RuntimeError, match="not modelled by the GPU emulator"):
        torch.cuda.set_rng_state(torch.zeros(16, dtype=torch.uint8))  # a real GPU's Philox seed + offset
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):  # as on CUDA: states live on the host
        torch.set_rng_state(state.to("cuda:1"))
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
        torch.cuda.set_rng_state(state.cuda())


def test_fork_rng_restores_the_generator(emu):
    torch.manual_seed(3)
    expected = torch.randn(4)
    torch.manual_seed(3)
    with torch.random.fork_rng(devices=[0]):
        torch.randn(100, device="cuda:0")
        nn.functional.dropout(torch.ones(10, device="cuda:0"), 0.5)
    torch.testing.assert_close(torch.randn(4, device="cuda:0").cpu(), expected)


def test_a_gpu_that_fork_rng_leaves_out_goes_on_drawing(emu):
    """`fork_rng(devices=[0])` restores the CPU's and cuda:0's states only: cuda:1's draws inside it go on from
    its own stream on a GPU box, where the shared generator rolled them back and drew them again after the fork."""
    emu.stop()
    torch.manual_seed(5)
    want = [torch.rand(3), torch.rand(3)]
    emu.start()
    torch.manual_seed(5)
    with torch.random.fork_rng(devices=[0]):
        torch.manual_seed(9)  # the forked stream, restored at the end
        inside = torch.rand(3, device="cuda:1")
        torch.rand(3, device="cuda:0")
    after = torch.rand(3, device="cuda:1")
    assert torch.equal(inside.cpu(), want[0]) and torch.equal(after.cpu(), want[1])
    torch.manual_seed(5)
    with torch.random.fork_rng(devices=[0, 1]):
        torch.rand(3, device="cuda:1")
    assert torch.equal(torch.rand(3, device="cuda:1").cpu(), want[0])


def test_seeding_functions(emu):
    torch.cuda.manual_seed(7)
    assert torch.cuda.initial_seed() == 7
    a = torch.rand(3, device="cuda")
    torch.cuda.manual_seed_all(7)
    torch.testing.assert_close(torch.rand(3, device="cuda"), a)
    torch.cuda.seed()  # a fresh random seed, as torch.seed() draws it
    torch.cuda.seed_all()
    assert torch.cuda.initial_seed() == torch.initial_seed()  # one generator: the CPU's (course/cuda/rng.py)
    assert len(torch.cuda.default_generators) == 4


def test_cuda_generator(emu):
    g = torch.Generator(device="cuda")
    assert g.device == torch.device("cuda", 0) and isinstance(g, torch.Generator)
    assert torch.Generator("cuda:3").device == torch.device("cuda", 3)
    assert torch.Generator().device.type == "cpu" and isinstance(torch.Generator(), torch.Generator)
    g.manual_seed(11)
    drawn = torch.randn(4, device="cuda", generator=g)
    assert drawn.device == torch.device("cuda", 0)
    torch.testing.assert_close(drawn.cpu(), torch.randn(4, generator=torch.Generator().manual_seed(11)))
    state = g.get_state()
    first = torch.rand(2, device="cuda", generator=g)
    g.set_state(state)
    torch.testing.assert_close(torch.rand(2, device="cuda", generator=g), first)
    copied = pickle.loads(pickle.dumps(g))
    assert copied.device == g.device and torch.equal(copied.get_state(), g.get_state())


def test_a_generator_of_the_other_device_type_is_refused_as_aten_refuses_it(emu):
    """A CPU generator for a GPU draw, or a CUDA one for a CPU draw, stops a GPU box with `check_generator`'s words;
    here the CUDA generator is a CPU one underneath, and the CPU kernels took both silently. The default generators
    `torch.cuda.default_generators` holds (the CPU's, course/cuda/rng.py) stay usable on the GPU."""
    cpu_gen, cuda_gen = torch.Generator().manual_seed(0), torch.Generator(device="cuda").manual_seed(0)
    on_gpu = torch.ones(3, device="cuda")
    wants_cuda = "Expected a 'cuda' device type for generator but found 'cpu'"
    wants_cpu = "Expected a 'cpu' device type for generator but found 'cuda'"
    for draw in (lambda: torch.randn(2, device="cuda", generator=cpu_gen),
                 lambda: torch.randperm(4, device=1, generator=cpu_gen),
                 lambda: torch.multinomial(on_gpu, 1, generator=cpu_gen),
                 lambda: on_gpu.clone().normal_(generator=cpu_gen),
                 lambda: torch.nn.init.uniform_(torch.empty(2, device="cuda"), generator=cpu_gen)):
        with pytest.raises(RuntimeError, match=wants_cuda):
            draw()
    for draw in (lambda: torch.randn(2, generator=cuda_gen), lambda: torch.bernoulli(on_gpu.cpu() / 2, generator=cuda_gen)):
        with pytest.raises(RuntimeError, match=wants_cpu):
            draw()
    assert torch.multinomial(on_gpu, 2, generator=cuda_gen).device.type == "cuda"
    assert torch.randn(2, device="cuda", generator=torch.cuda.default_generators[0]).device.type == "cuda"
    assert torch.randn(2, generator=cpu_gen).device.type == "cpu"
    assert torch.randperm(0, device="cuda", generator=cpu_gen).device.type == "cuda"  # draws nothing: no check


def test_generator_and_seeds_are_restored_after_the_emulator():
    with course.emulate(gpus=2):
        pass
    assert torch.Generator is cuda_api.rng.RealGenerator
    assert torch.cuda.default_generators == ()
    assert not hasattr(torch._C, "__getattr__")


# -- what is not modelled ------------------------------------------------------------------------------
def _graphed_training(device: str) -> tuple[list[float], torch.Tensor]:
    """The CUDA-graphs docs' whole-network capture (warm-up on a side stream, capture forward, backward and an SGD
    step, refill the static inputs, replay); on the CPU the same steps run eagerly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 2)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    static_x, static_y = torch.randn(4, 6, device=device), torch.randn(4, 2, device=device)

    def step():
        loss = nn.functional.mse_loss(model(static_x), static_y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        step()
    if device != "cpu":
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            assert torch.cuda.is_current_stream_capturing()
            static_loss = step()
            with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
                static_loss.item()
    losses = []
    for i in range(3):
        data = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        static_x.copy_(data)
        if device == "cpu":
            opt.zero_grad(set_to_none=True)
            losses.append(step().item())
        else:
            graph.replay()
            losses.append(static_loss.item())
    return losses, torch.cat([model[0].weight.detach().flatten(), model[1].running_mean]).cpu()


def test_cuda_graph_capture_and_replay_train_as_eager_cpu_steps():
    """Capture records the kernels without running the ones that write memory (the optimizer's update and batch
    norm's running statistics happen once per replay, not at capture); host reads while capturing raise CUDA's
    error."""
    expected_losses, expected_weight = _graphed_training("cpu")
    with course.emulate(gpus=2):
        losses, weight = _graphed_training("cuda:1")
        assert not torch.cuda.is_current_stream_capturing()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    torch.testing.assert_close(weight, expected_weight)


def _partly_graphed_training(device: str) -> tuple[list[float], torch.Tensor]:
    """The docs' partial-network example: two modules made graphed callables, a third run eagerly."""
    torch.manual_seed(0)
    first, second, third = nn.Linear(6, 8).to(device), nn.Linear(8, 4).to(device), nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD([*first.parameters(), *second.parameters(), *third.parameters()], lr=0.1)
    if device != "cpu":
        first = torch.cuda.make_graphed_callables(first, (torch.randn(5, 6, device=device),))
        second = torch.cuda.make_graphed_callables(second, (torch.randn(5, 8, device=device, requires_grad=True),))
    losses = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        data, target = torch.randn(5, 6, generator=g).to(device), torch.randn(5, 2, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(third(torch.relu(second(first(data)))), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, third.weight.detach().cpu()


def test_make_graphed_callables_train_as_eager_cpu_modules():
    expected_losses, expected_weight = _partly_graphed_training("cpu")
    with course.emulate(gpus=1):
        losses, weight = _partly_graphed_training("cuda")
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    torch.testing.assert_close(weight, expected_weight)


def _captured_chain(emu, x, fork: bool):
    """Twenty small kernels captured with torch.cuda.graph after the docs' side-stream warm-up; with `fork`, a branch of
    five more on another stream, joined back as stream capture requires."""
    def step():
        a = x
        for _ in range(10):
            a = a * 1.5 + 1
        if not fork:
            return a
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = x
            for _ in range(5):
                b = b - 1
        torch.cuda.current_stream().wait_stream(side)
        return a + b

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    return graph, out, step


def test_graph_replay_costs_the_host_one_graph_launch_and_runs_the_kernels_as_captured(emu):
    """On a GPU replay() is one cudaGraphLaunch (aten/src/ATen/cuda/CUDAGraph.cpp) on the current stream, and the
    captured kernels run back to back with no launch of their own; eager, the host pays a launch per kernel."""
    from course.machine import costs
    x = torch.ones(256, 256, device="cuda")
    graph, out, step = _captured_chain(emu, x, fork=False)
    host, events = emu.clock.host_ns, len(emu.clock._events)
    eager = step()
    eager_host = emu.clock.host_ns - host
    eager_kernels = [e for e in emu.clock._events[events:] if e.kind == "kernel"]
    torch.cuda.synchronize()
    host, events = emu.clock.host_ns, len(emu.clock._events)
    x.fill_(2)
    after_fill, fill_events = emu.clock.host_ns, len(emu.clock._events)
    graph.replay()
    assert emu.clock.host_ns - after_fill == costs.HOST_GRAPH_LAUNCH_NS
    assert eager_host == len(eager_kernels) * costs.HOST_LAUNCH_NS  # what the graph saves
    replayed = [e for e in emu.clock._events[fill_events:] if e.kind == "kernel"]
    assert [e.duration_ns for e in replayed] == [e.duration_ns for e in eager_kernels]
    assert all(e.stream == torch.cuda.current_stream().stream_id for e in replayed)
    assert replayed[0].start_ns == max(after_fill + costs.HOST_GRAPH_LAUNCH_NS,
                                       emu.clock._events[events].end_ns)  # after the fill it reads
    assert all(b.start_ns == a.end_ns for a, b in zip(replayed, replayed[1:]))  # back to back
    out[0, 0].item()
    assert emu.clock.host_ns >= replayed[-1].end_ns  # the host read waited for the replayed kernels
    torch.testing.assert_close(out, step())
    assert not torch.equal(out, eager)  # the replay read the refilled input


def test_graph_capture_costs_the_host_its_launches_and_runs_nothing_on_the_device(emu):
    """Stream capture records each launch instead of running it (CUDA Programming Guide, "CUDA Graphs", stream
    capture): the host pays a launch per op, recorded in-place updates included, and no stream is busier after it;
    the values appear at replay."""
    from course.machine import costs
    x = torch.ones(256, 256, device="cuda")
    acc = torch.zeros(256, 256, device="cuda")

    def step():
        a = x * 1.5 + 1  # two kernels whose results are made at capture
        acc.add_(a)      # one that writes its argument, run only at replay
        return a

    step()
    acc.zero_()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="CUDA graphs must be captured on a non-default stream"):
        graph.capture_begin()  # CUDAGraph.cpp's check
    torch.cuda.synchronize()
    host, events, ready = emu.clock.host_ns, len(emu.clock._events), emu.clock.device_ready(0)
    with torch.cuda.stream(side):
        graph.capture_begin()
        out = step()
        graph.capture_end()
    assert emu.clock.host_ns - host == 3 * costs.HOST_LAUNCH_NS
    assert [e for e in emu.clock._events[events:] if e.device != "host"] == []
    assert emu.clock.device_ready(0) == ready and out.ready_ns <= emu.clock.host_ns
    assert torch.count_nonzero(acc.cpu()) == 0  # the in-place update waits for replay
    events = len(emu.clock._events)
    graph.replay()
    assert sum(e.kind == "kernel" for e in emu.clock._events[events:]) == 3
    torch.testing.assert_close(acc.cpu(), torch.full((256, 256), 2.5))
    torch.testing.assert_close(out.cpu(), torch.full((256, 256), 2.5))


def test_accelerator_graph_captures_on_the_current_stream_as_a_cuda_graph(emu):
    """`torch.accelerator.Graph` (torch 2.13's device-generic graph) is a CUDA graph on a CUDA box: `with stream,
    graph:` captures, each replay runs the work again; on the default stream it is refused, and
    `torch.accelerator.get_device_capability` is refused by CUDA's device guard."""
    x = torch.zeros(2000, device=0)
    graph = torch.accelerator.Graph()
    with torch.Stream(), graph:
        x += 1
    assert torch.count_nonzero(x.cpu()) == 0
    graph.replay()
    graph.replay()
    assert torch.equal(x.cpu(), torch.full((2000,), 2.0))
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        with torch.accelerator.Graph(pool=graph.pool()):
            x += 1
    with pytest.raises(RuntimeError, match="Backend doesn't support getting device capabilities"):
        torch.accelerator.get_device_capability()


def test_graph_replay_keeps_a_captured_branch_on_its_own_stream(emu):
    """A branch captured on a side stream overlaps the main chain at replay, and later work on the replay stream
    waits for the whole graph."""
    x = torch.ones(256, 256, device="cuda")
    graph, out, step = _captured_chain(emu, x, fork=True)
    events = len(emu.clock._events)
    graph.replay()
    replayed = [e for e in emu.clock._events[events:] if e.kind == "kernel"]
    main = torch.cuda.current_stream().stream_id
    branch = [e for e in replayed if e.stream != main]
    assert len(branch) == 5 and len(replayed) == 2 * 10 + 5 + 1
    assert branch[0].start_ns < replayed[9].end_ns  # runs beside the main chain
    assert torch.cuda.current_stream().query() is False
    torch.cuda.current_stream().synchronize()
    assert emu.clock.host_ns >= max(e.end_ns for e in replayed)
    torch.testing.assert_close(out, step())


def _graphed_collectives(rank, world_size, emu, steps):
    """One rank of a graphed step: a kernel, an all-reduce waited on, an all-gather and a functional all-reduce, each
    issued inside torch.cuda.graph capture, then the graph replayed on fresh inputs. Returns the values after each
    replay, and the collectives the capture put on the timeline."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    torch.cuda.set_device(rank)
    x = torch.zeros(1024, device="cuda")
    gathered = torch.empty(world_size * 1024, device="cuda")

    def step():
        y = x * 2
        dist.all_reduce(y)
        work = dist.all_gather_single(gathered, y + x, async_op=True)
        work.wait()
        return y, funcol.all_reduce(gathered * 1, "sum", dist.group.WORLD) + 1

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    dist.barrier(device_ids=[rank])  # this rank's eager step and barrier are on the timeline before its capture begins
    before = len(emu.clock._events)
    with torch.cuda.graph(graph):
        y, z = step()
    captured = [e for e in emu.clock._events[before:] if e.kind == "collective" and e.device == f"cuda:{rank}"]
    values = []
    for value in steps:
        x.fill_(value * (rank + 1))
        graph.replay()
        values.append((y.cpu(), gathered.cpu(), z.cpu()))
    return values, captured


def _graphed_collectives_on_the_cpu(world_size, steps):
    values = []
    for value in steps:
        xs = [torch.full((1024,), value * (rank + 1.0)) for rank in range(world_size)]
        y = sum(x * 2 for x in xs)
        gathered = torch.cat([y + x for x in xs])
        values.append((y, gathered, gathered * world_size + 1))
    return values


def test_nccl_collectives_captured_in_a_cuda_graph_run_at_each_replay():
    """NCCL collectives can be captured (since NCCL 2.9.6): capture moves no values and keeps the links idle, and each
    replay runs them on the inputs' values then, timed on the links as eager collectives are."""
    from course.lessons.ranks import run_threads
    steps = (1.0, 3.0)
    with course.emulate(gpus=2) as emu:
        results = run_threads(_graphed_collectives, 2, emu, steps, backend="nccl")
        collectives = [e for e in emu.trace if e.kind == "collective" and e.device == "cuda:0"]
    expected = _graphed_collectives_on_the_cpu(2, steps)
    for values, captured in results:
        assert captured == []
        for got, want in zip(values, expected):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
    names = [e.name for e in collectives if e.name != "nccl:barrier"]
    assert names == ["nccl:all_reduce", "nccl:all_gather", "nccl:all_reduce"] * (1 + len(steps))
    eager, *replays = [[e.duration_ns for e in collectives if e.name != "nccl:barrier"][i:i + 3]
                       for i in range(0, len(names), 3)]
    assert replays == [eager] * len(steps)


def _graphed_ddp_steps(rank, world_size, device):
    """Whole-network capture with DDP as PyTorch's CUDA semantics notes ask for it ("Usage with
    DistributedDataParallel": DDP built in a side-stream context, 11 eager warm-up iterations there), capturing forward,
    backward (DDP's bucket all-reduce) and an SGD step, then replays on fresh inputs. On the CPU every step is eager."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    static_x = torch.zeros(4, 8, device=device)
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + rank)) for i in range(14)]
    if device == "cpu":
        ddp = DDP(model)
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = ddp(static_x).pow(2).sum()
        loss.backward()
        opt.step()
        return loss

    losses = []
    if device == "cpu":
        for x in inputs:
            static_x.copy_(x)
            losses.append(step().item())
        return losses, model.weight.detach()
    with torch.cuda.stream(side):
        for x in inputs[:11]:
            static_x.copy_(x)
            losses.append(step().item())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    for x in inputs[11:]:
        static_x.copy_(x)
        graph.replay()
        losses.append(static_loss.item())
    return losses, model.weight.detach().cpu()


def test_ddp_captured_in_a_cuda_graph_trains_as_eager_cpu_ranks():
    """DDP's backward all-reduces its buckets from C++, through host scratch tensors that only PyTorch's own C++ may
    mix with GPU tensors: a replay runs those ops again as they were issued at capture (before, it raised a device
    mismatch), and the replayed steps give the eager losses and weights."""
    from course.lessons.ranks import run_threads
    expected = run_threads(_graphed_ddp_steps, 2, "cpu", backend="gloo")
    with course.emulate(gpus=2):
        results = run_threads(_graphed_ddp_steps, 2, "cuda", backend="nccl")
    for (losses, weight), (expected_losses, expected_weight) in zip(results, expected):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        torch.testing.assert_close(weight, expected_weight)


def _capture_a_collective(rank, world_size):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    x = torch.ones(8, device="cuda")
    dist.all_reduce(x)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            dist.all_reduce(x)
    except RuntimeError as error:
        return str(error)
    return "captured"


@pytest.mark.parametrize("backend, what", [("gloo", "a gloo collective"), ("threaded", "the threaded test group")])
def test_collectives_of_groups_that_cannot_be_captured_raise_cudas_capture_error(backend, what):
    """gloo moves GPU values through the host when called, and the threaded test group in Python: neither can run at a
    replay, so capturing one raises the error a GPU gives instead of computing at capture only."""
    from course.lessons.ranks import run_threads
    with course.emulate(gpus=2):
        errors = run_threads(_capture_a_collective, 2, backend=backend)
    assert all("operation not permitted when stream is capturing" in e and what in e for e in errors)


def test_adam_without_capturable_refuses_graph_capture(emu):
    """As on a GPU: its step count lives on the host, which a replay would not advance."""
    model = nn.Linear(3, 1).to("cuda")
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3, device="cuda")).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="capturable is False"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            model(torch.ones(2, 3, device="cuda")).sum().backward()
            opt.step()


def test_benchmark_timer_reads_the_simulated_clock_for_gpu_work(emu):
    """torch.utils.benchmark.Timer synchronizes the accelerator around what it times (its default timer): under the
    emulator it reports the emulated GPU's time, as CUDA events do, not this CPU's; work that leaves the simulated
    clock still (plain Python) keeps the real clock, and an explicit CPU timer is left alone."""
    import timeit
    from torch.utils.benchmark import Timer
    a = torch.randn(512, 512, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.current_stream().synchronize()  # as Timer does before it starts
    start.record()
    for _ in range(3):
        a @ a
    end.record()
    end.synchronize()
    measured = Timer("a @ a", globals={"a": a}).timeit(3)
    assert measured.mean == pytest.approx(start.elapsed_time(end) / 3 / 1e3, rel=1e-6)
    python = Timer("sum(range(50))").blocked_autorange(min_run_time=0.01)
    assert 0 < python.median < 1e-3
    before = emu.clock.host_ns
    cpu_timer = Timer("a @ a", globals={"a": a}, timer=timeit.default_timer).timeit(1)
    assert cpu_timer.mean > (emu.clock.host_ns - before) / 1e9  # this CPU's matmul, slower than the GPU's


def test_benchmark_timer_imported_after_the_emulator_started_reads_the_simulated_clock_too():
    """The emulator does not import torch.utils.benchmark itself (it pulls in setuptools, paid by every emulated
    process); it patches Timer when the program imports it, and puts the real one back when it stops."""
    import subprocess
    import sys
    program = """
import sys, torch, course
emu = course.emulate(gpus=1).start()
assert "torch.utils.benchmark.utils.timer" not in sys.modules, "the emulator imported torch.utils.benchmark"
from torch.utils.benchmark import Timer
a = torch.randn(512, 512, device="cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.current_stream().synchronize()
start.record()
for _ in range(3):
    a @ a
end.record()
end.synchronize()
same = abs(Timer("a @ a", globals={"a": a}).timeit(3).mean / (start.elapsed_time(end) / 3 / 1e3) - 1) < 1e-6
emu.stop()
print(same, Timer.__init__.__module__)
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "torch.utils.benchmark.utils.timer"]


def test_synchronize_next_to_a_wall_clock_is_noted_once(emu, monkeypatch):
    """The hand-written GPU timing (synchronize, time.perf_counter, synchronize) gets a one-time note; the time module
    is not patched."""
    import time
    from course.cuda import wall_clock
    monkeypatch.setattr(wall_clock, "_noted", False)
    a = torch.randn(64, 64, device="cuda")

    def events_only():  # the time module, but no clock read
        time.sleep(0)
        a @ a
        torch.cuda.synchronize()

    def wall_clock_timing():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        events_only()
    with pytest.warns(UserWarning, match="wall clocks measure this CPU") as caught:
        wall_clock_timing()
    assert caught[0].filename == __file__  # points at the program's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wall_clock_timing()


def test_torch_compile_runs_eagerly_with_the_same_numbers(emu, monkeypatch):
    monkeypatch.setattr(cuda_api, "_compile_warned", False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    gpu_model = model.to("cuda:1")
    with pytest.warns(UserWarning, match="torch.compile is not modelled by the GPU emulator"):
        compiled = torch.compile(gpu_model, mode="max-autotune")
    out = compiled(x.to("cuda:1"))
    torch.testing.assert_close(out.cpu(), expected)
    out.sum().backward()
    assert gpu_model[0].weight.grad.device == torch.device("cuda", 1)
    assert compiled._orig_mod is gpu_model
    assert list(compiled.state_dict())[0] == "_orig_mod.0.weight"  # as a compiled module saves on CUDA
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only

        @torch.compile(fullgraph=True)
        def double(t):
            return t * 2

        assert double(torch.ones(2, device="cuda")).cpu().tolist() == [2.0, 2.0]


def test_a_training_step_with_a_checkpointed_rng_state_matches_cpu(emu):
    """Save model and CUDA RNG state mid-run, continue, reload, continue again: the same losses."""
    def losses(device, restore):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.Linear(6, 1)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        saved, out = None, []
        for step in range(4):
            if step == 2:
                buffer = io.BytesIO()
                rng = torch.cuda.get_rng_state() if device != "cpu" else torch.get_rng_state()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng}, buffer)
                saved = buffer.getvalue()
            x = torch.randn(5, 6, device=device)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        if restore:
            checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["opt"])
            (torch.cuda.set_rng_state if device != "cpu" else torch.set_rng_state)(checkpoint["rng"].cpu())
            for _ in range(2):
                loss = model(torch.randn(5, 6, device=device)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.item())
        return out

    emulated = losses("cuda:1", restore=True)
    assert emulated[2:4] == emulated[4:6]
    assert emulated == pytest.approx(losses("cpu", restore=True), rel=1e-6)


def test_event_repr_and_host_copies_land_pinned():
    """As torch.cuda.Event's repr, and `_to_copy`'s pin_out: a non-blocking copy to the host is pinned memory."""
    with course.emulate(gpus=1):
        event = torch.cuda.Event()
        assert repr(event) == "<torch.cuda.Event uninitialized>"
        event.record()
        assert repr(event).startswith("<torch.cuda.Event 0x")
        x = torch.randn(8, device="cuda")
        assert x.to("cpu", non_blocking=True).is_pinned()
        assert not x.to("cpu").is_pinned()
        torch.testing.assert_close(x.to("cpu", non_blocking=True), x.cpu())


# -- deterministic mode --------------------------------------------------------------------------------------------
@pytest.fixture
def deterministic(monkeypatch):
    """Deterministic mode on for one test, and the cuBLAS workspace setting read afresh (PyTorch reads it once)."""
    from course.cuda import determinism
    monkeypatch.setattr(determinism, "_cublas_config_deterministic", None)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_mode_raises_what_cuda_kernels_raise(emu, deterministic):
    """The ops torch.use_deterministic_algorithms documents as raising on CUDA raise PyTorch's own error (the caller
    name each CUDA kernel passes to alertNotDeterministic), where CPU torch runs them; the ones it makes deterministic
    on CUDA run, as on the CPU."""
    x = torch.randn(4, 4, device="cuda")
    index = torch.tensor([0, 1, 1], device="cuda")
    cases = {
        "cumsum_cuda_kernel": lambda: x.cumsum(0),
        "_bincount_cuda": lambda: torch.bincount(index, weights=torch.ones(3, device="cuda")),
        "_histc_cuda": lambda: torch.histc(x),
        "median CUDA with indices output": lambda: x.median(1),
        "put_": lambda: torch.zeros(4, device="cuda").put_(index, torch.ones(3, device="cuda"), accumulate=True),
        "adaptive_avg_pool2d_backward_cuda": lambda: nn.functional.adaptive_avg_pool2d(
            x.view(1, 1, 4, 4).requires_grad_(), 2).sum().backward(),
        "fractional_max_pool3d_backward_cuda": lambda: nn.functional.fractional_max_pool3d(
            torch.randn(1, 1, 3, 3, 3, device="cuda", requires_grad=True), 2, output_size=1).sum().backward(),
        "embedding_bag_backward_cuda_max": lambda: nn.functional.embedding_bag(
            index, x.clone().requires_grad_(), torch.tensor([0], device="cuda"), mode="max").sum().backward(),
    }
    for caller, call in cases.items():
        with pytest.raises(RuntimeError, match=f"^{caller} does not have a deterministic implementation, but you set "
                                               r"'torch.use_deterministic_algorithms\(True\)'"):
            call()
    host, host_index = x.cpu(), index.cpu()  # CPU torch has deterministic kernels for them
    torch.cumsum(host, 0), torch.histc(host), host.median(1), torch.bincount(host_index, weights=torch.ones(3))
    torch.zeros(4).put_(host_index, torch.ones(3), accumulate=True)
    nn.functional.embedding_bag(host_index, host.requires_grad_(), torch.tensor([0]), mode="max").sum().backward()
    nn.functional.embedding_bag(index, x.clone().requires_grad_(), torch.tensor([0], device="cuda"),
                                mode="sum").sum().backward()  # only max mode's CUDA backward is nondeterministic
    runs = [x.median(), torch.bincount(index), torch.arange(4, device="cuda").cumsum(0),
            torch.zeros(3, device="cuda").index_add_(0, index, torch.ones(3, device="cuda")),
            torch.zeros(4, device="cuda").scatter_add_(0, index, torch.ones(3, device="cuda"))]
    assert [t.device.type for t in runs] == ["cuda"] * len(runs)


def test_deterministic_mode_wants_the_cublas_workspace_setting(emu, deterministic, monkeypatch):
    from course.cuda import determinism
    a = torch.randn(3, 3, device="cuda")
    with pytest.raises(RuntimeError, match="it uses CuBLAS and you have CUDA >= 10.2.*CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        nn.Linear(3, 3).cuda()(a)
    expected = a.cpu() @ a.cpu()
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="uses CuBLAS"):
        torch.testing.assert_close((a @ a).cpu(), expected)
    with pytest.warns(UserWarning, match=r"cumsum_cuda_kernel does not have a deterministic implementation, but you "
                                         r"set 'torch.use_deterministic_algorithms\(True, warn_only=True\)'"):
        a.cumsum(0)
    torch.use_deterministic_algorithms(True)
    monkeypatch.setattr(determinism, "_cublas_config_deterministic", None)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.testing.assert_close((a @ a).cpu(), expected)
    torch.testing.assert_close(torch.bmm(a[None], a[None]).cpu(), expected[None])


def test_deterministic_mode_takes_pytorchs_python_paths_on_emulated_gpus(emu, deterministic, monkeypatch):
    """On CUDA tensors in deterministic mode F.interpolate (linear modes), F.pad(mode="replicate") and F.max_pool3d run
    a torch._decomp decomposition that makes index tensors on the input's device: the same numbers as on the CPU.
    F.pad(mode="reflect") in 2-D runs CUDA's deterministic backward kernel."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")

    def run(device):
        torch.manual_seed(0)
        x = torch.randn(1, 2, 4, 4, device=device, requires_grad=True)
        y = nn.functional.interpolate(x, scale_factor=2, mode="bilinear")
        y = y + nn.functional.pad(x, (2, 2, 2, 2), mode="replicate")
        y = y + nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
        (y.sum() + nn.functional.max_pool3d(x[None], 2).sum()).backward()
        return y.detach().cpu(), x.grad.cpu()

    for got, want in zip(run("cuda"), run("cpu")):
        torch.testing.assert_close(got, want)


# -- what the build says about itself ------------------------------------------------------------------------------
def _branch_on_the_build() -> str:
    """How public scripts pick a code path from the build (apex-, xformers-, detectron2-style checks)."""
    if not torch.version.cuda or torch.version.cuda < "11.0":
        return "cpu build"
    major, minor = torch.cuda.get_device_capability()
    if torch.backends.cudnn.version() is None or torch.backends.cudnn.version() < 8000:
        return "no cudnn 8"
    if f"sm_{major}{minor}" not in torch.cuda.get_arch_list():
        return "no kernels for this gpu"
    return "gpu"


def test_the_build_reports_cuda_cudnn_and_arch_while_emulating_and_none_after():
    cpu_build = (torch.version.cuda, torch.backends.cudnn.version(), torch.backends.cudnn.is_available(),
                 torch.cuda.get_arch_list(), torch.cuda.get_gencode_flags(),
                 torch.backends.cuda.is_flash_attention_available())
    assert cpu_build == (None, None, False, [], "", False)
    with course.emulate(gpus=2, gpu="H100"):
        assert torch.version.cuda == "12.6"
        assert torch.backends.cuda.is_flash_attention_available() is True  # USE_FLASH_ATTENTION, on in Linux CUDA builds
        assert torch.backends.cudnn.version() == 91002 and torch.backends.cudnn.is_available()
        assert torch.cuda.get_arch_list() == ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
        assert "-gencode compute=compute_90,code=sm_90" in torch.cuda.get_gencode_flags()
        assert _branch_on_the_build() == "gpu"
        assert torch.backends.cudnn.is_acceptable(torch.ones(2, device="cuda"))
        assert not torch.backends.cudnn.is_acceptable(torch.ones(2))
        assert not torch.backends.cudnn.is_acceptable(torch.ones(2, dtype=torch.long, device="cuda"))
        with torch.backends.cudnn.flags(enabled=False):  # as torch.export enters it: no CUDA-only binding read
            assert not torch.backends.cudnn.is_acceptable(torch.ones(2, device="cuda"))
    assert (torch.version.cuda, torch.backends.cudnn.version(), torch.backends.cudnn.is_available(),
            torch.cuda.get_arch_list(), torch.cuda.get_gencode_flags(),
            torch.backends.cuda.is_flash_attention_available()) == cpu_build
    assert _branch_on_the_build() == "cpu build"


def test_is_built_answers_true_to_the_program_and_the_cpu_builds_false_to_torchs_own_modules():
    """Scripts pick their device with `torch.cuda.is_available() and torch.backends.cuda.is_built()` (or the deprecated
    `torch.has_cuda`): while emulating, the GPU, as on a CUDA build. PyTorch's own callers go on to CUDA-only C++
    bindings, so they keep the CPU build's answer: the test harness's BLAS reset runs without calling them (in a
    child process: importing the harness freezes torch.backends' flags for the rest of the process)."""
    def pick():
        return "cuda" if torch.cuda.is_available() and torch.backends.cuda.is_built() else "cpu"

    deprecated = r"'has_cuda' is deprecated, please use 'torch.backends.cuda.is_built\(\)'"
    assert pick() == "cpu"
    with course.emulate(gpus=1):
        assert torch.backends.cuda.is_built() is True and pick() == "cuda"
        with pytest.warns(UserWarning, match=deprecated):
            assert torch.has_cuda is True
    assert torch.backends.cuda.is_built() is False and pick() == "cpu"
    with pytest.warns(UserWarning, match=deprecated):
        assert torch.has_cuda is False
    harness = ("import torch, course\n"
               "from torch.testing._internal.common_utils import setBlasBackendsToDefaultFinally\n"
               "with course.emulate(gpus=1):\n"
               "    ran = []\n"
               "    setBlasBackendsToDefaultFinally(lambda: ran.append(torch.backends.cuda.is_built()))()\n"
               "print(ran)\n")
    child = subprocess.run([sys.executable, "-c", harness], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "[True]", child.stdout + child.stderr


@pytest.mark.parametrize("gpu", sorted(course.GPUS))
def test_the_reported_build_has_kernels_for_every_gpu_preset(gpu):
    """PyTorch's own start-up checks (torch.cuda._check_capability and _check_cubins, which _lazy_init runs on a
    GPU box) warn when the build has no code for a GPU; they stay silent for every preset."""
    with course.emulate(gpus=1, gpu=gpu), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.cuda._check_capability()
        torch.cuda._check_cubins()


def test_an_lstm_moved_to_a_gpu_does_not_warn_about_a_build_without_cudnn(emu):
    """nn.LSTM asks cudnn.is_acceptable for its weights when moved; a CPU build's answer warned "PyTorch was
    compiled without cuDNN"."""
    torch.manual_seed(0)
    cpu = nn.LSTM(4, 3)
    x = torch.randn(5, 2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpu = nn.LSTM(4, 3).cuda()
        gpu.load_state_dict(cpu.state_dict())
        out, _ = gpu(x.cuda())
    torch.testing.assert_close(out.cpu(), cpu(x)[0])


def test_can_device_access_peer_answers_as_peer_copies_are_costed():
    """It raised "not modelled"; now it says what the copies are priced by: every pair without a machine preset, the
    NVLink-joined pairs of a DGX-1V (not those that stage through the host), none of 4xRTX4090, never a GPU itself."""
    with course.emulate(gpus=2):
        assert torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer("cuda:1", 0)
        assert not torch.cuda.can_device_access_peer(1, 1)
        with pytest.raises(AssertionError, match="Invalid peer device id"):
            torch.cuda.can_device_access_peer(0, 2)
    from course.machine import hardware, topology
    dgx = hardware.machine("DGX-1V")
    with course.emulate(machine="DGX-1V", materialize=False):
        answers = {(a, b): torch.cuda.can_device_access_peer(a, b) for a in range(8) for b in range(8) if a != b}
    assert answers == {(a, b): dgx.bricks_between(a, b) > 0 for a, b in answers}
    assert set(answers.values()) == {True, False}
    with course.emulate(machine="4xRTX4090", materialize=False):
        assert not any(torch.cuda.can_device_access_peer(a, b) for a in range(4) for b in range(4))
    assert topology.reads_host_memory(hardware.machine("4xRTX4090"), 0, 1)


def test_library_choices_and_the_cufft_plan_cache_answer_as_a_cuda_build():
    """`preferred_linalg_library("cusolver")`, `preferred_blas_library("cublaslt")` and `cufft_plan_cache.max_size`,
    which a CPU build refuses, are kept as a CUDA build keeps them (with its warning), values unchanged; the number of
    cached plans is refused by name; the CPU build's refusals come back after."""
    matrix = torch.tensor([[4.0, 1.0], [1.0, 3.0]])
    with course.emulate(gpus=2):
        with pytest.warns(UserWarning, match="preferred_linalg_library is an experimental feature"):
            assert torch.backends.cuda.preferred_linalg_library("cusolver") == torch._C._LinalgBackend.Cusolver
        assert torch.backends.cuda.preferred_linalg_library() == torch._C._LinalgBackend.Cusolver
        torch.testing.assert_close(torch.linalg.eigvalsh(matrix.cuda()).cpu(), torch.linalg.eigvalsh(matrix))
        assert torch.backends.cuda.preferred_linalg_library("default") == torch._C._LinalgBackend.Default
        with pytest.warns(UserWarning, match="preferred_blas_library is an experimental feature"):
            assert torch.backends.cuda.preferred_blas_library("cublaslt") == torch._C._BlasBackend.Cublaslt
        assert torch.backends.cuda.preferred_blas_library("default") == torch._C._BlasBackend.Cublas
        cache = torch.backends.cuda.cufft_plan_cache
        assert cache.max_size == 4096
        cache.max_size = 32
        cache[1].max_size = 7
        assert (cache.max_size, cache[0].max_size, cache[1].max_size) == (32, 32, 7)
        with pytest.raises(RuntimeError, match="cuFFT plan cache size can not be larger than 4096, but got 5000"):
            cache.max_size = 5000
        cache.clear()
        with pytest.raises(RuntimeError, match="cufft_plan_cache.size .* is not modelled"):
            cache.size
    with pytest.raises(RuntimeError, match="has not been compiled with cuBLASLt"):
        torch.backends.cuda.preferred_blas_library("cublaslt")
    with pytest.raises(RuntimeError, match="without ATen_cuda library"):
        torch.backends.cuda.cuFFTPlanCache(0).max_size
    torch.backends.cuda.preferred_linalg_library("default")


def test_polling_a_query_sees_the_gpu_finish(emu):
    """`while not event.query()` ends as on a GPU: each query costs the host a runtime call, so the simulated host
    reaches the kernel's end; elapsed_time, which queries inside PyTorch, charges nothing."""
    a = torch.randn(512, 512)
    x = a.to("cuda:1")
    y = x @ x
    start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(1))
    z = y @ y
    done.record(torch.cuda.current_stream(1))
    polls = 0
    while not done.query():
        polls += 1
    assert 0 < polls < 10_000 and emu.clock.host_ns >= done.time_ns
    assert torch.cuda.current_stream(1).query()
    host = emu.clock.host_ns
    assert start.elapsed_time(done) > 0 and emu.clock.host_ns == host
    torch.testing.assert_close(z.cpu(), (a @ a) @ (a @ a))


def test_bf16_is_emulated_before_ampere_as_torch_answers():
    """torch 2.13's `is_bf16_supported()` says True on a V100 (a bfloat16 tensor can be made there), so bf16 autocast
    runs; only `including_emulation=False` and `is_tf32_supported()` ask for sm80."""
    for gpu, native in (("V100", False), ("A100-80GB", True)):
        with course.emulate(gpus=1, gpu=gpu):
            assert torch.cuda.is_bf16_supported()
            assert torch.cuda.is_bf16_supported(including_emulation=False) == native == torch.cuda.is_tf32_supported()
            a = torch.randn(4, 4)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = a.cuda() @ a.cuda()
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.cpu(), (a.bfloat16() @ a.bfloat16()))
