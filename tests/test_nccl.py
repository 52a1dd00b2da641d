"""`init_process_group("nccl")` and DistributedDataParallel on emulated GPUs, checked against plain CPU torch."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import course
from course.lessons.ranks import RankFailed


def _model():
    torch.manual_seed(1)  # each rank thread seeds its own generator (course/cuda/rank_rng.py)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(world_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(4 * world_size, 6, generator=g), torch.randn(4 * world_size, 3, generator=g)


def _reference(world_size, steps=3):
    """One CPU process training on the global batch: what DDP over world_size ranks must match."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(world_size)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_rank(rank, world_size, steps=3):
    torch.cuda.set_device(rank)
    model = _model().to(f"cuda:{rank}")
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = (t.chunk(world_size)[rank].to(f"cuda:{rank}") for t in _data(world_size))
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return dist.get_backend(), [p.detach().cpu() for p in model.parameters()]


def test_ddp_one_rank_gives_plain_gradients(monkeypatch):
    """The issue's case: gloo, one rank, a layer on cuda:0: the gradient must be CPU torch's, not zeros."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(course.lessons.ranks.free_port()))
    cpu_model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with course.emulate(gpus=2):
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            model = copy.deepcopy(cpu_model).to("cuda:0")
            ddp = DDP(model, device_ids=[0])
            for _ in range(2):  # the second backward uses the rebuilt buckets
                model.zero_grad()
                ddp(x.to("cuda:0")).square().sum().backward()
            grads = [p.grad.cpu() for p in model.parameters()]
        finally:
            dist.destroy_process_group()
    cpu_model(x).square().sum().backward()
    for got, want in zip(grads, [p.grad for p in cpu_model.parameters()]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_ddp_of_host_parameters_or_buffers_needs_a_cpu_backend(monkeypatch, backend):
    """A model left on the host, or a buffer assigned a host tensor after `.cuda()`, and a group made with "nccl"
    alone: DDP's broadcast of the module's states finds no backend for the CPU, as on a GPU box; the emulator ran
    it. With a CPU backend named, the model trains, with CPU torch's gradients."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(course.lessons.ranks.free_port()))
    torch.manual_seed(0)
    host, x = nn.Linear(4, 2), torch.randn(3, 4)
    norm = nn.BatchNorm1d(2)
    with course.emulate(gpus=2):
        dist.init_process_group(backend, rank=0, world_size=1)
        try:
            on_gpu = norm.cuda()
            on_gpu.running_mean = torch.zeros(2)
            for model in (copy.deepcopy(host), on_gpu):
                if backend == "nccl":
                    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
                        DDP(model)
                else:
                    DDP(model)
            ddp = DDP(copy.deepcopy(host).cuda(), device_ids=[0])
            ddp(x.cuda()).square().sum().backward()
            grads = [p.grad.cpu() for p in ddp.module.parameters()]
        finally:
            dist.destroy_process_group()
    host(x).square().sum().backward()
    torch.testing.assert_close(grads, [p.grad for p in host.parameters()])


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_over_emulated_nccl_matches_one_process(world_size):
    with course.emulate(gpus=world_size) as emu:
        results = course.run_threads(_ddp_rank, world_size, backend="nccl")
    want = _reference(world_size)
    for backend, params in results:
        assert backend == "nccl"
        for got, expected in zip(params, want):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    reduces = [e for e in emu.trace if e.name == "nccl:all_reduce"]
    assert {e.device for e in reduces} == {f"cuda:{r}" for r in range(world_size)}
    assert all(e.end_ns > e.start_ns for e in reduces)


