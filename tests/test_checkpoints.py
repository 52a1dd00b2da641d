"""torch.save / torch.load of tensors on emulated GPUs behave as on a CUDA box (course/cuda/checkpoints.py)."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.multiprocessing  # noqa: F401  (registers its reducers on ForkingPickler)
from multiprocessing.reduction import ForkingPickler

import course


@pytest.fixture
def emu():
    with course.emulate(gpus=4) as emulator:
        yield emulator


def _saved(obj, **kwargs) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)
    buffer.seek(0)
    return buffer


def _checkpoint():
    """Tensors on cuda:1 and cuda:3, a view sharing cuda:1's storage, and a CPU tensor; plus the CPU values."""
    values = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.linspace(0, 1, 5, dtype=torch.float64),
              "cpu": torch.tensor([7, 8, 9])}
    a = values["a"].to("cuda:1")
    on_gpus = {"a": a, "row": a[1], "b": values["b"].to("cuda:3"), "cpu": values["cpu"]}
    values["row"] = values["a"][1]
    return on_gpus, values


@pytest.mark.parametrize("map_location, devices", [
    (None, {"a": "cuda:1", "row": "cuda:1", "b": "cuda:3", "cpu": "cpu"}),
    ("cpu", dict.fromkeys("a row b cpu".split(), "cpu")),
    (torch.device("cpu"), dict.fromkeys("a row b cpu".split(), "cpu")),
    ("cuda:0", dict.fromkeys("a row b cpu".split(), "cuda:0")),
    ("cuda", dict.fromkeys("a row b cpu".split(), "cuda:0")),  # the current device
    (torch.device("cuda", 2), dict.fromkeys("a row b cpu".split(), "cuda:2")),
    ({"cuda:1": "cuda:2"}, {"a": "cuda:2", "row": "cuda:2", "b": "cuda:3", "cpu": "cpu"}),
    ({"cuda:1": "cpu", "cuda:3": "cuda:0"}, {"a": "cpu", "row": "cpu", "b": "cuda:0", "cpu": "cpu"}),
    (lambda storage, loc: storage, dict.fromkeys("a row b cpu".split(), "cpu")),
    (lambda storage, loc: storage.cuda(3), dict.fromkeys("a row b cpu".split(), "cuda:3")),
    (lambda storage, loc: storage.to(device="cuda:2"), dict.fromkeys("a row b cpu".split(), "cuda:2")),
    (lambda storage, loc: None, {"a": "cuda:1", "row": "cuda:1", "b": "cuda:3", "cpu": "cpu"}),  # torch's default
], ids=["none", "cpu", "device-cpu", "cuda:0", "cuda", "device-cuda:2", "dict", "dict-cpu", "callable-identity",
        "callable-cuda", "callable-to", "callable-none"])
@pytest.mark.parametrize("weights_only", [True, False])
def test_map_location_puts_tensors_where_cuda_would(emu, map_location, devices, weights_only):
    on_gpus, values = _checkpoint()
    loaded = torch.load(_saved(on_gpus), map_location=map_location, weights_only=weights_only)
    assert {name: str(t.device) for name, t in loaded.items()} == devices
    for name, tensor in loaded.items():
        assert tensor.dtype == values[name].dtype
        assert torch.equal(tensor.cpu(), values[name])
    # The view still shares its base's storage, as torch.load keeps it: writing one shows in the other.
    loaded["a"][1, 0] = 100.0
    assert loaded["row"][0].item() == 100.0


def test_a_bare_device_index_is_refused_as_torch_refuses_it(emu):
    """torch.load takes a str, torch.device, dict or callable: an int is called, and fails, as on CUDA."""
    with pytest.raises(TypeError, match="'int' object is not callable"):
        torch.load(_saved({"a": torch.ones(2, device="cuda:1")}), map_location=1)
    # torch.device(1) is cuda:1 on a GPU box, and here.
    loaded = torch.load(_saved({"a": torch.ones(2, device="cuda:1")}), map_location=torch.device(2))
    assert loaded["a"].device == torch.device("cuda", 2)


