"""FSDP2, DTensor and functional collectives on emulated GPUs with init_process_group("nccl"): the fixes in
course/cuda/nccl.py, course/cuda/functional_collectives.py, course/cuda/fsdp2.py and course/cuda/backward_hooks.py."""
import glob
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import course
from course.cuda import fsdp2

def _mlp():
    torch.manual_seed(3)  # each rank thread seeds its own generator (course/cuda/rank_rng.py)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(6, 8, generator=g)


def _reference_grads():
    model = _mlp()
    model(_batch()).square().mean().backward()
    return [p.grad for p in model.parameters()]


def test_init_process_group_with_device_id(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(course.lessons.ranks.free_port()))
    with course.emulate(gpus=2):
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:1"))
        try:
            group = dist.group.WORLD
            assert dist.get_backend() == "nccl"
            assert group._get_backend(torch.device("cuda:1")) is group
            assert group.group_name  # "ProcessGroup name not set" before
            t = torch.ones(3, device="cuda:1")
            dist.all_reduce(t)
            assert t.device == torch.device("cuda:1") and t.tolist() == [1.0, 1.0, 1.0]
        finally:
            dist.destroy_process_group()


def _functional(rank, world_size):
    torch.cuda.set_device(rank)
    x = torch.arange(8.0, device="cuda").reshape(4, 2) + 10 * rank
    x = x @ torch.eye(2, device="cuda")  # a kernel the collectives must wait for
    gathered = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    scattered = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD)
    reduced = funcol.all_reduce(x, "max", dist.group.WORLD)
    return {name: (t.device, t.cpu()) for name, t in
            (("gathered", gathered), ("scattered", scattered), ("reduced", reduced))}


def test_functional_collectives_give_values_and_are_timed_on_the_link():
    with course.emulate(gpus=2) as emu:
        got = course.run_threads(_functional, 2, backend="nccl")
    xs = [torch.arange(8.0).reshape(4, 2) + 10 * r for r in range(2)]
    for rank, out in enumerate(got):
        assert all(device == torch.device("cuda", rank) for device, _ in out.values())
        torch.testing.assert_close(out["gathered"][1], torch.cat(xs))
        torch.testing.assert_close(out["scattered"][1], (xs[0] + xs[1])[2 * rank:2 * rank + 2])
        torch.testing.assert_close(out["reduced"][1], xs[1])
    trace = emu.trace
    assert not [e for e in trace if "_c10d_functional" in e.name]  # no made-up compute kernel for them
    for name in ("nccl:all_gather", "nccl:reduce_scatter", "nccl:all_reduce"):
        events = [e for e in trace if e.name == name]
        assert {e.device for e in events} == {"cuda:0", "cuda:1"}
        assert all(e.end_ns > e.start_ns for e in events)
    matmul_end = max(e.end_ns for e in trace if e.kind == "kernel" and "mm" in e.name)
    first = min(e.start_ns for e in trace if e.name == "nccl:all_gather")
    assert first >= matmul_end


def _fsdp_rank(rank, world_size):
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    model = _mlp().cuda()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(_batch().cuda()).square().mean().backward()  # every rank the same batch: gradients as one model's
    return [p.grad.full_tensor().cpu() for p in model.parameters()]


def test_fsdp2_gradients_match_one_model_and_collectives_are_timed():
    with course.emulate(gpus=2) as emu:
        results = course.run_threads(_fsdp_rank, 2, backend="nccl")
    for grads in results:
        for got, want in zip(grads, _reference_grads(), strict=True):
            torch.testing.assert_close(got, want)
    names = {(e.name, e.device) for e in emu.trace if e.kind == "collective"}
    for rank in range(2):
        assert ("nccl:all_gather", f"cuda:{rank}") in names
        assert ("nccl:reduce_scatter", f"cuda:{rank}") in names