class _TwoGPUs(nn.Module):
    """_model() with its first layer on one GPU and its last on another, moving the activations between them."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second
        self.layers = _model()
        self.layers[0].to(first)
        self.layers[2].to(second)

    def forward(self, x):
        hidden = self.layers[1](self.layers[0](x.to(self.first)))
        return self.layers[2](hidden.to(self.second))


def _ddp_model_parallel_rank(rank, world_size, steps=3):
    """The DDP tutorial's DDP with model parallelism: each rank's model spans two GPUs, device_ids unset."""
    model = _TwoGPUs(f"cuda:{2 * rank}", f"cuda:{2 * rank + 1}")
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = (t.chunk(world_size)[rank] for t in _data(world_size))
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(ddp(x), y.to(model.second)).backward()
        opt.step()
    return [str(p.device) for p in model.parameters()], [p.detach().cpu() for p in model.parameters()]


def test_ddp_of_a_model_on_two_gpus_per_rank_matches_one_process():
    with course.emulate(gpus=4):
        results = course.run_threads(_ddp_model_parallel_rank, 2, backend="nccl")
    for rank, (devices, params) in enumerate(results):
        assert devices == [f"cuda:{2 * rank}"] * 2 + [f"cuda:{2 * rank + 1}"] * 2
        for got, want in zip(params, _reference(2), strict=True):
            torch.testing.assert_close(got, want)


_JOIN_BATCHES = [[slice(0, 3)], [slice(3, 6), slice(6, 8)]]  # rank 0 runs out of data one step before rank 1


def _ddp_join_rank(rank, world_size):
    """DDP under Join with uneven inputs, each step's gradient divided by the ranks still training."""
    from torch.distributed.algorithms.join import Join
    torch.cuda.set_device(rank)
    model = _model().to(f"cuda:{rank}")
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp], divide_by_initial_world_size=False):
        for rows in _JOIN_BATCHES[rank]:
            x, y = (t[rows].to(f"cuda:{rank}") for t in _data(world_size))
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def test_ddp_under_join_divides_by_the_ranks_still_training():
    """The reducer waits, in backward, on the work of Join's forward all-reduce: it must not hang, and the second
    step (rank 1 alone) must take rank 1's gradient undivided."""
    with course.emulate(gpus=2):
        results = course.run_threads(_ddp_join_rank, 2, backend="nccl", timeout_s=20)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(2)
    for step in ([_JOIN_BATCHES[0][0], _JOIN_BATCHES[1][0]], [_JOIN_BATCHES[1][1]]):
        opt.zero_grad()
        sum(F.mse_loss(model(x[rows]), y[rows]) for rows in step).div(len(step)).backward()
        opt.step()
    for params in results:
        for got, want in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach())


def test_ddp_timeline_is_identical_run_to_run():
    def trace():
        with course.emulate(gpus=2) as emu:
            course.run_threads(_ddp_rank, 2, backend="nccl")
        return [(e.kind, e.name, e.device, e.stream, e.start_ns, e.end_ns) for e in emu.trace]
    assert trace() == trace()


def _collectives(rank, world_size):
    torch.cuda.set_device(rank)
    base = torch.arange(4.0, device="cuda") + 10 * rank
    out = {}
    t = base.clone(); dist.all_reduce(t); out["sum"] = t.cpu()
    t = base.clone(); dist.broadcast(t, src=1); out["broadcast"] = t.cpu()
    big = torch.empty(4 * world_size, device="cuda"); dist.all_gather_into_tensor(big, base); out["gather"] = big.cpu()
    part = torch.empty(2, device="cuda"); dist.reduce_scatter_tensor(part, base[:2 * world_size] if world_size == 2 else base.repeat(world_size)[:2 * world_size]); out["rs"] = part.cpu()
    received = torch.zeros(4, device="cuda")
    if rank == 0:
        dist.send(base * 2, dst=1)
    else:
        request = dist.irecv(received, src=0)
        request.wait()
    out["p2p"] = received.cpu()
    out["device"] = str(t.device)
    return out


