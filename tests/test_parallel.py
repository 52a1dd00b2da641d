"""nn.parallel primitives, nn.DataParallel, torch.cuda.comm and torch.cuda.nccl on emulated GPUs."""
import copy

import pytest
import torch
import torch.nn as nn

import course
from course.machine import costs


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))


def _reference(model, x):
    """Output and gradients of the whole batch on one device (plain CPU PyTorch)."""
    model = copy.deepcopy(model)
    out = model(x)
    (out ** 2).sum().backward()
    return out.detach(), [p.grad for p in model.parameters()]


def seed_001_data_parallel(module, input, device_ids, output_device=None):
    """Seed 001's data_parallel(), built from the four primitives, verbatim."""
    if not device_ids:
        return module(input)

    if output_device is None:
        output_device = device_ids[0]

    replicas = nn.parallel.replicate(module, device_ids)
    inputs = nn.parallel.scatter(input, device_ids)
    replicas = replicas[:len(inputs)]
    outputs = nn.parallel.parallel_apply(replicas, inputs)
    return nn.parallel.gather(outputs, output_device)


def test_scatter_chunks_like_pytorch():
    with course.emulate(gpus=4):
        x = torch.arange(30.0, device="cuda:0").reshape(30, 1)
        chunks = nn.parallel.scatter(x, [0, 1, 2, 3])
        assert [c.shape[0] for c in chunks] == [8, 8, 8, 6]
        assert [c.device.index for c in chunks] == [0, 1, 2, 3]
        for chunk, expected in zip(chunks, torch.arange(30.0).reshape(30, 1).chunk(4)):
            torch.testing.assert_close(chunk.cpu(), expected)


@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_data_parallel_equals_the_single_device_run(gpus):
    model, x = _mlp(), torch.randn(30, 10)
    expected_out, expected_grads = _reference(model, x)
    with course.emulate(gpus=gpus):
        dp = nn.DataParallel(copy.deepcopy(model)).to("cuda:0")
        out = dp(x.to("cuda:0"))
        assert out.device == torch.device("cuda", 0)
        (out ** 2).sum().backward()
        torch.testing.assert_close(out.detach().cpu(), expected_out)
        for param, expected in zip(dp.module.parameters(), expected_grads):
            assert param.grad.device == torch.device("cuda", 0)
            torch.testing.assert_close(param.grad.cpu(), expected)


def test_seed_001_data_parallel_from_primitives():
    model, x = _mlp(), torch.randn(30, 10)
    expected_out, expected_grads = _reference(model, x)
    with course.emulate(gpus=4):
        on_gpu = copy.deepcopy(model).to("cuda:0")
        out = seed_001_data_parallel(on_gpu, x.to("cuda:0"), [0, 1, 2, 3])
        (out ** 2).sum().backward()
        torch.testing.assert_close(out.detach().cpu(), expected_out)
        for param, expected in zip(on_gpu.parameters(), expected_grads):
            torch.testing.assert_close(param.grad.cpu(), expected)


def test_data_parallel_timeline_scatter_replicas_side_by_side_gather():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    with course.emulate(gpus=4) as emu:
        dp = nn.DataParallel(model).to("cuda:0")
        dp(torch.randn(512, 1024, device="cuda:0")).sum().item()
    trace = emu.trace
    scatters = [e for e in trace if e.kind == "copy" and e.device == "cuda:0" and e.peer != "cpu"]
    assert {e.peer for e in scatters} >= {"cuda:1", "cuda:2", "cuda:3"}
    matmuls = {d: [e for e in trace if e.kind == "kernel" and e.device == d and e.name == "aten::addmm"]
               for d in ("cuda:0", "cuda:1", "cuda:2", "cuda:3")}
    assert all(len(kernels) == 2 for kernels in matmuls.values())
    first, second = matmuls["cuda:1"][0], matmuls["cuda:2"][0]
    assert second.start_ns < first.end_ns  # replicas run side by side
    gathers = [e for e in trace if e.kind == "copy" and e.peer == "cuda:0"]
    assert len(gathers) == 3
    assert min(g.start_ns for g in gathers) >= min(m[-1].end_ns for m in matmuls.values())
    broadcasts = [e for e in trace if e.name == "nccl:broadcast"]
    assert {e.device for e in broadcasts} == {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}