def _fsdp_cpu_module_rank(rank, world_size):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import CPUOffloadPolicy

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    on_gpu, offloaded = _mlp(), _mlp()  # built on the CPU: fully_shard moves them to the mesh's GPU
    weight = on_gpu[0].weight
    fully_shard(on_gpu, mesh=mesh)
    fully_shard(offloaded, mesh=mesh, offload_policy=CPUOffloadPolicy())
    on_gpu(_batch().cuda()).square().mean().backward()
    offloaded(_batch().cuda()).square().mean().backward()
    full = get_model_state_dict(offloaded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return (weight.device, on_gpu[0].weight.to_local().device, offloaded[0].weight.to_local().device,
            [p.grad.full_tensor().cpu() for p in on_gpu.parameters()], [p.grad.to_local().device for p in
                                                                         offloaded.parameters()],
            {k: v.device for k, v in full.items()}, full.get("0.weight"))


def test_fsdp2_shards_a_cpu_module_onto_the_gpu_and_offloads_to_the_host():
    """fully_shard(cpu_module) moves it to the mesh's GPU (FSDP2 sets `param.data`, which the emulator swaps
    instead: a reference kept to a parameter sees it moved, as on a GPU); with CPUOffloadPolicy the shards and their
    gradients live on the host, and get_model_state_dict(full_state_dict=True) moves them to the GPU to all-gather:
    values as one model's."""
    with course.emulate(gpus=2):
        results = course.run_threads(_fsdp_cpu_module_rank, 2, backend="nccl")
    for rank, (kept, device, offloaded_device, grads, offloaded_grad_devices, full_devices, full_w) in \
            enumerate(results):
        assert kept == device == torch.device("cuda", rank) and offloaded_device == torch.device("cpu")
        for got, want in zip(grads, _reference_grads(), strict=True):
            torch.testing.assert_close(got, want)
        assert set(offloaded_grad_devices) == {torch.device("cpu")}
        if rank == 0:  # cpu_offload=True gives the full state dict to rank 0 only
            assert set(full_devices.values()) == {torch.device("cpu")}
            torch.testing.assert_close(full_w, _mlp()[0].weight.detach())


def _fsdp_divided_rank(rank, world_size, factor):
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    model = _mlp().cuda()
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(factor)  # FSDP2 then reduce-scatters with NCCL's PREMUL_SUM(1 / factor)
    model(_batch().cuda()).square().mean().backward()
    return [p.grad.full_tensor().cpu() for p in model.parameters()]


def test_fsdp2_gradient_divide_factor_scales_the_summed_gradients():
    """Every rank has the same batch, so the reduce-scatter sums world_size equal gradients: divided by 4
    instead of by 2 they come out half of one model's."""
    with course.emulate(gpus=2):
        results = course.run_threads(_fsdp_divided_rank, 2, 4.0, backend="nccl")
    for grads in results:
        for got, want in zip(grads, _reference_grads(), strict=True):
            torch.testing.assert_close(got, want / 2)


def _fully_shard_without_a_mesh(rank, world_size):
    torch.cuda.set_device(rank)
    model = _mlp().cuda()
    fully_shard(model)  # the default mesh: one over the accelerator torch detects
    model(_batch().cuda()).square().mean().backward()
    weight = model[0].weight
    return weight.device_mesh.device_type, str(weight.to_local().device), [p.grad.full_tensor().cpu() for p in
                                                                             model.parameters()]


def test_fully_shard_without_a_mesh_shards_over_the_emulated_gpus():
    """`fully_shard(model)` builds its mesh on `torch._C._get_accelerator()`: on a CPU build that said cpu, so FSDP2
    moved the GPU parameters back to the host (and stopped at `param.data = cpu_tensor`)."""
    with course.emulate(gpus=2):
        results = course.run_threads(_fully_shard_without_a_mesh, 2, backend="nccl")
    for rank, (mesh_type, device, grads) in enumerate(results):
        assert (mesh_type, device) == ("cuda", f"cuda:{rank}")
        for got, want in zip(grads, _reference_grads(), strict=True):
            torch.testing.assert_close(got, want)


def _fsdp1_rank(rank, world_size, strategy, offload=False):
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, ShardingStrategy, StateDictType

    torch.cuda.set_device(rank)
    before = torch.cuda.memory_allocated()  # what an earlier run's models (held by reference cycles) still count
    # HYBRID_SHARD shards within each row of a (replicas, shards) mesh and all-reduces across rows
    mesh = init_device_mesh("cuda", (world_size // 2, 2)) if strategy == "HYBRID_SHARD" else None
    model = FullyShardedDataParallel(_mlp().cuda(), sharding_strategy=ShardingStrategy[strategy],
                                     device_id=torch.cuda.current_device(), device_mesh=mesh,
                                     cpu_offload=CPUOffload(offload_params=offload))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(_batch().cuda()).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    local_numel = sum(p.numel() for p in model.parameters())
    memory = torch.cuda.memory_allocated() - before
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        state = {k: v.cpu() for k, v in model.state_dict().items()}
    return losses, local_numel, memory, state


def _reference_training():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(_batch()).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("strategy, world_size, offload", [("FULL_SHARD", 2, False), ("SHARD_GRAD_OP", 2, False),
                                                           ("HYBRID_SHARD", 4, False), ("FULL_SHARD", 2, True)])
def test_fsdp1_sharded_strategies_train_like_one_model_and_hold_a_shard(strategy, world_size, offload):
    """Every rank has the same batch, so FSDP1's averaged gradients are one model's: the losses and the gathered
    full state dict after two SGD steps are plain CPU training's, while each rank holds half the flat parameter
    and less memory than NO_SHARD (sharding froze the flat parameter's shape, or failed, before). HYBRID_SHARD on
4 ranks shards over pairs; with CPUOffload the shard and its optimizer step live on the host."""
    with course.emulate(gpus=world_size) as emu:
        unsharded = course.run_threads(_fsdp1_rank, world_size, "NO_SHARD", backend="nccl")
        sharded = course.run_threads(_fsdp1_rank, world_size, strategy, offload, backend="nccl")
    want_losses, want_state = _reference_training()
    total = sum(p.numel() for p in want_state.values())
    for losses, local_numel, memory, state in sharded:
        torch.testing.assert_close(losses, want_losses)
        torch.testing.assert_close(state, want_state)
        assert local_numel == total // 2
        assert memory < unsharded[0][2]
    names = {(e.name, e.device) for e in emu.trace if e.kind == "collective"}
    assert {("nccl:all_gather", "cuda:0"), ("nccl:reduce_scatter", "cuda:1")} <= names


_IMPORTS_FSDP_AFTER_THE_GROUP = """
import torch, torch.nn as nn, course

def rank(rank, world_size):
    from torch.distributed.fsdp import FullyShardedDataParallel  # first imported here, after the group is made
    model = FullyShardedDataParallel(nn.Linear(4, 4), device_id=rank)  # a CPU model, moved by FSDP
    model(torch.ones(2, 4, device=f"cuda:{rank}")).sum().backward()
    return [tuple(p.shape) for p in model.parameters()], str(next(model.parameters()).device)

with course.emulate(gpus=2):
    print(course.run_threads(rank, 2, backend="nccl"))
"""


def test_fsdp1_imported_after_the_process_group_shards_a_cpu_model():
    """The emulator's handling of FSDP1 is put in place when its modules are imported, not only when a group is
    made with them imported already (which this test module, importing FSDP2, cannot show in-process)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "-c", _IMPORTS_FSDP_AFTER_THE_GROUP], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str([([(10,)], "cuda:0"), ([(10,)], "cuda:1")])  # 20 weights, halved


def _stage_for_async_save(rank, world_size):
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    torch.cuda.set_device(rank)
    weights = torch.arange(6.0, device="cuda").reshape(2, 3) + rank
    assert torch.device("cpu") in dist.distributed_c10d._get_default_group()._device_types  # async_save's check
    staged = StateDictStager().stage({"weights": weights, "view": weights[:, 1:], "step": 3})
    return dist.distributed_c10d._get_default_group()._device_types, staged


def test_dcp_async_save_finds_a_cpu_backend_and_stages_gpu_tensors_to_the_host():
    """async_save refuses a group without a CPU backend ("cpu:gloo,cuda:nccl" has one), then copies every tensor to
    the host storage by storage: on emulated tensors it failed with 'copy_() on an invalid python storage'."""
    with course.emulate(gpus=2):
        results = course.run_threads(_stage_for_async_save, 2, backend="cpu:gloo,cuda:nccl")
    for rank, (device_types, staged) in enumerate(results):
        assert sorted(d.type for d in device_types) == ["cpu", "cuda"]
        want = torch.arange(6.0).reshape(2, 3) + rank
        assert staged["weights"].device == torch.device("cpu") and staged["step"] == 3
        torch.testing.assert_close(staged["weights"], want)
        torch.testing.assert_close(staged["view"], want[:, 1:])


def _snapshot_bytes() -> int:
    return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot())


def test_fsdp2_free_and_alloc_storage_give_memory_back_and_take_it_again():
    with course.emulate(gpus=1):
        t = torch.empty(1 << 20, device="cuda")
        view = t[:10]
        before, blocks = torch.cuda.memory_allocated(), torch.cuda.memory_stats()["active.all.current"]
        fsdp2.free_storage(t)
        assert t._inner.untyped_storage().size() == 0
        assert torch.cuda.memory_allocated() == before - (4 << 20)
        assert _snapshot_bytes() == torch.cuda.memory_allocated()  # no stale segment of the freed storage
        assert torch.cuda.memory_stats()["active.all.current"] == blocks - 1
        fsdp2.alloc_storage(t)
        assert torch.cuda.memory_allocated() == before
        assert _snapshot_bytes() == before and (4 << 20) in [s["total_size"] for s in torch.cuda.memory_snapshot()]
        assert torch.cuda.memory_stats()["active.all.current"] == blocks
        view.fill_(2.0)  # the view sees the re-grown storage
        assert t[:10].sum().item() == 20.0
        plain = torch.empty(4)
        fsdp2.free_storage(plain)  # CPU tensors: FSDP's own function
        assert plain.untyped_storage().size() == 0


def test_backward_hooks_can_make_cuda_tensors():
    with course.emulate(gpus=1):
        from course.cuda import backward_hooks

        seen = []
        x = torch.ones(3, device="cuda", requires_grad=True)
        y = x * 2
        y.register_hook(lambda g: seen.append(torch.zeros(2, device="cuda").device) or g)
        original = torch.autograd._engine_run_backward
        torch.autograd._engine_run_backward = backward_hooks.engine_run_backward
        try:
            y.sum().backward()
        finally:
            torch.autograd._engine_run_backward = original
        assert seen == [torch.device("cuda:0")]
        assert x.grad.tolist() == [2.0, 2.0, 2.0]


def _dtensor_devices(rank, world_size):
    from torch.optim.optimizer import _default_to_fused_or_foreach

    torch.cuda.set_device(rank)
    model = _mlp().cuda()
    fully_shard(model, mesh=init_device_mesh("cuda", (world_size,)))
    params = list(model.parameters())
    return [str(p.device) for p in params], all(p.is_cuda for p in params), _default_to_fused_or_foreach(params, False)


def test_dtensors_on_emulated_gpus_report_their_gpu_and_optimizers_take_the_foreach_path():
    from torch.distributed.tensor import DTensor

    with course.emulate(gpus=2):
        results = course.run_threads(_dtensor_devices, 2, backend="nccl")
    for rank, (devices, is_cuda, (fused, foreach)) in enumerate(results):
        assert devices == [f"cuda:{rank}"] * 4 and is_cuda
        assert foreach and not fused  # as on a GPU box: Adam's multi-tensor kernels, not one loop per parameter
    assert not isinstance(DTensor.__dict__.get("device"), property)  # the emulator gave it back


def _os_threads() -> int:
    """This process's threads but those of torch's own c10 thread pools ("pt_thread_pool"), which start workers
    lazily when an earlier test first gives them work: a run's gloo threads are what must not stay behind."""
    count = 0
    for task in glob.glob("/proc/self/task/*"):
        try:
            count += Path(task, "comm").read_text().strip() != "pt_thread_pool"
        except FileNotFoundError:  # it ended after the listing
            pass
    return count


def test_run_threads_leaves_no_process_group_threads_behind():
    """FSDP's and DeviceMesh's process groups sit in reference cycles, each holding gloo threads: run_threads frees
    them, or a notebook calling it a few times runs out of address space in the memory-limited grading sandbox."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("counts threads through Linux's /proc")
    with course.emulate(gpus=2):
        course.run_threads(_fsdp_rank, 2, backend="nccl")  # warm up: threads torch keeps for good
        before = _os_threads()
        for _ in range(3):
            course.run_threads(_fsdp_rank, 2, backend="nccl")
        deadline = time.monotonic() + 10  # a freed group's threads end on their own, soon after
        while _os_threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _os_threads() <= before


def _dtensor_with_a_scalar(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    torch.manual_seed(0)
    full, scale = torch.randn(6, 4), torch.tensor(2.5)
    out = []
    for _ in range(20):  # rank threads share FakeTensorMode's cache: each rank's sharding propagation must see its GPU
        x = distribute_tensor(full, mesh, [Shard(0)])
        s = distribute_tensor(scale, mesh, [Replicate()])
        out.append((x * s + s).full_tensor().cpu())
    return full, scale, out


def test_dtensor_ops_with_a_zero_dim_dtensor_in_rank_threads():
    with course.emulate(gpus=2):
        results = course.run_threads(_dtensor_with_a_scalar, 2, backend="nccl")
    for full, scale, out in results:
        for got in out:
            torch.testing.assert_close(got, full * scale + scale)


def _random_draws(device_mesh=None):
    """The same draws on one device (device_mesh None) or as DTensors sharded over the mesh, gathered; then the
    generator's next draw, which shows how far each advanced."""
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def spread(tensor, placements):
        return tensor if device_mesh is None else distribute_tensor(tensor, device_mesh, placements)

    def gathered(tensor):
        return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()

    draws = {}
    torch.manual_seed(0)
    if device_mesh is None:
        draws["randn"], draws["rand"] = torch.randn(6, 4, device="cuda"), torch.rand(5, 3, device="cuda")
    else:
        draws["randn"] = dt.randn(6, 4, device_mesh=device_mesh, placements=[Shard(0)])
        draws["rand"] = dt.rand(5, 3, device_mesh=device_mesh, placements=[Replicate()])
    ones = spread(torch.ones(4, 6, device="cuda"), [Shard(1)])
    draws["dropout"] = nn.functional.dropout(ones, 0.5)
    draws["normal_"] = ones.clone().normal_()
    draws["bernoulli"] = torch.bernoulli(ones * 0.3)
    draws["uniform_ generator"] = nn.init.uniform_(ones.clone(), generator=torch.Generator("cuda").manual_seed(4))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    if device_mesh is not None:
        fully_shard(model, mesh=device_mesh)
    model.to_empty(device="cuda")
    torch.manual_seed(1)
    for layer in model:
        layer.reset_parameters()
    draws.update({name: p for name, p in model.named_parameters()})
    draws["next"] = torch.rand(3, device="cuda")
    return {name: gathered(t) for name, t in draws.items()}


def _sharded_random_draws(rank, world_size):
    torch.cuda.set_device(rank)
    return _random_draws(init_device_mesh("cuda", (world_size,)))


def test_dtensor_random_ops_give_each_shard_its_part_of_the_one_device_draw():
    """As OffsetBasedRNGTracker does on a GPU box: dtensor randn, dropout, in-place init and a program's generator
    on a sharded DTensor, and FSDP2's meta-device init (to_empty, reset_parameters), gathered, equal the same draws
    on one GPU from the same seed, and every rank's generator ends where that one's does."""
    with course.emulate(gpus=2):
        one_device = _random_draws()
        ranks = course.run_threads(_sharded_random_draws, 2, backend="nccl")
    for draws in ranks:
        assert draws.keys() == one_device.keys()
        for name, value in draws.items():
            assert torch.equal(value, one_device[name]), name


def _dtensor_attention(rank, world_size):
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g).cuda() for _ in range(3))
    qd, kd, vd = (distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    out.full_tensor().square().sum().backward()
    sequence = [distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
    by_sequence = F.scaled_dot_product_attention(*sequence, is_causal=True)
    by_sequence.full_tensor().square().sum().backward()
    return (out.placements, out.to_local().device, out.full_tensor().cpu(), qd.grad.full_tensor().cpu(),
            vd.grad.full_tensor().cpu(), by_sequence.full_tensor().cpu(), sequence[1].grad.full_tensor().cpu())


def test_sdpa_on_head_sharded_dtensors_attends_per_shard_and_a_sharded_sequence_takes_dtensors_rules():
    """As CUDA's flash / memory-efficient sharding rules do, heads sharded over GPUs attend locally (the CPU kernel
    the emulator runs has no DTensor rule: every DTensor SDPA stopped). A sequence-sharded call goes to the fused op a
    GPU would pick, whose DTensor rules redistribute it (it was refused by name)."""
    from torch.distributed.tensor import Shard

    with course.emulate(gpus=2):
        results = course.run_threads(_dtensor_attention, 2, backend="nccl")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g).requires_grad_() for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref.square().sum().backward()
    for rank, (placements, device, out, q_grad, v_grad, by_sequence, k_grad) in enumerate(results):
        assert placements == (Shard(1),) and device == torch.device("cuda", rank)
        torch.testing.assert_close(out, ref.detach())
        torch.testing.assert_close(q_grad, q.grad)
        torch.testing.assert_close(v_grad, v.grad)
        torch.testing.assert_close(by_sequence, ref.detach())
        torch.testing.assert_close(k_grad, k.grad)


def _ring_attention(rank, world_size, dtype):
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 128, 8, generator=g, dtype=dtype).cuda() for _ in range(4))
    buffers = [t.clone() for t in (q, k, v, grad)]
    dist.barrier()  # context_parallel patches F.scaled_dot_product_attention for the process: enter, run, leave together
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
        local = [t.requires_grad_() for t in buffers[:3]]
        out = F.scaled_dot_product_attention(*local, is_causal=True)
        out.backward(buffers[3])
        dist.barrier()
    full = context_parallel_unshard(mesh, [out.detach()] + [t.grad for t in local], [2] * 4)
    return local[0].shape[2], [t.cpu() for t in full]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_context_parallel_ring_attention_gives_full_attention_and_its_gradients(dtype):
    """Context parallelism shards the sequence and runs ring attention: each rank's flash (bf16) or memory-efficient
    (fp32) kernel over its queries and every rank's keys in turn, merged by log-sum-exp, and the same ring backward.
    It was refused by name. The backward kernels now use the log-sum-exp and output they are given, as CUDA's do: a
    softmax over one rank's keys alone gave wrong gradients. The emulator's DTensor patches are put in place once,
    not again at every collective (each had wrapped the last: deeper calls, and a longer list to undo, every step)."""
    with course.emulate(gpus=2) as emu:
        results = course.run_threads(_ring_attention, 2, dtype, backend="nccl")
        assert [name for _, name, _ in emu._saved].count("_propagate_tensor_meta_non_cached") == 1
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 128, 8, generator=g, dtype=dtype) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(grad)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    for local_length, full in results:
        assert local_length == 64
        for got, want in zip(full, [out.detach()] + [t.grad for t in leaves]):
            torch.testing.assert_close(got.float(), want.float(), **tol)