def test_collectives_and_point_to_point_values():
    with course.emulate(gpus=2) as emu:
        got = course.run_threads(_collectives, 2, backend="nccl")
    bases = [torch.arange(4.0) + 10 * r for r in range(2)]
    for rank, out in enumerate(got):
        torch.testing.assert_close(out["sum"], bases[0] + bases[1])
        torch.testing.assert_close(out["broadcast"], bases[1])
        torch.testing.assert_close(out["gather"], torch.cat(bases))
        torch.testing.assert_close(out["rs"], (bases[0] + bases[1])[2 * rank:2 * rank + 2])
        assert out["device"] == f"cuda:{rank}"
    torch.testing.assert_close(got[1]["p2p"], bases[0] * 2)
    names = {e.name for e in emu.trace if e.kind == "collective"}
    assert {"nccl:all_reduce", "nccl:broadcast", "nccl:all_gather", "nccl:reduce_scatter",
            "nccl:send to 1", "nccl:recv from 0"} <= names


def _under_a_cuda_default_type(rank, world_size):
    """A launch-era script that set `torch.cuda.FloatTensor` as the default type (rank 0 only: the default device is
    the process's, which rank threads share): barrier, AVG and point to point."""
    torch.cuda.set_device(rank)
    if rank == 0:
        torch.set_default_tensor_type(torch.cuda.FloatTensor)
    try:
        dist.barrier()
        averaged = torch.arange(3.0, device="cuda") + 10 * rank
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
        received = torch.zeros(3, device="cuda")
        if rank == 0:
            dist.send(averaged * 2, dst=1)
        else:
            dist.recv(received, src=0)
        return str(averaged.device), averaged.cpu(), received.cpu()
    finally:
        if rank == 0:
            torch.set_default_tensor_type(torch.FloatTensor)


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type")
def test_collectives_under_a_cuda_default_tensor_type():
    """The emulated NCCL's own host tensors (barrier flags, clock messages, AVG's factor) stay on the host when the
    default type is a CUDA one: the barrier's flag was made an emulated GPU tensor that gloo read as host memory."""
    with course.emulate(gpus=2):
        got = course.run_threads(_under_a_cuda_default_type, 2, backend="nccl")
    mean = (torch.arange(3.0) + torch.arange(3.0) + 10) / 2
    for rank, (device, averaged, received) in enumerate(got):
        assert device == f"cuda:{rank}"
        torch.testing.assert_close(averaged, mean)
    torch.testing.assert_close(got[1][2], mean * 2)


def _uneven(rank, world_size):
    torch.cuda.set_device(rank)
    gathered = [torch.empty(r + 1, device="cuda") for r in range(world_size)]
    dist.all_gather(gathered, torch.full((rank + 1,), float(rank + 1), device="cuda"))
    inputs = [torch.full((r + 1,), float(rank + 1) * (r + 1), device="cuda") for r in range(world_size)]
    kept = [t.clone() for t in inputs]
    summed, averaged = torch.empty(rank + 1, device="cuda"), torch.empty(rank + 1, device="cuda")
    dist.reduce_scatter(summed, inputs)
    dist.reduce_scatter(averaged, inputs, op=dist.ReduceOp.AVG)
    return ([t.cpu() for t in gathered], summed.cpu(), averaged.cpu(),
            all(torch.equal(a, b) for a, b in zip(inputs, kept)))


def test_all_gather_and_reduce_scatter_of_uneven_sizes_as_nccl_does():
    """ProcessGroupNCCL takes lists of tensors of different sizes (one broadcast, or one reduce, per rank), which
    gloo underneath refuses; the inputs are left as they were."""
    with course.emulate(gpus=3):
        got = course.run_threads(_uneven, 3, backend="nccl")
    for rank, (gathered, summed, averaged, inputs_kept) in enumerate(got):
        for r, t in enumerate(gathered):
            torch.testing.assert_close(t, torch.full((r + 1,), float(r + 1)))
        torch.testing.assert_close(summed, torch.full((rank + 1,), 6.0 * (rank + 1)))
        torch.testing.assert_close(averaged, torch.full((rank + 1,), 2.0 * (rank + 1)))
        assert inputs_kept


def _all_to_all_inputs(rank, world_size):
    """Rank r sends rank s r + s + 1 values of its own: every pair exchanges a different size."""
    return [torch.arange(r + rank + 1, dtype=torch.float32) + 10 * rank for r in range(world_size)]