def test_an_index_this_machine_lacks_fails_as_on_cuda():
    with course.emulate(gpus=4):
        buffer = _saved({"w": torch.ones(3, device="cuda:3")})
    with course.emulate(gpus=2):
        with pytest.raises(RuntimeError, match=r"^Attempting to deserialize object on CUDA device 3 but "
                                               r"torch.cuda.device_count\(\) is 2\. Please use torch.load with "
                                               r"map_location to map your storages to an existing device\.$"):
            torch.load(buffer)
        buffer.seek(0)
        with pytest.raises(RuntimeError, match="on CUDA device 5 but torch.cuda.device_count"):
            torch.load(buffer, map_location="cuda:5")
        buffer.seek(0)
        with pytest.raises(RuntimeError, match="on CUDA device 2 but torch.cuda.device_count"):
            torch.load(buffer, map_location={"cuda:3": "cuda:2"})
        buffer.seek(0)
        with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
            torch.load(buffer, map_location=lambda storage, loc: storage.cuda(7))
        buffer.seek(0)
        loaded = torch.load(buffer, map_location={"cuda:3": "cuda:1"})
        assert loaded["w"].device == torch.device("cuda", 1)


def test_outside_the_emulator_the_file_is_a_cuda_checkpoint():
    """A CPU-only machine: map_location="cpu" loads plain tensors; without it, PyTorch's CPU-only error."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with course.emulate(gpus=4):
        model.to("cuda:2")
        buffer = _saved({"model": model.state_dict(), "epoch": 3})
    loaded = torch.load(buffer, map_location="cpu")  # weights_only=True: only torch's own rebuild functions
    assert loaded["epoch"] == 3
    for name, value in expected.items():
        assert type(loaded["model"][name]) is torch.Tensor
        assert torch.equal(loaded["model"][name], value)
    buffer.seek(0)
    with pytest.raises(RuntimeError, match=r"^Attempting to deserialize object on a CUDA device but "
                                           r"torch.cuda.is_available\(\) is False\. If you are running on a "
                                           r"CPU-only machine, please use torch.load with "
                                           r"map_location=torch.device\('cpu'\)"):
        torch.load(buffer)
    assert b"course" not in buffer.getvalue()  # nothing in the file needs the course package


def test_a_cpu_checkpoint_loads_onto_an_emulated_gpu(emu):
    buffer = _saved({"w": torch.arange(3.0)})
    loaded = torch.load(buffer, map_location="cuda:3")
    assert loaded["w"].device == torch.device("cuda", 3)
    assert torch.equal(loaded["w"].cpu(), torch.arange(3.0))


def test_loading_counts_memory_on_the_target_gpu_and_charges_the_copy(emu):
    weight = torch.ones(1024, 256, device="cuda:1")  # 1 MiB
    buffer = _saved({"w": weight, "first_row": weight[0]})
    before = torch.cuda.memory_allocated(2)
    copies_before = len([e for e in emu.trace if e.kind == "copy" and e.name == "copy cpu->cuda:2"])
    host_before = emu.clock.host_ns
    loaded = torch.load(buffer, map_location="cuda:2")
    assert torch.cuda.memory_allocated(2) - before == 1024 * 256 * 4  # the view shares the storage: once
    copies = [e for e in emu.trace if e.kind == "copy" and e.name == "copy cpu->cuda:2"][copies_before:]
    assert [c.bytes for c in copies] == [1024 * 256 * 4]
    assert emu.clock.host_ns - host_before >= copies[0].duration_ns  # a pageable copy: the host waits
    assert loaded["first_row"]._block is loaded["w"]._block
    del loaded
    assert torch.cuda.memory_allocated(2) == before


def test_saving_charges_one_copy_to_the_host_per_storage(emu):
    weight = torch.ones(512, 512, device="cuda:3")
    before = len([e for e in emu.trace if e.name == "copy cuda:3->cpu"])
    _saved({"w": weight, "rows": weight[:10], "again": weight})
    copies = [e for e in emu.trace if e.name == "copy cuda:3->cpu"][before:]
    assert [c.bytes for c in copies] == [512 * 512 * 4]


def test_out_of_memory_on_load_reads_like_cuda():
    with course.emulate(gpus=2):
        buffer = _saved({"w": torch.ones(2**18, device="cuda:0")})  # 1 MiB
    with course.emulate(gpus=2, materialize=False):  # shapes only: the GPU fills up without using host memory
        free = torch.cuda.get_device_properties(1).total_memory - torch.cuda.memory_allocated(1)
        filler = torch.empty(free - 2**19, dtype=torch.uint8, device="cuda:1")
        with pytest.raises(torch.cuda.OutOfMemoryError, match="CUDA out of memory. Tried to allocate 1.00 MiB"):
            torch.load(buffer, map_location="cuda:1")
        del filler


def _train(model, optimizer, x, y, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _setup(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    x, y = torch.randn(32, 8).to(device), torch.randn(32, 2).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), x, y


@pytest.mark.parametrize("map_location", [None, "cuda:2", {"cuda:0": "cuda:2"},
                                          lambda storage, loc: storage.cuda(2)],
                         ids=["none", "cuda:2", "dict", "callable"])
def test_model_and_adam_state_round_trip_and_training_resumes(map_location):
    model, optimizer, x, y = _setup("cpu")
    _train(model, optimizer, x, y, 3)
    reference_checkpoint = copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})
    _train(model, optimizer, x, y, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    with course.emulate(gpus=4):
        gpu_model, gpu_optimizer, gx, gy = _setup("cuda:0")
        _train(gpu_model, gpu_optimizer, gx, gy, 3)
        buffer = _saved({"model": gpu_model.state_dict(), "optim": gpu_optimizer.state_dict(), "epoch": 3,
                         "nested": [{"losses": (torch.tensor(0.5, device="cuda:0"),)}]})
        loaded = torch.load(buffer, map_location=map_location)
        target = "cuda:0" if map_location is None else "cuda:2"
        state = loaded["optim"]["state"]
        assert state[0]["exp_avg"].device == torch.device(target)
        assert state[0]["exp_avg_sq"].device == torch.device(target)
        # Adam keeps `step` on the CPU; torch.load moves it only when map_location says so.
        step_device = "cpu" if map_location is None or isinstance(map_location, dict) else target
        assert state[0]["step"].device == torch.device(step_device)
        assert loaded["nested"][0]["losses"][0].device == torch.device(target)
        for name, value in reference_checkpoint["model"].items():
            torch.testing.assert_close(loaded["model"][name].cpu(), value)
        for index, slots in reference_checkpoint["optim"]["state"].items():
            for slot, value in slots.items():
                torch.testing.assert_close(state[index][slot].cpu(), value)

        fresh, fresh_optimizer, _, _ = _setup("cuda:2")
        fresh.load_state_dict(loaded["model"])
        fresh_optimizer.load_state_dict(loaded["optim"])
        _train(fresh, fresh_optimizer, gx.to("cuda:2"), gy.to("cuda:2"), 2)
        assert all(p.device == torch.device("cuda", 2) for p in fresh.parameters())
        got = {k: v.cpu() for k, v in fresh.state_dict().items()}
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value)


def test_parameters_modules_and_legacy_format_round_trip(emu):
    model = nn.Linear(3, 2).to("cuda:1")
    loaded = torch.load(_saved(model.weight), map_location="cuda:3")
    assert isinstance(loaded, nn.Parameter) and loaded.requires_grad
    assert loaded.device == torch.device("cuda", 3)
    assert torch.equal(loaded.cpu(), model.weight.cpu())
    whole = torch.load(_saved(model), weights_only=False)  # torch.save(model): pickles the module itself
    assert whole.weight.device == torch.device("cuda", 1) and isinstance(whole.weight, nn.Parameter)
    assert torch.equal(whole(torch.ones(1, 3, device="cuda:1")).cpu(), model(torch.ones(1, 3, device="cuda:1")).cpu())
    legacy = torch.load(_saved(model.state_dict(), _use_new_zipfile_serialization=False), map_location="cuda:2")
    assert legacy["bias"].device == torch.device("cuda", 2)
    assert torch.equal(legacy["bias"].cpu(), model.bias.cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.uint16,
                                   torch.float8_e4m3fn])
def test_dtypes_round_trip(emu, dtype):
    values = torch.arange(6).to(dtype)
    loaded = torch.load(_saved({"t": values.to("cuda:1")}))
    assert loaded["t"].device == torch.device("cuda", 1) and loaded["t"].dtype == dtype
    assert torch.equal(loaded["t"].cpu().view(torch.uint8), values.view(torch.uint8))


def test_shape_only_mode_refuses_to_save_and_loads_shapes():
    with course.emulate(gpus=2):
        buffer = _saved({"w": torch.ones(4, 4, device="cuda:1")})
    with course.emulate(gpus=2, materialize=False):
        with pytest.raises(RuntimeError, match=r"torch.save needs values, but this tensor is shape-only.*"
                                               r"materialize=True"):
            torch.save({"w": torch.ones(2, device="cuda:0")}, io.BytesIO())
        loaded = torch.load(buffer)
        assert loaded["w"].device == torch.device("cuda", 1) and loaded["w"].shape == (4, 4)
        assert loaded["w"]._inner.is_meta and torch.cuda.memory_allocated(1) >= 4 * 4 * 4


def test_other_pickling_keeps_devices(emu):
    """deepcopy, plain pickle (object collectives) and torch.multiprocessing's pickler are not torch.save."""
    tensor = torch.arange(4.0, device="cuda:2")
    for twin in (copy.deepcopy(tensor), pickle.loads(pickle.dumps(tensor)),
                 pickle.loads(ForkingPickler.dumps(tensor))):
        assert twin.device == torch.device("cuda", 2)
        assert torch.equal(twin.cpu(), torch.arange(4.0))
    state = copy.deepcopy(nn.Linear(2, 2).to("cuda:3").state_dict())
    assert state["weight"].device == torch.device("cuda", 3)