def test_data_parallel_trace_is_deterministic():
    traces = []
    for _ in range(2):
        model, x = _mlp(), torch.randn(30, 10)
        with course.emulate(gpus=4) as emu:
            dp = nn.DataParallel(model).to("cuda:0")
            (dp(x.to("cuda:0")) ** 2).sum().backward()
            torch.cuda.synchronize()
        traces.append(emu.trace)
    assert traces[0] == traces[1]


class MakesTensorsInForward(nn.Module):
    """A replica that creates a tensor on its own device inside forward (runs in a worker thread)."""

    def forward(self, x):
        return x + torch.ones(x.shape, device=x.device)


def test_parallel_apply_workers_run_inside_the_emulator():
    with course.emulate(gpus=3):
        dp = nn.DataParallel(MakesTensorsInForward())
        out = dp(torch.zeros(6, 2, device="cuda:0"))
        torch.testing.assert_close(out.cpu(), torch.ones(6, 2))


class DropsOut(nn.Module):
    """A replica whose forward draws (dropout and torch.rand on its device) in its worker thread."""

    def forward(self, x):
        return nn.functional.dropout(x, 0.5) + torch.rand(x.shape, device=x.device)


def test_data_parallel_replicas_draw_reproducibly_each_from_a_copy_of_the_seeded_state():
    """Seeded dropout under DataParallel gives the same numbers every run (the replica threads drew from one shared
    generator in racy turn): each replica draws what one device seeded alike draws, and the caller's generator then
    stands where replica 0's ended."""
    runs = []
    for _ in range(3):
        with course.emulate(gpus=4):
            torch.manual_seed(0)
            out = nn.DataParallel(DropsOut())(torch.ones(8, 5, device="cuda:0")).cpu()
            runs.append((out, torch.rand(3)))
    torch.manual_seed(0)
    one_replica = DropsOut()(torch.ones(2, 5))
    after_replica = torch.rand(3)
    for out, after in runs:
        torch.testing.assert_close(out, runs[0][0], rtol=0, atol=0)
        for chunk in out.chunk(4):
            torch.testing.assert_close(chunk, one_replica, rtol=0, atol=0)
        torch.testing.assert_close(after, after_replica, rtol=0, atol=0)


def test_data_parallel_over_missing_devices_is_refused():
    with course.emulate(gpus=2):
        with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
            nn.DataParallel(_mlp(), device_ids=[0, 1, 2])


def test_comm_broadcast_gather_reduce_add():
    with course.emulate(gpus=3) as emu:
        x = torch.randn(4, 5, device="cuda:0")
        copies = torch.cuda.comm.broadcast(x, [0, 1, 2])
        assert [c.device.index for c in copies] == [0, 1, 2]
        for c in copies:
            torch.testing.assert_close(c.cpu(), x.cpu())
        coalesced = torch.cuda.comm.broadcast_coalesced([x, x * 2], [0, 1, 2])
        torch.testing.assert_close(coalesced[2][1].cpu(), (x * 2).cpu())
        parts = [torch.full((2, 3), float(i), device=f"cuda:{i}") for i in range(3)]
        gathered = torch.cuda.comm.gather(parts, dim=0, destination=1)
        assert gathered.device.index == 1 and gathered.shape == (6, 3)
        torch.testing.assert_close(gathered.cpu(), torch.cat([p.cpu() for p in parts]))
        total = torch.cuda.comm.reduce_add(parts, destination=2)
        assert total.device.index == 2
        torch.testing.assert_close(total.cpu(), torch.full((2, 3), 3.0))
        assert any(e.name == "nccl:reduce" for e in emu.trace)


def test_nccl_collectives_equal_the_math_and_follow_the_ring_model():
    n = 4
    with course.emulate(gpus=n, link="nvlink3") as emu:
        values = [torch.randn(1024, 256) for _ in range(n)]
        tensors = [v.to(f"cuda:{i}") for i, v in enumerate(values)]
        torch.cuda.synchronize()
        torch.cuda.nccl.all_reduce(tensors)
        for t in tensors:
            torch.testing.assert_close(t.cpu(), sum(values))
        event = [e for e in emu.trace if e.name == "nccl:all_reduce"][0]
        assert event.duration_ns == costs.ring_allreduce_ns(emu.link, 1024 * 256 * 4, n, launches=n)

        tensors = [v.to(f"cuda:{i}") for i, v in enumerate(values)]
        torch.cuda.nccl.broadcast(tensors, root=2)
        for t in tensors:
            torch.testing.assert_close(t.cpu(), values[2])

        tensors = [v.to(f"cuda:{i}") for i, v in enumerate(values)]
        torch.cuda.nccl.reduce(tensors, root=1)
        torch.testing.assert_close(tensors[1].cpu(), sum(values))

        inputs = [v.to(f"cuda:{i}") for i, v in enumerate(values)]
        outputs = [torch.empty(n * 1024, 256, device=f"cuda:{i}") for i in range(n)]
        torch.cuda.nccl.all_gather(inputs, outputs)
        torch.testing.assert_close(outputs[3].cpu(), torch.cat(values))

        outputs = [torch.empty(256, 256, device=f"cuda:{i}") for i in range(n)]
        torch.cuda.nccl.reduce_scatter(inputs, outputs)
        for i, out in enumerate(outputs):
            torch.testing.assert_close(out.cpu(), sum(values).chunk(n)[i])