def _uneven_all_to_all(rank, world_size):
    torch.cuda.set_device(rank)
    inputs = [t.to("cuda") for t in _all_to_all_inputs(rank, world_size)]
    outputs = [torch.empty(rank + r + 1, device="cuda") for r in range(world_size)]
    dist.all_to_all(outputs, inputs)
    return [t.cpu() for t in outputs]


def test_all_to_all_of_uneven_sizes_as_nccl_does():
    """ProcessGroupNCCL::alltoall sends and receives each tensor on its own, so their sizes may differ (an MoE
    layer's token counts); gloo underneath refuses that and must not be what the program sees."""
    with course.emulate(gpus=3):
        got = course.run_threads(_uneven_all_to_all, 3, backend="nccl")
    for rank, outputs in enumerate(got):
        for src, t in enumerate(outputs):
            torch.testing.assert_close(t, _all_to_all_inputs(src, 3)[rank])


def test_receive_starts_when_both_sides_are_ready():
    """A recv posted long before the send completes when the sender's data exists, not before."""
    def ranks(rank, world_size):
        torch.cuda.set_device(rank)
        x = torch.ones(1024, 1024, device="cuda")
        if rank == 0:
            for _ in range(5):
                x = x @ x / 1024  # keeps GPU 0 busy before it sends
            dist.send(x, dst=1)
        else:
            dist.recv(x, src=0)
        return None
    with course.emulate(gpus=2) as emu:
        course.run_threads(ranks, 2, backend="nccl")
    last_matmul = max(e.end_ns for e in emu.trace if e.device == "cuda:0" and e.kind == "kernel")
    recv = next(e for e in emu.trace if e.name == "nccl:recv from 0")
    assert recv.start_ns >= last_matmul


def _direct_group(rank, world_size, store):
    """As c10d's own tests do: the group object built directly, its methods called with and without options."""
    torch.cuda.set_device(rank)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    group = dist.ProcessGroupNCCL(dist.PrefixStore("direct", store), rank, world_size, options)
    gathered = [[torch.empty(2, device="cuda") for _ in range(world_size)]]
    group.allgather(gathered, [torch.full((2,), float(rank), device="cuda")]).wait()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    work = group.allreduce([torch.tensor([float(rank)], device="cuda")], opts)
    work.wait()
    return [t.cpu() for t in gathered[0]], [t.cpu() for t in work.result()]


def test_process_group_nccl_built_directly():
    with course.emulate(gpus=2):
        results = course.run_threads(_direct_group, 2, dist.HashStore(), backend="nccl")
    for gathered, maximum in results:
        torch.testing.assert_close(gathered, [torch.zeros(2), torch.ones(2)])
        torch.testing.assert_close(maximum, [torch.ones(1)])


def _coalesced(rank, world_size):
    torch.cuda.set_device(rank)
    a, b = torch.ones(3, device="cuda") * (rank + 1), torch.ones(2, device="cuda") * (rank + 3)
    with dist._coalescing_manager(device=torch.device("cuda", rank), async_ops=True) as batch:
        dist.all_reduce(a)
        dist.all_reduce(b)
    batch.wait()
    gathered = torch.empty(2 * world_size, device="cuda")
    with dist._coalescing_manager(device=torch.device("cuda", rank)):
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device="cuda"))
    return a.cpu(), b.cpu(), gathered.cpu()


def test_coalescing_manager_with_a_device():
    """NCCL's group launch (`_start_coalescing` / `_end_coalescing`), which gloo lacks; it said 'No backend type
    associated with device type cuda' before."""
    with course.emulate(gpus=2):
        results = course.run_threads(_coalesced, 2, backend="nccl")
    for a, b, gathered in results:
        torch.testing.assert_close(a, torch.full((3,), 3.0))
        torch.testing.assert_close(b, torch.full((2,), 7.0))
        torch.testing.assert_close(gathered, torch.tensor([0.0, 0.0, 1.0, 1.0]))