def test_the_emulator_leaves_torch_serialization_as_it_found_it():
    import torch._utils
    import torch.serialization

    before = (list(torch.serialization._package_registry), torch.serialization._save,
              torch._utils._restore_device_fake_mode, torch.UntypedStorage.to, torch.UntypedStorage.cpu)
    with course.emulate(gpus=2):
        pass
    after = (list(torch.serialization._package_registry), torch.serialization._save,
             torch._utils._restore_device_fake_mode, torch.UntypedStorage.to, torch.UntypedStorage.cpu)
    assert after == before


def test_mmap_loads_copy_to_the_gpu_so_the_file_can_be_overwritten(emu, tmp_path):
    """The snapshot pattern: load with mmap=True, then save a new snapshot to the same path."""
    path = tmp_path / "snapshot.pt"
    torch.save({"w": torch.arange(1000.0, device="cuda:1")}, path)
    loaded = torch.load(path, mmap=True)
    assert loaded["w"].device == torch.device("cuda", 1)
    torch.save({"w": torch.zeros(1, device="cuda:1")}, path)
    assert torch.equal(loaded["w"].cpu(), torch.arange(1000.0))


def test_loading_into_a_trained_ddp_model_copies_into_its_parameters(emu, tmp_path):
    """Resuming after DDP has wrapped (and trained) the model, as tutorial scripts do: load_state_dict copies into
    the parameters DDP's reducer and autograd hold, as on a GPU, and training goes on from the loaded weights."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to("cuda:0"), device_ids=[0])
        model(torch.randn(3, 4, device="cuda:0")).sum().backward()
        params = list(model.module.parameters())
        saved = {k: torch.full_like(v, 0.5) for k, v in model.module.state_dict().items()}
        model.module.load_state_dict(saved)
        assert all(p is q for p, q in zip(params, model.module.parameters()))
        assert all(p.device == torch.device("cuda", 0) and bool((p == 0.5).all()) for p in params)
        model.module.zero_grad()
        model(torch.ones(1, 4, device="cuda:0")).sum().backward()
        torch.testing.assert_close(model.module.weight.grad.cpu(), torch.ones(2, 4))
    finally:
        dist.destroy_process_group()


def test_a_programs_own_storage_cuda_is_on_the_gpu(emu):
    """`storage.cuda(i)` / `.to(device=...)` outside torch.load: the copy says it is on that GPU (it said 'cpu'), is
    counted there, and comes back to the host byte for byte."""
    host = torch.UntypedStorage(16)
    host[3] = 42
    before = torch.cuda.memory_allocated(1)
    moved = host.cuda(1)
    assert moved.device == torch.device("cuda", 1)
    assert torch.cuda.memory_allocated(1) - before >= 16
    assert moved.cpu().device.type == "cpu" and moved.cpu().tolist() == host.tolist()
    on_gpu = torch.arange(4.0, device="cuda:0").untyped_storage()
    assert on_gpu.to(device="cuda:1").device == torch.device("cuda", 1)
    assert torch.arange(3.0).untyped_storage().cuda().device == torch.device("cuda", 0)
    buffer = io.BytesIO()
    torch.save(torch.arange(5.0, device="cuda:1"), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location=lambda storage, location: storage.cuda(0))
    assert loaded.device == torch.device("cuda", 0) and loaded.sum().item() == 10.0