def test_all_reduce_bus_bandwidth_approaches_the_link():
    n, nbytes = 8, 2**30
    with course.emulate(gpus=n, gpu="H100", link="nvlink4", materialize=False) as emu:
        tensors = [torch.empty(nbytes // 4, device=f"cuda:{i}") for i in range(n)]
        torch.cuda.synchronize()
        torch.cuda.nccl.all_reduce(tensors)
        seconds = [e for e in emu.trace if e.name == "nccl:all_reduce"][0].duration_ns / 1e9
    bus_bandwidth = nbytes / seconds * 2 * (n - 1) / n / 1e9
    link = emu.link
    reachable = link.nvls_busbw_gbps or link.bandwidth_gbps * link.efficiency  # NVLink SHARP where it exists
    assert 0.9 * reachable < bus_bandwidth <= reachable


def test_collectives_refuse_bad_input():
    with course.emulate(gpus=2):
        a, b = torch.ones(3, device="cuda:0"), torch.ones(4, device="cuda:1")
        with pytest.raises(RuntimeError, match=r"tensor 1 is \(4,\) torch.float32 but tensor 0 is \(3,\)"):
            torch.cuda.nccl.all_reduce([a, b])
        with pytest.raises(RuntimeError, match="two tensors are on cuda:0"):
            torch.cuda.nccl.all_reduce([a, torch.ones(3, device="cuda:0")])
        with pytest.raises(RuntimeError, match="tensor 1 is on the CPU"):
            torch.cuda.nccl.all_reduce([a, torch.ones(3)])
        with pytest.raises(TypeError, match="takes a list of tensors"):
            torch.cuda.nccl.all_reduce(a)


class Seed001DistributedModel(nn.Module):
    """Seed 001's model with part on the CPU and part on the GPU, its constructor made runnable."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(1000, 10)
        self.rnn = nn.Linear(10, 10).cuda(0)

    def forward(self, x):
        # Compute embedding on CPU
        x = self.embedding(x)

        # Transfer to GPU
        x = x.cuda(0)

        # Compute RNN on GPU
        x = self.rnn(x)
        return x


def test_seed_001_model_split_between_cpu_and_gpu():
    with course.emulate(gpus=1) as emu:
        torch.manual_seed(0)
        model = Seed001DistributedModel()
        tokens = torch.randint(0, 1000, (4, 7))
        out = model(tokens)
        assert out.device == torch.device("cuda", 0)
        out.sum().backward()
        assert model.embedding.weight.grad.device.type == "cpu"
        assert model.rnn.weight.grad.device == torch.device("cuda", 0)
        expected = model.rnn.weight.cpu() @ model.embedding(tokens).unsqueeze(-1)
        torch.testing.assert_close(out.detach().cpu(), expected.squeeze(-1) + model.rnn.bias.detach().cpu())
        assert any(e.name == "copy cpu->cuda:0" for e in emu.trace)


def test_seed_002_data_parallel_idiom():
    def make_model():
        return _mlp()

    with course.emulate(gpus=4):
        device = torch.device("cuda:0")
        model = make_model()
        if torch.cuda.device_count() > 1:
            model = nn.DataParallel(model)
        model.to(device)
        assert isinstance(model, nn.DataParallel)
        assert model(torch.randn(16, 10, device=device)).shape == (16, 5)


def _conv_block(channels_in, channels_out):
    return [nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.BatchNorm2d(channels_out), nn.ReLU(),
            nn.MaxPool2d(2)]


class Seed002ModelParallel(nn.Module):
    """Seed 002's ModelParallelExample with channel counts filled in and its `.to('cuda:1')` moved to
    where it belongs: before seq2, whose layers live on cuda:1."""

    def __init__(self):
        super().__init__()
        self.seq1 = nn.Sequential(*_conv_block(3, 16), *_conv_block(16, 32)).to("cuda:0")
        self.seq2 = nn.Sequential(*_conv_block(32, 128), *_conv_block(128, 256)).to("cuda:1")

    def forward(self, x):
        return self.seq2(self.seq1(x.to("cuda:0")).to("cuda:1"))


def test_seed_002_model_parallel_runs_and_the_original_line_fails_like_on_gpus():
    with course.emulate(gpus=2):
        model = Seed002ModelParallel().eval()
        x = torch.randn(2, 3, 32, 32)
        assert model(x).device == torch.device("cuda", 1)
        # cuDNN's convolution wrapper names the argument on the other GPU (c10::impl::common_device_check_failure)
        with pytest.raises(RuntimeError, match="but got weight is on cuda:1, different from other tensors on cuda:0"):
            model.seq2(model.seq1(x.to("cuda:0"))).to("cuda:1")  # the seed's line, as written


def test_seed_002_tiles_one_per_gpu_run_and_give_the_whole_image_shape():
    with course.emulate(gpus=4):
        torch.manual_seed(0)
        block = nn.Sequential(*_conv_block(3, 16), *_conv_block(16, 32)).eval()
        layers = [copy.deepcopy(block).to(f"cuda:{i}") for i in range(4)]
        x = torch.randn(1, 3, 64, 64)
        b, d, h, w = x.shape
        parts = [x[:, :, 0:h // 2, 0:w // 2], x[:, :, h // 2:h, 0:w // 2],
                 x[:, :, 0:h // 2, w // 2:w], x[:, :, h // 2:h, w // 2:w]]
        y = [f(part.to(f"cuda:{i}")).to("cuda:0") for i, (f, part) in enumerate(zip(layers, parts))]
        tiled = torch.cat([torch.cat([y[0], y[2]], dim=3), torch.cat([y[1], y[3]], dim=3)], dim=2)
        whole = block(x)
        assert tiled.shape == whole.shape
        interior = (slice(None), slice(None), slice(2, 6), slice(2, 6))  # far from the seams
        torch.testing.assert_close(tiled.cpu()[interior], whole[interior])


def test_data_parallel_from_primitives_with_fewer_rows_than_gpus():
    """Seed 001's data_parallel replicates to every GPU but uses only as many replicas as chunks:
    the unused replicas' zero gradients (made by autograd on the CPU) must not break backward."""
    model, x = nn.Linear(6, 4), torch.randn(3, 6)
    expected_out, expected_grads = _reference(model, x)
    with course.emulate(gpus=4):
        on_gpu = copy.deepcopy(model).to("cuda:0")
        out = seed_001_data_parallel(on_gpu, x.to("cuda:0"), [0, 1, 2, 3])
        (out ** 2).sum().backward()
        for param, expected in zip(on_gpu.parameters(), expected_grads):
            torch.testing.assert_close(param.grad.cpu(), expected)


def test_meta_tensors_stay_meta_inside_the_emulator():
    with course.emulate(gpus=2):
        with torch.device("meta"):
            layer = nn.Linear(1024, 1024)
        assert layer.weight.is_meta
        layer.to_empty(device="cuda:1")
        assert layer.weight.device == torch.device("cuda", 1)


def test_data_parallel_with_a_parameter_no_replica_uses():
    """A parameter the replicas never touch (a CRF's transitions read from `model.module` outside the parallel
    forward): its replicas' gradients are zeros, their sum is zeros, and its own use still counts, as on GPUs."""
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.transitions = nn.Linear(4, 3), nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    model, x = Tagger(), torch.randn(6, 4)
    reference = copy.deepcopy(model)
    (reference(x) @ reference.transitions).sum().backward()
    with course.emulate(gpus=2):
        parallel = nn.DataParallel(model.cuda())
        (parallel(x) @ model.transitions).sum().backward()
        grads = [p.grad.cpu() for p in model.parameters()]
        devices = {p.grad.device for p in model.parameters()}
    assert devices == {torch.device("cuda", 0)}
    for got, want in zip(grads, [p.grad for p in reference.parameters()]):
        torch.testing.assert_close(got, want)
