"""Idioms common in public training scripts, each checked against plain CPU torch under the emulator."""
import pytest
import torch
import torch.nn as nn

import course


@pytest.fixture
def emu():
    with course.emulate(gpus=2) as emulator:
        yield emulator


def test_cpu_index_tensors_index_a_gpu_tensor_as_in_cuda(emu):
    values = torch.arange(5.0)
    on_gpu = values.to("cuda")
    picked = on_gpu[torch.tensor([0, 3])]
    masked = on_gpu[torch.tensor([True, False, True, False, True])]
    assert picked.device == torch.device("cuda", 0)
    torch.testing.assert_close(picked.cpu(), values[torch.tensor([0, 3])])
    torch.testing.assert_close(masked.cpu(), values[torch.tensor([True, False, True, False, True])])
    on_gpu[torch.tensor([1])] = 7.0
    assert on_gpu.cpu().tolist() == [0.0, 7.0, 2.0, 3.0, 4.0]
    with pytest.raises(RuntimeError, match="same device"):  # index_select does not move its index in CUDA
        torch.index_select(on_gpu, 0, torch.tensor([1]))


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_pin_memory_feeds_non_blocking_copies(emu, workers):
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.arange(16))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=workers, pin_memory=True)
    sums = []
    for x, _ in loader:
        assert x.is_pinned()
        sums.append(x.to("cuda", non_blocking=True).sum().item())
    expected = [data.tensors[0][i:i + 4].sum().item() for i in range(0, 16, 4)]
    assert sums == pytest.approx(expected)


@pytest.mark.parametrize("options", [{}, {"foreach": True}, {"fused": True}])
def test_adamw_variants_match_cpu(options):
    def train(device):
        torch.manual_seed(0)
        model = nn.Linear(4, 4).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, **options)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 4, device=device)).square().sum().backward()
            opt.step()
        return model.weight.detach().cpu()
    want = train("cpu")
    with course.emulate(gpus=1):
        got = train("cuda")
    torch.testing.assert_close(got, want)


def test_integer_devices_mean_cuda_as_on_a_gpu_box(emu):
    """`torch.device(1)`, `.to(rank)`, `Module.to(rank)` and `device=rank` all name cuda:<rank>."""
    assert torch.device(1) == torch.device("cuda", 1) and isinstance(torch.device(1), torch.device)
    model = nn.Linear(2, 2).to(1)
    assert model.weight.device == torch.device("cuda", 1)
    x = torch.ones(3).to(device=1, dtype=torch.float16)
    assert (x.device, x.dtype) == (torch.device("cuda", 1), torch.float16)
    assert torch.zeros(2, device=0).device == torch.device("cuda", 0)
    torch.testing.assert_close(model(x.float().expand(2, 3)[:, :2]).cpu(),
                               nn.functional.linear(torch.ones(2, 2), model.weight.cpu(), model.bias.cpu()))


def test_dataparallel_scatters_a_cpu_batch_on_copy_streams(emu):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    batch = torch.randn(8, 4)
    expected = model(batch)
    out = nn.DataParallel(model.cuda())(batch)
    assert out.device == torch.device("cuda", 0)
    torch.testing.assert_close(out.cpu(), expected)
    stream = torch.Stream(1)
    assert isinstance(stream, torch.Stream) and stream.device == torch.device("cuda", 1)


def test_sync_batchnorm_kernels_follow_batchnorm():
    """The CUDA-only batch_norm_* ops, in CPU torch, give BatchNorm's output, running stats and gradients."""
    from course.cuda import cuda_only_ops as ops
    torch.manual_seed(0)
    x = torch.randn(6, 4, 5, 5, requires_grad=True)
    weight, bias = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    running = (torch.zeros(4), torch.ones(4))
    expected = nn.functional.batch_norm(x, *running, weight, bias, training=True, momentum=0.1, eps=1e-5)
    dy = torch.randn_like(expected)
    expected.backward(dy)
    halves = [ops.batch_norm_stats(h.detach(), 1e-5) for h in x.detach().chunk(2)]  # two "ranks"
    ours_running = (torch.zeros(4), torch.ones(4))
    mean, invstd = ops.batch_norm_gather_stats_with_counts(
        x, torch.stack([m for m, _ in halves]), torch.stack([s for _, s in halves]), *ours_running, 0.1, 1e-5,
        torch.tensor([75.0, 75.0]))  # elements per channel on each rank
    out = ops.batch_norm_elemt(x.detach(), weight.detach(), bias.detach(), mean, invstd, 1e-5)
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(ours_running, running)
    sum_dy, sum_dy_xmu, grad_w, grad_b = ops.batch_norm_backward_reduce(dy, x.detach(), mean, invstd, weight.detach(),
                                                                        True, True, True)
    grad_x = ops.batch_norm_backward_elemt(dy, x.detach(), mean, invstd, weight.detach(), sum_dy, sum_dy_xmu,
                                           torch.tensor([75, 75], dtype=torch.int32))
    torch.testing.assert_close((grad_x, grad_w, grad_b), (x.grad, weight.grad, bias.grad))


def test_optimizers_take_the_foreach_path_per_gpu_as_on_cuda(emu):
    """AdamW and clip_grad_norm_ use foreach kernels grouped per GPU, with no copy to the host."""
    def train(first, second):
        torch.manual_seed(0)
        a, b = nn.Linear(8, 8).to(first), nn.Linear(8, 2).to(second)
        params = [*a.parameters(), *b.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2)
        for step in range(3):
            torch.manual_seed(step)
            loss = b(a(torch.randn(4, 8).to(first)).relu().to(second)).pow(2).mean()
            loss.backward()
            nn.utils.clip_grad_norm_(params, 0.1)
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in params]

    expected = train("cpu", "cpu")
    start = len(emu.trace)
    got = train("cuda:0", "cuda:1")
    names = [e.name for e in emu.trace[start:]]
    torch.testing.assert_close([p.cpu() for p in got], expected)
    assert "aten::_foreach_addcdiv_" in names and "aten::_foreach_norm" in names
    assert not [n for n in names if n.startswith("copy cuda") and n.endswith("->cpu")], "no device-to-host copy"


def test_gpu_tensors_are_shared_and_share_memory_is_a_no_op(emu):
    """torch/_tensor.py: `is_shared()` is always True for CUDA tensors and `share_memory_()` a no-op (it crashed
    on an emulated tensor's placeholder storage); CPU tensors still move to shared memory."""
    model = nn.Linear(3, 2).to("cuda")
    weight = model.weight.detach().clone()
    assert model.share_memory() is model
    assert model.weight.is_shared() and model.weight.is_cuda
    torch.testing.assert_close(model.weight.detach(), weight)
    host = torch.zeros(3)
    assert not host.is_shared() and host.share_memory_().is_shared()


def _use_the_gpu(queue):
    try:
        torch.ones(2, device="cuda")
        queue.put("ran")
    except RuntimeError as error:
        queue.put(str(error))


def test_a_forked_child_cannot_use_the_gpu_as_on_cuda(emu):
    """A child forked from a process that uses CUDA gets CUDA's error; on the emulator it would otherwise compute
    on private copies of the parent's GPU tensors, which the parent never sees."""
    import multiprocessing
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_use_the_gpu, args=(queue,))
    child.start()
    said = queue.get(timeout=60)
    child.join()
    assert said.startswith("Cannot re-initialize CUDA in forked subprocess")
    assert torch.ones(2, device="cuda").sum().item() == 2.0  # the parent is untouched