def _dropped_outputs(rank, world_size):
    """Memory on the rank's GPU before a collective and after its output (and work) are dropped."""
    torch.cuda.set_device(rank)
    shard = torch.ones(256, device="cuda")
    before = torch.cuda.memory_allocated()
    gathered = torch.empty(256 * world_size, device="cuda")
    dist.all_gather_into_tensor(gathered, shard)
    dist.all_reduce(gathered)
    del gathered
    return before, torch.cuda.memory_allocated()


def test_a_dropped_collective_output_frees_its_memory():
    """The group keeps no work (which holds the outputs) outside a coalescing manager: ZeRO's gathered parameters
    must not stay on the GPU between steps (chapter 8's test saw 4608 bytes where 3072 fit)."""
    with course.emulate(gpus=2):
        for before, after in course.run_threads(_dropped_outputs, 2, backend="nccl"):
            assert after == before


def test_mixing_devices_in_python_still_fails_as_on_a_gpu():
    with course.emulate(gpus=2):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            torch.ones(3, device="cuda:0") + torch.ones(3)


def test_nccl_is_restored_after_the_emulator_stops():
    with course.emulate(gpus=2):
        assert dist.is_nccl_available() and dist.ProcessGroupNCCL.Options
    assert not dist.is_nccl_available()
    assert not hasattr(dist, "ProcessGroupNCCL")
    assert "COURSE_EMULATE" not in os.environ


def test_send_of_a_shape_only_tensor_says_to_materialize():
    """gloo underneath needs values: a shape-only send names the fix instead of gloo's 'Bad address'."""
    def ranks(rank, world_size):
        torch.cuda.set_device(rank)
        x = torch.ones(4, device="cuda")
        if rank == 0:
            dist.send(x, dst=1)
        else:
            dist.recv(x, src=0)
    with course.emulate(gpus=2, materialize=False), pytest.raises(RankFailed, match="materialize=True"):
        course.run_threads(ranks, 2, backend="nccl", timeout_s=20)


def _bf16_hooked_gradient(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    torch.cuda.set_device(rank)
    model = DDP(nn.Linear(4, 2, bias=False).cuda(), device_ids=[rank])
    model.register_comm_hook(None, bf16_compress_hook)
    x = torch.arange(12.0, device="cuda").reshape(3, 4) / 7 + rank
    model(x).sum().backward()
    return model.module.weight.grad.cpu()


def test_ddp_takes_the_bf16_compress_hook_as_on_a_cuda_box():
    """DDP refuses bf16_compress_hook on a build without CUDA; the emulated box has CUDA and NCCL 2.10+, and the
    averaged gradient is the bf16-rounded one."""
    with course.emulate(gpus=2):
        grads = course.run_threads(_bf16_hooked_gradient, 2, backend="nccl")
    per_rank = [(torch.arange(12.0).reshape(3, 4) / 7 + r).sum(0).expand(2, 4) for r in range(2)]
    exact = (per_rank[0] + per_rank[1]) / 2
    compressed = sum((g / 2).bfloat16() for g in per_rank).float()
    for grad in grads:
        torch.testing.assert_close(grad, compressed)
        assert not torch.equal(grad, exact)


def _reductions_as_nccl(rank, world_size):
    torch.cuda.set_device(rank)
    mine = torch.tensor([rank + 1, -(rank + 2), 7], dtype=torch.int32, device="cuda")
    out = {}
    t = mine.clone(); dist.reduce(t, dst=1); out["reduce"] = t.cpu()
    t = mine.clone(); dist.all_reduce(t, op=dist.ReduceOp.AVG); out["avg"] = t.cpu()
    big = torch.arange(2 * world_size, dtype=torch.int64, device="cuda") * (rank + 1)
    part = torch.empty(2, dtype=torch.int64, device="cuda")
    dist.reduce_scatter_tensor(part, big, op=dist.ReduceOp.AVG); out["rs_avg"] = part.cpu()
    refusals = {"band": lambda: dist.all_reduce(mine.clone(), op=dist.ReduceOp.BAND),
                "premul_int": lambda: dist.all_reduce(mine.clone(), op=dist._make_nccl_premul_sum(0.5)),
                "avg_bool": lambda: dist.all_reduce(mine.bool(), op=dist.ReduceOp.AVG),
                "non_contiguous": lambda: dist.all_reduce(torch.ones(3, 2, device="cuda").t()),
                "complex": lambda: dist.gather(torch.ones(2, dtype=torch.complex64, device="cuda"),
                                               [torch.empty(2, dtype=torch.complex64, device="cuda")] * world_size
                                               if rank == 0 else None, dst=0),
                "gather_size": lambda: dist.all_gather_into_tensor(torch.empty(2 * world_size + 1, device="cuda"),
                                                                   torch.ones(2, device="cuda")),
                "scatter_dtype": lambda: dist.reduce_scatter_tensor(
                    torch.empty(2, device="cuda"), torch.ones(2 * world_size, dtype=torch.half, device="cuda"))}
    for name, call in refusals.items():
        try:
            call()
            out[name] = None
        except (ValueError, TypeError) as error:
            out[name] = (type(error).__name__, str(error))
    grid = torch.arange(6.0, device="cuda").reshape(2, 3) + 10 * rank
    got = torch.zeros(3, 2, device="cuda").t()  # NCCL sends and receives any layout
    peer = (rank + 1) % world_size
    works = [dist.isend(grid.t().contiguous().t(), peer), dist.irecv(got, (rank - 1) % world_size)]
    for work in works:
        work.wait()
    out["p2p"] = got.cpu()
    return out


def test_reductions_and_refusals_are_nccls_not_gloos():
    """What ProcessGroupNCCL does where gloo underneath differs (course/cuda/nccl_checks.py): reduce leaves the other
    ranks' buffers alone, AVG of integers truncates, and what NCCL refuses raises its error."""
    world_size = 3
    with course.emulate(gpus=world_size):
        got = course.run_threads(_reductions_as_nccl, world_size, backend="nccl")
    mine = [torch.tensor([r + 1, -(r + 2), 7], dtype=torch.int32) for r in range(world_size)]
    total = sum(mine)
    big_sum = torch.arange(2 * world_size) * sum(r + 1 for r in range(world_size))
    for rank, out in enumerate(got):
        assert torch.equal(out["reduce"], total if rank == 1 else mine[rank])
        assert torch.equal(out["avg"], torch.div(total, world_size, rounding_mode="trunc"))
        assert torch.equal(out["rs_avg"], torch.div(big_sum, world_size, rounding_mode="trunc")[2 * rank:2 * rank + 2])
        assert out["band"] == ("ValueError", "Cannot use ReduceOp.BAND with NCCL")
        assert out["premul_int"] == ("TypeError", "PreMulSum Data type must be half, float, bfloat16 or double")
        assert out["avg_bool"] == ("TypeError", "Cannot use ReduceOp.AVG with boolean inputs")
        assert out["non_contiguous"] == ("ValueError", "Tensors must be contiguous")
        assert out["complex"][0] == "TypeError" and "not supported for NCCL" in out["complex"][1]
        assert out["gather_size"] == ("ValueError",
                                      "output tensor size must be equal to world_size times input tensor size")
        assert out["scatter_dtype"] == ("TypeError", "input tensor must be the same type as the output tensor.")
        sender = (rank - 1) % world_size
        assert torch.equal(out["p2p"], torch.arange(6.0).reshape(2, 3) + 10 * sender)


def _host_tensor_collectives(rank, world_size):
    torch.cuda.set_device(rank)
    out = {"backend": dist.get_backend()}
    for name, call in {"all_reduce": lambda t: dist.all_reduce(t), "broadcast": lambda t: dist.broadcast(t, 0),
                       "all_gather": lambda t: dist.all_gather([torch.empty(2) for _ in range(world_size)], t)}.items():
        host = torch.full((2,), float(rank + 1))
        try:
            call(host)
            out[name] = host.tolist()
        except RuntimeError as error:
            out[name] = str(error)
    gpu = torch.full((2,), float(rank + 1), device="cuda")
    dist.all_reduce(gpu)
    out["gpu"] = gpu.cpu().tolist()
    return out


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_host_tensors_need_a_cpu_backend_in_the_group(backend):
    """A group made with "nccl" alone has no backend for CPU tensors: a GPU box raises ProcessGroup::getBackend's
    error for them (the emulator ran them through gloo); "cpu:gloo,cuda:nccl" takes both, and DDP (above) still
    all-reduces its host-side buckets inside backward."""
    with course.emulate(gpus=2):
        results = course.run_threads(_host_tensor_collectives, 2, backend=backend)
    for result in results:
        assert result["backend"] == backend and result["gpu"] == [3.0, 3.0]
        if backend == "nccl":
            assert all(result[name] == "No backend type associated with device type cpu"
                       for name in ("all_reduce", "broadcast", "all_gather"))
        else:
            assert result["all_reduce"] == [3.0, 3.0] and result["broadcast"] == [1.0, 1.0]


def _objects_before_and_after_set_device(rank, world_size):
    """all_gather_object's tensors go to torch.cuda.current_device(): cuda:0 in every rank until set_device."""
    got = [None] * world_size
    with pytest.raises(dist.DistBackendError, match=f"Duplicate GPU detected : rank {rank} and rank {1 - rank} "
                                                    "both on CUDA device 0"):
        dist.all_gather_object(got, {"rank": rank})
    message = torch.full((2,), float(rank), device="cuda")
    if rank == 0:
        dist.send(message, dst=1)
    else:  # the receiver learns both GPUs
        with pytest.raises(dist.DistBackendError, match="Duplicate GPU detected : rank 1 and rank 0"):
            dist.recv(message, src=0)
    torch.cuda.set_device(rank)
    dist.all_gather_object(got, {"rank": rank})
    host = [None] * world_size
    dist.all_gather_object(host, {"rank": rank}, group=dist.new_group(backend="gloo"))
    message = torch.full((2,), float(rank), device="cuda")
    dist.send(message, dst=1) if rank == 0 else dist.recv(message, src=0)
    return got, host, message.cpu()


def test_two_ranks_on_one_gpu_are_refused_as_nccl_refuses_them():
    """NCCL will not build a communicator with two ranks on one GPU ("Duplicate GPU detected", the error of a script
    that forgets set_device), nor a send between two ranks on one GPU; the emulator ran them. With set_device the
    objects are gloo's."""
    with course.emulate(gpus=2):
        results = course.run_threads(_objects_before_and_after_set_device, 2, backend="nccl")
    for got, host, message in results:
        assert got == host == [{"rank": 0}, {"rank": 1}]
        assert torch.equal(message, torch.zeros(2))  # rank 0's values, received by rank 1


def _split_rank(rank, world_size, store):
    """split_group refuses without a device bound to the default group, as torch does; with device_id it splits."""
    with pytest.raises(RuntimeError, match="No device associated with the default pg"):
        dist.split_group(split_ranks=[[0, 1]])
    dist.destroy_process_group()
    dist.init_process_group("nccl", rank=rank, world_size=world_size, store=dist.PrefixStore("again", store),
                            device_id=torch.device("cuda", rank))
    both, alone = dist.split_group(split_ranks=[[0, 1]]), dist.split_group(split_ranks=[[1]])
    x = torch.arange(3.0, device=f"cuda:{rank}") * (rank + 1)
    dist.all_reduce(x, group=both)
    if alone is not None:
        dist.all_reduce(x, group=alone)
    return dist.get_process_group_ranks(both), alone is None, x.cpu()


def test_split_group_with_a_bound_device_gives_the_listed_groups():
    with course.emulate(gpus=2):
        results = course.run_threads(_split_rank, 2, dist.HashStore(), backend="nccl", timeout_s=20)
    want = torch.arange(3.0) * 1 + torch.arange(3.0) * 2
    assert [(ranks, none) for ranks, none, _ in results] == [([0, 1], True), ([0, 1], False)]
    for *_, got in results:
        torch.testing.assert_close(got, want)
