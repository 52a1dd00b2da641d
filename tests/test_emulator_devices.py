"""Ordinary CUDA PyTorch code runs unchanged under course.emulate and agrees with plain CPU PyTorch."""
import copy
import io
import re
import threading

import numpy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import course


@pytest.fixture
def emu():
    with course.emulate(gpus=4) as emulator:
        yield emulator


def test_factories_place_tensors_on_the_named_device(emu):
    assert torch.randn(2, 3, device="cuda:1").device == torch.device("cuda", 1)
    assert torch.zeros(2, device=torch.device("cuda", 2)).device == torch.device("cuda", 2)
    assert torch.ones(2, device=3).device == torch.device("cuda", 3)
    with torch.device("cuda:3"):
        assert torch.empty(4).device == torch.device("cuda", 3)
    torch.set_default_device("cuda:2")
    try:
        assert torch.arange(5).device == torch.device("cuda", 2)
    finally:
        torch.set_default_device(None)
    assert torch.arange(5).device == torch.device("cpu")


def test_device_properties_and_repr_show_the_fake_device(emu):
    x = torch.tensor([1.0, 2.0], device="cuda:1")
    assert x.is_cuda and not x.is_cpu and x.get_device() == 1
    assert repr(x) == "tensor([1., 2.], device='cuda:1')"
    h = torch.ones(2, device="cuda:0", dtype=torch.float16, requires_grad=True)
    assert repr(h) == "tensor([1., 1.], device='cuda:0', dtype=torch.float16, requires_grad=True)"
    assert "grad_fn=<MulBackward0>" in repr(h * 2)


def test_to_cuda_cpu_and_current_device(emu):
    x = torch.randn(3)
    assert x.to("cuda:2").device.index == 2
    assert x.cuda().device.index == 0
    torch.cuda.set_device(1)
    assert torch.cuda.current_device() == 1
    assert x.cuda().device.index == 1
    assert torch.zeros(1, device="cuda").device.index == 1
    with torch.cuda.device(3):
        assert x.cuda().device.index == 3
    assert torch.cuda.current_device() == 1
    y = x.to("cuda:2").to(torch.float64)
    assert y.dtype == torch.float64 and y.device.index == 2
    back = y.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu"
    torch.testing.assert_close(back, x.double())
    moved = x.to("cuda:1")
    assert moved.to("cuda:1") is moved  # no copy when already there, as in PyTorch


def test_autograd_across_devices_matches_cpu(emu):
    torch.manual_seed(0)
    a_cpu = torch.randn(6, 5, requires_grad=True)
    b_cpu = torch.randn(5, 4, requires_grad=True)
    ((a_cpu @ b_cpu).relu().sum()).backward()

    a = a_cpu.detach().to("cuda:0").requires_grad_()
    b = b_cpu.detach().to("cuda:1").requires_grad_()
    out = (a.to("cuda:1") @ b).relu().sum()
    out.backward()
    assert a.grad.device == torch.device("cuda", 0)
    assert b.grad.device == torch.device("cuda", 1)
    torch.testing.assert_close(a.grad.cpu(), a_cpu.grad)
    torch.testing.assert_close(b.grad.cpu(), b_cpu.grad)


def _train(device, optimizer_cls, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
    optimizer = optimizer_cls(model.parameters())
    x = torch.randn(10, 8).to(device)
    y = torch.randint(0, 3, (10,)).to(device)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}, loss.item()


@pytest.mark.parametrize("optimizer_cls", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01),
], ids=["SGD", "Adam"])
def test_training_on_a_fake_gpu_equals_cpu_training(optimizer_cls):
    expected, expected_loss = _train("cpu", optimizer_cls)
    with course.emulate(gpus=2):
        got, got_loss = _train("cuda:1", optimizer_cls)
    assert got_loss == pytest.approx(expected_loss, rel=1e-5)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


def test_moving_a_meta_tensor_raises_as_pytorch_does(emu):
    """A meta tensor has no values: `.to("cuda")`, `.cuda()`, `.cpu()` and `nn.Module.to` raise PyTorch's
    NotImplementedError (with to_empty's hint for modules), as plain CPU torch's `.cpu()` does; they made a GPU
    tensor of nothing, or returned the meta tensor."""
    meta = torch.empty(2, device="meta")
    for move in (lambda: meta.to("cuda"), lambda: meta.cuda(1), lambda: meta.cpu(), lambda: meta.to("cpu")):
        with pytest.raises(NotImplementedError, match="^Cannot copy out of meta tensor; no data!$"):
            move()
    with torch.device("meta"):
        layer = nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="Please use torch.nn.Module.to_empty"):
        layer.to("cuda")
    assert layer.to_empty(device="cuda").weight.device == torch.device("cuda", 0)


def test_module_to_and_cuda_move_parameters_and_keep_them_parameters(emu):
    model = nn.Linear(4, 2)
    model.cuda(2)
    assert isinstance(model.weight, nn.Parameter)
    assert model.weight.device == torch.device("cuda", 2)
    assert model.bias.device == torch.device("cuda", 2)
    assert model(torch.randn(3, 4, device="cuda:2")).device.index == 2


def test_gpu_parameter_given_host_values_becomes_a_host_tensor_and_back(emu):
    """`param.data = param.cpu()` (FSDP1's offload to the CPU) keeps the parameter object, as on a GPU box: it is
    then a CPU tensor with the same values, its ops run on the host, and it can go back to its GPU the same way."""
    param = nn.Parameter(torch.arange(6.0, device="cuda:1"))
    with torch.no_grad():
        param.data = param.cpu()
    assert param.device == torch.device("cpu") and isinstance(param, nn.Parameter)
    assert (param * 2).device == torch.device("cpu")
    assert param.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with torch.no_grad():
        param.data = param.to("cuda:1")
    assert param.device == torch.device("cuda:1") and param.sum().item() == 15.0


def test_module_moves_to_a_gpu_while_a_cpu_forward_output_is_alive(emu):
    """`expected = model(x); model.cuda()`, as tests compute their reference first: autograd still holds the CPU
    parameters LayerNorm saved, so the move goes by `param.data = ...`, which was refused here and runs on a GPU.
    The parameters keep their identity (the optimizer's), values and memory count; the old graph refuses a backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    expected = model(x)
    before = torch.cuda.memory_allocated(0)
    model.cuda()
    params = list(model.parameters())
    assert [id(p) for p in params] == [id(p) for p in optimizer.param_groups[0]["params"]]
    assert all(isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad and p.device.index == 0 for p in params)
    moved_with_graph = torch.cuda.memory_allocated(0) - before
    twin = copy.deepcopy(model).cuda(1)  # the same move with no graph holding the parameters
    assert moved_with_graph == torch.cuda.memory_allocated(1) > 0 and twin[0].weight.device.index == 1
    out = model(x.cuda())
    torch.testing.assert_close(out.cpu(), expected)
    out.sum().backward()
    assert all(p.grad.device.index == 0 for p in params)
    with pytest.raises(RuntimeError, match="since moved to an emulated GPU"):
        expected.sum().backward()


def test_state_dict_save_load_and_deepcopy(emu, tmp_path):
    model = nn.Linear(4, 2).to("cuda:1")
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path)  # weights_only=True, PyTorch's default
    assert loaded["weight"].device == torch.device("cuda", 1)
    other = nn.Linear(4, 2).to("cuda:3")
    other.load_state_dict(loaded)
    assert other.weight.device.index == 3
    torch.testing.assert_close(other.weight.cpu(), model.weight.cpu())
    twin = copy.deepcopy(model)
    assert twin.weight.device.index == 1
    torch.testing.assert_close(twin.weight.cpu(), model.weight.cpu())


def test_copies_share_memory_where_pytorchs_copies_share_it(emu):
    """`copy.copy(x)` is a new leaf on x's memory; `copy.deepcopy` of tensors that share memory (a view, a storage)
    gives copies that share their new memory, as plain CPU torch's do (each used to get values of its own)."""
    def run(device):
        x = torch.arange(4.0, device=device).requires_grad_()
        shallow = copy.copy(x)
        with torch.no_grad():
            shallow.mul_(10)
        a, b = torch.arange(6.0, device=device).view(2, 3), torch.ones(2, device=device)
        deep = copy.deepcopy([a, a[1], a.untyped_storage(), b])
        deep[0].add_(1)
        return [shallow.requires_grad, shallow.is_leaf, x.tolist(), deep[1].tolist(), a.tolist(),
                torch.empty(0, device=device).set_(deep[2]).tolist(), deep[3].device.type]

    assert run("cuda:1") == run("cpu")[:-1] + ["cuda"]


def test_saved_tensors_load_on_the_cpu_outside_the_emulator():
    """A file saved on emulated GPUs is a CUDA checkpoint: a CPU-only machine loads it with map_location="cpu"."""
    buffer = io.BytesIO()
    with course.emulate(gpus=2):
        weight = torch.arange(4.0, device="cuda:1")
        torch.save({"w": weight}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location="cpu")
    assert type(loaded["w"]) is torch.Tensor
    torch.testing.assert_close(loaded["w"], torch.arange(4.0))
    buffer.seek(0)
    with pytest.raises(RuntimeError, match=r"Attempting to deserialize object on a CUDA device but "
                                           r"torch.cuda.is_available\(\) is False"):
        torch.load(buffer)


def test_mixing_devices_raises_pytorchs_message(emu):
    a, b = torch.ones(2, device="cuda:0"), torch.ones(2, device="cuda:1")
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, but found "
                                           r"at least two devices, cuda:0 and cuda:1!$"):
        a + b
    with pytest.raises(RuntimeError, match="cuda:0 and cpu!"):
        a + torch.ones(2)
    with pytest.raises(RuntimeError, match="same device"):
        nn.Linear(2, 2).to("cuda:1")(a)
    with pytest.raises(RuntimeError, match=r"^torch.block_diag: input tensors must all be on the same device. Input 0 "
                                           r"is on device cuda:1 and input 2 is on device cpu$"):
        torch.block_diag(b, b, torch.tensor(3.0))  # its own check: a 0-dim host tensor does not join the GPU


def test_host_scalars_join_only_tensoriterator_kernels_as_on_a_gpu(emu):
    """A 0-dim host tensor joins a GPU op that TensorIterator runs (`x * t`, `torch.where`), with plain CPU torch's
    values; ops whose CUDA wrapper checks devices (clamp with tensor bounds, matmuls, index_select under
    `nn.Embedding`) refuse it, and any host tensor, in the wrapper's words. `clamp(max=cpu_scalar)` ran here and stops
    on a GPU box; masked_fill refuses a host mask in its kernel's own words."""
    host, scalar = torch.arange(6.0).reshape(2, 3), torch.tensor(2.5)
    x = host.to("cuda:1")
    torch.testing.assert_close((x * scalar).cpu(), host * scalar)
    torch.testing.assert_close(torch.where(x > 2, x, scalar).cpu(), torch.where(host > 2, host, scalar))
    torch.testing.assert_close(x.clamp(max=scalar.to("cuda:1")).cpu(), host.clamp(max=scalar))
    torch.testing.assert_close(torch.lerp(x, x * 2, scalar).cpu(), torch.lerp(host, host * 2, scalar))
    with pytest.raises(RuntimeError, match=r"^Trying to pass too many CPU scalars to non-CPU kernel!$"):
        torch.addcmul(x, scalar, scalar)  # TensorIterator takes one
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, but got max is on cpu, "
                                           r"different from other tensors on cuda:1 \(when checking argument in method "
                                           r"wrapper_CUDA_clamp_Tensor\)$"):
        x.clamp(max=scalar)
    with pytest.raises(RuntimeError, match=r"but got mat2 is on cpu, different from other tensors on cuda:1 \(when "
                                           r"checking argument in method wrapper_CUDA_mm\)$"):
        x @ torch.ones(3, 2)
    with pytest.raises(RuntimeError, match=r"but got index is on cpu, different from other tensors on cuda:1 \(when "
                                           r"checking argument in method wrapper_CUDA__index_select\)$"):
        nn.Embedding(4, 2).to("cuda:1")(torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, but found at least two "
                                           r"devices, cuda:1 and cpu!$"):
        torch.ones(3) + x  # TensorIterator names the GPU first
    with pytest.raises(RuntimeError, match=r"^expected self and mask to be on the same device, but got mask on cpu and "
                                           r"self on cuda:1$"):
        x.masked_fill(torch.tensor(True), 0.0)


def test_convolutions_refuse_mixed_tensors_as_cudnn_and_onednn_do(emu):
    """A convolution compares its tensors' types before it runs (Convolution.cpp's check_input_same_type_as_parameters):
    a GPU model given host images, or GPU images given a host model or half ones, fails with PyTorch's best-known
    messages; weights on another GPU meet cudnn_convolution's wrapper. The CPU's kernels worded the dtype mismatch
    otherwise ("expected scalar type Half but found Float"), and the device mismatches as any op's."""
    images, conv = torch.randn(2, 3, 8, 8), nn.Conv2d(3, 4, 3)
    on_gpu = copy.deepcopy(conv).to("cuda:0")
    torch.testing.assert_close(on_gpu(images.cuda()).cpu(), conv(images))
    with pytest.raises(RuntimeError, match=r"^Input type \(torch.FloatTensor\) and weight type "
                                           r"\(torch.cuda.FloatTensor\) should be the same or input should be a MKLDNN "
                                           r"tensor and weight is a dense tensor$"):
        on_gpu(images)
    with pytest.raises(RuntimeError, match=r"^Input type \(torch.cuda.FloatTensor\) and weight type "
                                           r"\(torch.FloatTensor\) should be the same$"):
        conv(images.cuda())
    with pytest.raises(RuntimeError, match=r"^Input type \(torch.cuda.HalfTensor\) and weight type "
                                           r"\(torch.cuda.FloatTensor\) should be the same$"):
        F.conv2d(images.cuda().half(), on_gpu.weight)
    with pytest.raises(RuntimeError, match=r"but got weight is on cuda:1, different from other tensors on cuda:0 "
                                           r"\(when checking argument in method wrapper_CUDA__cudnn_convolution\)$"):
        on_gpu.to("cuda:1")(images.cuda())


def test_ctc_loss_takes_host_targets_and_lengths_as_cuda_pytorch_does(emu):
    """F.ctc_loss with GPU log-probs and int32 targets on the host runs on a GPU box (cuDNN's CTC, which
    `_use_cudnn_ctc_loss` picks when every input is full length and blank is 0): CPU torch's losses and gradients.
    Long host targets, which ctc_loss_impl moves to the GPU for the native kernel, and the default mean, which divides
    by the target lengths on the losses' device, raised a device mismatch."""
    gen = torch.Generator().manual_seed(0)
    log_probs = torch.randn(12, 3, 6, generator=gen).log_softmax(2).requires_grad_()
    targets = torch.randint(1, 6, (9,), generator=gen, dtype=torch.int32)
    on_gpu = log_probs.detach().cuda().requires_grad_()
    loss = F.ctc_loss(on_gpu, targets, [12] * 3, [3, 4, 2], reduction="sum")
    expected = F.ctc_loss(log_probs, targets, [12] * 3, [3, 4, 2], reduction="sum")
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected)
    torch.testing.assert_close(on_gpu.grad.cpu(), log_probs.grad)
    lengths = torch.tensor([12] * 3, dtype=torch.int32), torch.tensor([3, 4, 2], dtype=torch.int32)
    for host_targets in (targets, targets.long()):
        torch.testing.assert_close(nn.CTCLoss()(on_gpu, host_targets, *lengths).cpu(),
                                   nn.CTCLoss()(log_probs, host_targets, *lengths))
    torch.testing.assert_close(F.ctc_loss(on_gpu, targets.long(), [11] * 3, [3, 4, 2]).cpu(),
                               F.ctc_loss(log_probs, targets.long(), [11] * 3, [3, 4, 2]))


def test_gpu_indices_into_a_host_tensor_raise_as_on_a_gpu(emu):
    """`host_table[gpu_ids]` (a diffusion scheduler's alphas_cumprod[timesteps]) fails on a GPU box with the index
    op's own check: it ran here and gave a GPU tensor. A GPU tensor still takes host indices, and writes through
    GPU indices into a host tensor fail as TensorIterator fails them."""
    table, gpu_ids = torch.arange(5.0), torch.tensor([4, 1], device="cuda")
    for index in (lambda: table[gpu_ids], lambda: table[gpu_ids > 2], lambda: torch.index_select(table, 0, gpu_ids)):
        with pytest.raises(RuntimeError, match=r"indices should be either on cpu or on the same device as the indexed "
                                               r"tensor \(cpu\)|Expected all tensors to be on the same device"):
            index()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        table.index_put_((gpu_ids,), torch.tensor(0.0))
    on_gpu = table.cuda()[gpu_ids.cpu()]
    assert on_gpu.device == torch.device("cuda", 0) and on_gpu.tolist() == table[gpu_ids.cpu()].tolist()


def test_integer_matrix_products_raise_cudas_error(emu):
    """cuBLAS has no integer GEMM: CUDA PyTorch dispatches mm/addmm/bmm/baddbmm for floating and complex dtypes only,
    where the CPU computes an integer product. The emulator gave a number a GPU never gives; now CUDA's error."""
    a = torch.ones(2, 2, dtype=torch.long)
    for call, name in [(lambda t: t @ t, "addmm_cuda"), (lambda t: torch.einsum("bij,bjk->bik", t[None], t[None]),
                                                         "baddbmm_cuda"), (lambda t: torch.addmm(t, t, t), "addmm_cuda")]:
        with pytest.raises(NotImplementedError, match=f'"{name}" not implemented for \'Long\''):
            call(a.cuda())
        assert call(a).tolist() == call(a).tolist()  # the host's kernels are untouched
    with pytest.raises(RuntimeError, match="\"addmm_cuda\" not implemented for 'Bool'"):
        a.bool().cuda() @ a.bool().cuda()
    assert ((a.cuda().half() @ a.cuda().half()).cpu() == 2).all()


def test_kernels_cuda_lacks_dtypes_for_raise_cudas_error(emu):
    """CUDA kernels with fewer dtypes than the CPU's (course/cuda/kernel_dtypes.py): a uint8 bilinear resize, an
    integer max/avg pool or convolution, a half-precision angle or igamma, an integer addbmm or F.bilinear ran here and
    raise on a GPU. The OpInfo sweep found them; the dtypes CUDA has still run and match the CPU. Half cdist, pdist and
    ctc_loss, which neither has, give CUDA's error rather than one saying a GPU would run them."""
    img = torch.arange(32, dtype=torch.uint8).reshape(1, 2, 4, 4)
    inputs = (img, img.long(), torch.ones(3, 2, 2, dtype=torch.long), torch.linspace(0.1, 1, 5, dtype=torch.float16))
    calls = [(lambda x, xl, i, h: F.interpolate(x, scale_factor=2, mode="bilinear"), "upsample_bilinear2d_out_frame",
              "Byte"),
             (lambda x, xl, i, h: F.interpolate(x, scale_factor=2, mode="bicubic"), "upsample_bicubic2d_out_frame",
              "Byte"),
             (lambda x, xl, i, h: F.max_pool2d(xl, 2), "max_pool2d_with_indices_out_cuda_frame", "Long"),
             (lambda x, xl, i, h: F.avg_pool2d(xl, 2), "avg_pool2d_out_cuda_frame", "Long"),
             (lambda x, xl, i, h: F.conv2d(xl, i[:1, None].expand(3, 2, 2, 2)), "slow_conv2d_cuda", "Long"),
             (lambda x, xl, i, h: torch.angle(h), "angle_cuda", "Half"),
             (lambda x, xl, i, h: torch.igamma(h, h), "igamma_cuda", "Half"),
             (lambda x, xl, i, h: torch.histc(h.bfloat16() if h.dtype == torch.float16 else h), "histc",
              "BFloat16"),
             (lambda x, xl, i, h: torch.addbmm(i[0], i, i), "addmm_cuda", "Long"),
             (lambda x, xl, i, h: F.bilinear(i[0], i[0], i), "baddbmm_cuda", "Long")]
    for call, name, c10_name in calls:
        with pytest.raises(NotImplementedError, match=f'"{name}" not implemented for \'{c10_name}\''):
            call(*[t.cuda(1) for t in inputs])
        call(*inputs)  # the host's kernels are untouched
        floats = [t.double() if t.dtype != torch.float16 else t.float() for t in inputs]
        got = call(*[t.cuda(1) for t in floats])
        assert got.device == torch.device("cuda", 1)
        torch.testing.assert_close(got.cpu(), call(*floats))
    with pytest.raises(RuntimeError, match="HalfTensor is not supported"):
        torch.histc(inputs[3].cuda())
    log_probs = torch.randn(6, 1, 3).log_softmax(2).half().cuda()  # half kernels neither the CPU nor CUDA has
    for call, name in ((lambda h: torch.cdist(h, h, p=1.0), "cdist_cuda"), (lambda h: F.pdist(h), "pdist_cuda"),
                       (lambda h: F.ctc_loss(log_probs, torch.tensor([[1, 2]]).cuda(), [6], [2]), "ctc_loss_cuda")):
        with pytest.raises(NotImplementedError, match=f'"{name}" not implemented for \'Half\''):
            call(inputs[3].reshape(5, 1).cuda())
    same_size = F.interpolate(img.cuda(), size=(4, 4), mode="bilinear")  # copied before the kernel's dispatch
    assert same_size.dtype == torch.uint8 and torch.equal(same_size.cpu(), img)
    flags, index = torch.tensor([True, False, True]), torch.tensor([0, 1, 1])
    with pytest.raises(NotImplementedError, match="\"cuda_scatter_gather_base_kernel_func\" not implemented for 'Bool'"):
        flags.cuda().scatter_reduce(0, index.cuda(), flags.cuda(), "amax")
    summed = flags.cuda().scatter_reduce(0, index.cuda(), flags.cuda(), "sum")  # its kernel takes Bool
    assert torch.equal(summed.cpu(), flags.scatter_reduce(0, index, flags, "sum"))


def test_factories_take_gpu_scalars_as_keywords(emu):
    """`torch.linspace(start=gpu_scalar, end=gpu_scalar, device="cuda")`, as torch.signal.windows.kaiser calls it, made
    a GPU tensor wrapped in another, whose .cpu() stayed on cuda:0: silently on the wrong device."""
    beta = torch.tensor(12.0, device="cuda:1")
    k = torch.linspace(start=-beta, end=beta, steps=5, device="cuda")
    assert k.device == torch.device("cuda", 0) and k.cpu().device == torch.device("cpu")
    assert torch.equal(k.cpu(), torch.linspace(-12.0, 12.0, 5))
    window = torch.signal.windows.kaiser(4, beta=12.0, device="cuda")
    assert window.cpu().device == torch.device("cpu")
    torch.testing.assert_close(window.cpu(), torch.signal.windows.kaiser(4, beta=12.0))


def test_ops_cuda_runs_where_the_cpu_kernel_refuses(emu):
    """What the OpInfo sweep found a GPU runs and the emulator refused with the CPU's error: softmax's half-to-float
    forward and backward (autocast's), nansum/nanmean of complex tensors, half avg_pool3d, antialiased resizes, gamma
    and binomial draws and the gamma gradient, abs and trace of bool, `copy` given positionally to Tensor.to; and half grid_sample, which the
    CPU computes in half."""
    gen = torch.Generator().manual_seed(0)
    x, grad = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
    for forward, backward in ((torch.ops.aten._softmax, torch.ops.aten._softmax_backward_data),
                              (torch.ops.aten._log_softmax, torch.ops.aten._log_softmax_backward_data)):
        out = forward(x.half().cuda(1), 1, True)
        assert out.dtype == torch.float32 and out.device == torch.device("cuda", 1)
        torch.testing.assert_close(out.cpu(), forward(x.half().float(), 1, False))
        back = backward(grad.cuda(1), out, 1, torch.float16)
        assert back.dtype == torch.float16
        torch.testing.assert_close(back.cpu(), backward(grad, out.cpu(), 1, torch.float32).half())
        with pytest.raises(RuntimeError, match="conversion is supported for Half type only"):
            forward(x.cuda(), 1, True)
    nan = float("nan")
    z = torch.tensor([1 + 1j, complex(nan, 1), 2 - 1j, complex(1, nan)])
    assert torch.nansum(z.cuda()).item() == 3 and torch.nanmean(z.cuda()).item() == 1.5
    for half in (torch.float16, torch.bfloat16):  # kernels CUDA has for half and computes in float; the CPU lacks them
        volume = torch.randn(1, 2, 4, 4, 4, generator=gen).to(half).cuda(1).requires_grad_()
        pooled = F.avg_pool3d(volume, 2)
        assert pooled.dtype == half
        torch.testing.assert_close(pooled.cpu(), F.avg_pool3d(volume.detach().cpu().float(), 2).to(half))
        pooled.float().sum().backward()
        assert volume.grad.dtype == half and (volume.grad.cpu() == 1 / 8).all()
        for mode in ("bilinear", "bicubic"):
            resized = F.interpolate(volume[0].detach(), scale_factor=0.5, mode=mode, antialias=True)
            torch.testing.assert_close(resized.cpu(), F.interpolate(volume[0].detach().cpu().float(), scale_factor=0.5,
                                                                    mode=mode, antialias=True).to(half))
        alpha = torch.rand(6, generator=gen) + 0.5  # Distributions.cu's samplers, drawn in float
        draws = []
        for a in (alpha.to(half).cuda(1), alpha.to(half).float()):
            torch.manual_seed(0)
            draws.append((torch._standard_gamma(a), torch.binomial(a * 8, a / 2)))
        for got, want in zip(*draws):
            assert got.dtype == half and torch.equal(got.cpu(), want.to(half))
        slope = torch._standard_gamma_grad(alpha.to(half).cuda(1), draws[0][0])  # a half Gamma's rsample backward
        want = torch._standard_gamma_grad(alpha.to(half).float(), draws[0][0].cpu().float()).to(half)
        assert slope.dtype == half and torch.equal(slope.cpu(), want)
        # grid_sample interpolates in float on a GPU (GridSampler.cu's opmath); the CPU kernel did it in half
        image, grid = torch.randn(2, 3, 8, 8, generator=gen), torch.rand(2, 5, 5, 2, generator=gen) * 2 - 1
        on_gpu = image.to(half).cuda().requires_grad_()
        sampled = F.grid_sample(on_gpu, grid.to(half).cuda(), align_corners=False)
        reference = image.to(half).float().requires_grad_()
        expected = F.grid_sample(reference, grid.to(half).float(), align_corners=False)
        torch.testing.assert_close(sampled.cpu(), expected.to(half), atol=0, rtol=0)
        sampled.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(on_gpu.grad.cpu(), reference.grad.to(half), atol=0, rtol=0)
    flags = torch.tensor([[True, False], [True, True]])
    assert torch.equal(torch.abs(flags.cuda()).cpu(), flags)
    assert torch.trace(flags.cuda()).dtype == torch.int64 and torch.trace(flags.cuda()).item() == 2
    copied = x.cuda().to(torch.float32, False, True)
    assert copied.device == torch.device("cuda", 0) and torch.equal(copied.cpu(), x)
    moved = x.to("cuda:1", torch.float64, False, True)
    assert moved.device == torch.device("cuda", 1) and moved.dtype == torch.float64


def test_half_gradients_sum_in_float_as_cuda_kernels_do(emu):
    """LayerNorm, BatchNorm and embedding gradients of half and bfloat16 tensors: CUDA's kernels sum in float and round
    once (plain CPU torch's float kernels, rounded), where the CPU's sums in half stop growing (a bias gradient of 2048
    for 8192 rows); LayerNorm and BatchNorm save float statistics; `x[idx]`'s backward adds narrow rows in float."""
    gen = torch.Generator().manual_seed(0)
    x, ids = torch.rand(4096, 8, generator=gen) + 0.5, torch.randint(0, 3, (4096,), generator=gen)
    dy = torch.rand(4096, 8, generator=gen)
    for half in (torch.float16, torch.bfloat16):
        for norm in (nn.LayerNorm(8), nn.BatchNorm1d(8)):
            gpu = copy.deepcopy(norm).to(half).cuda(1)
            out = gpu(x.to(half).cuda(1))
            out.backward(dy.to(half).cuda(1))
            wide = copy.deepcopy(norm)
            wide(x.to(half).float()).backward(dy.to(half).float())
            assert out.dtype == gpu.weight.grad.dtype == half
            for p, q in zip(gpu.parameters(), wide.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad.to(half), atol=1.0, rtol=1e-2)
            for b, c in zip(gpu.buffers(), wide.buffers()):
                torch.testing.assert_close(b.cpu(), c.to(b.dtype))
        stats = torch.ops.aten.native_layer_norm(x.to(half).cuda(), [8], None, None, 1e-5)
        assert [t.dtype for t in stats] == [half, torch.float32, torch.float32]
        table = torch.zeros(3, 4, dtype=half, device="cuda:1", requires_grad=True)
        one_bag = torch.tensor([0], device="cuda:1")
        (F.embedding(ids.cuda(1), table).sum() + F.embedding_bag(ids.cuda(1), table, one_bag).sum()
         + table[ids.cuda(1)].sum()).backward()
        counts = torch.bincount(ids, minlength=3).float()
        torch.testing.assert_close(table.grad.cpu(), (2 * counts + counts / 4096)[:, None].expand(3, 4).to(half))


def test_half_precision_fft_runs_as_cufft_runs_it(emu):
    """cuFFT's float16/complex32 transforms (the CPU has none, and refused with "Unsupported dtype Half"): results in
    the half dtypes, the float transform's values rounded, gradients back in float16; signal sizes that are not
    powers of two stop with cuFFT's error (CuFFTPlanCache.h), bfloat16 with the dtype check's, and a host tensor as
    before."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).half()
    for name, kwargs in [("fft", {}), ("ifft2", {}), ("rfft", {}), ("irfftn", {"s": (4, 8)}), ("hfft", {"n": 8}),
                         ("ihfft2", {})]:
        call = getattr(torch.fft, name)
        gpu = x.cuda(1).requires_grad_()
        out = call(gpu, **kwargs)
        host = x.float().requires_grad_()
        expected = call(host, **kwargs)
        assert out.device == torch.device("cuda", 1)
        assert out.dtype == (torch.complex32 if expected.is_complex() else torch.float16)
        torch.testing.assert_close(out.cpu().to(expected.dtype), expected.detach().to(out.dtype).to(expected.dtype))
        loss = (lambda t: t.abs().sum() if t.is_complex() else t.square().sum())
        loss(out).backward()
        expected_grad, = torch.autograd.grad(loss(expected), host)
        assert gpu.grad.dtype == torch.float16 and gpu.grad.device == torch.device("cuda", 1)
        torch.testing.assert_close(gpu.grad.cpu().float(), expected_grad, atol=1e-2, rtol=1e-2)
    chalf = torch.fft.fft(x.cuda()).to(torch.complex32)
    assert torch.fft.ifft(chalf).dtype == torch.complex32 and torch.fft.irfft(chalf, n=8).dtype == torch.float16
    with pytest.raises(RuntimeError, match=r"powers of two when computing in half precision, but got a signal size "
                                           r"of\[3, 8\]"):
        torch.fft.fft2(x[:3].cuda())
    with pytest.raises(RuntimeError, match=r"but got a signal size of\[14\]"):
        torch.fft.irfft(x.cuda())  # the default n, 2 * (8 - 1)
    with pytest.raises(RuntimeError, match="Unsupported dtype BFloat16"):
        torch.fft.fft(x.bfloat16().cuda())
    with pytest.raises(RuntimeError, match="Unsupported dtype Half"):
        torch.fft.fft(x)


def test_lu_without_pivoting_runs_as_cuda_runs_it(emu):
    """`pivot=False` LU, which only CUDA runs (the CPU refuses it): L @ U gives A back, pivots are 1..k, infos name
    the first zero pivot with the NaNs after it set to 0 as PyTorch's cuSOLVER path does, LU is column-major as the
    pivoted one, and gradients pass gradcheck. A host tensor keeps the CPU's error."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.complex128):
        for shape in ((2, 4, 4), (4, 2), (3, 5)):
            a = torch.randn(shape, dtype=dtype, generator=gen)
            lu, pivots, info = torch.linalg.lu_factor_ex(a.cuda(1), pivot=False)
            k = min(shape[-2:])
            assert lu.device == torch.device("cuda", 1) and lu.stride() == torch.linalg.lu_factor_ex(a).LU.stride()
            assert torch.equal(pivots.cpu(), torch.arange(1, k + 1, dtype=torch.int32).expand(shape[:-2] + (k,)))
            assert (info.cpu() == 0).all()
            _, lower, upper = torch.lu_unpack(lu, pivots, unpack_pivots=False)
            torch.testing.assert_close((lower @ upper).cpu(), a)
            p, lower2, upper2 = torch.linalg.lu(a.cuda(1), pivot=False)
            assert p.numel() == 0 and torch.equal(lower2.cpu(), lower.cpu()) and torch.equal(upper2.cpu(), upper.cpu())
            for pivoted, expected in zip(torch.linalg.lu_factor_ex(a.cuda(1)), torch.linalg.lu_factor_ex(a)):
                assert torch.equal(pivoted.cpu(), expected)  # pivot=True: the CPU's LAPACK, as before
            for pivoted, expected in zip(torch.linalg.lu(a.cuda(1)), torch.linalg.lu(a)):
                assert torch.equal(pivoted.cpu(), expected)
    ones = torch.ones(2, 3, 3, dtype=torch.float64).cuda()
    lu, _, info = torch.linalg.lu_factor_ex(ones, pivot=False)
    assert info.tolist() == [2, 2]
    assert torch.equal(lu[0].cpu(), torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"U\[2,2\] is zero"):
        torch.linalg.lu_factor(ones, pivot=False)
    x = torch.randn(3, 3, dtype=torch.float64, generator=gen).cuda().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: torch.linalg.lu(t, pivot=False)[1:], (x,))
    assert torch.autograd.gradcheck(lambda t: torch.linalg.lu_factor(t, pivot=False)[0], (x,))
    with pytest.raises(RuntimeError, match="LU without pivoting is not implemented on the CPU"):
        torch.linalg.lu_factor(x.detach().cpu(), pivot=False)


def test_integer_histc_and_half_rrelu_run_as_on_a_gpu(emu):
    """Kernels CUDA has and the CPU lacks: histc of integers (counts in the input's dtype, bins in integer arithmetic,
    the data's range when min == max) and rrelu of float16, whose training-mode slopes are the float op's draws from
    the same seed, rounded, with gradients to match."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.uint8, torch.int32, torch.int64):
        x = torch.randint(0, 49, (300,), generator=gen).to(dtype)
        for bins, low, high in ((5, 0, 50), (49, 0, 49), (7, 3.9, 40), (4, 0, 0)):
            counts = torch.histc(x.cuda(1), bins=bins, min=low, max=high)
            assert counts.dtype == dtype and counts.device == torch.device("cuda", 1)
            expected = torch.histc(x.double(), bins=bins, min=int(low), max=int(high))
            assert torch.equal(counts.cpu().double(), expected)
    assert torch.histc(torch.tensor([2, 2]).cuda(), bins=3).tolist() == [0, 2, 0]  # range widened to [1, 3]
    with pytest.raises(RuntimeError, match="value cannot be converted to type uint8_t without overflow"):
        torch.histc(torch.tensor([2, 2], dtype=torch.uint8).cuda(), bins=3, min=-1, max=3)
    h = torch.randn(16, generator=gen).half()
    gpu, host = h.cuda(1).requires_grad_(), h.float().requires_grad_()
    torch.manual_seed(7)
    out = F.rrelu(gpu, training=True)
    torch.manual_seed(7)
    expected = F.rrelu(host, training=True)
    assert out.dtype == torch.float16 and torch.equal(out.cpu(), expected.detach().half())
    out.sum().backward()
    expected.sum().backward()
    assert gpu.grad.dtype == torch.float16 and torch.equal(gpu.grad.cpu(), host.grad.half())
    in_place = h.cuda()
    torch.manual_seed(7)
    F.rrelu(in_place, training=True, inplace=True)
    assert torch.equal(in_place.cpu(), expected.detach().half())


def test_fused_attention_ops_called_directly_return_what_cuda_returns(emu):
    """`_flash_attention_forward` / `_efficient_attention_forward` (OpInfo calls them by name; the CPU has no kernel):
    their meta functions' outputs (layout, float32 log-sum-exp, padded to 32 with +inf for the memory-efficient one,
    seed and offset), values and gradients as the math path gives them with flash's lower-right causal mask and
    the memory-efficient kernel's mask types, dropout's mask drawn again in backward from the returned seed; a
    sliding window and a float32 flash call stop by name."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, m, n, dim = 2, 4, 11, 32, 8
    q, k, v = (torch.randn(batch, s, heads, dim, generator=gen) for s in (m, n, n))

    def reference(lower_right_offset):
        qf, kf, vf = (t.transpose(1, 2).requires_grad_() for t in (q.clone(), k.clone(), v.clone()))
        mask = None if lower_right_offset is None else torch.ones(m, n, dtype=torch.bool).tril(lower_right_offset)
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask)
        out.square().sum().backward()
        return out.transpose(1, 2), [t.grad.transpose(1, 2) for t in (qf, kf, vf)]

    for causal in (False, True):
        args = [t.half().cuda(1).requires_grad_() for t in (q, k, v)]
        out, lse, seed, offset, debug = torch.ops.aten._flash_attention_forward(*args, None, None, m, n, 0.0, causal,
                                                                                False)
        assert out.shape == q.shape and out.dtype == torch.float16 and out.device == torch.device("cuda", 1)
        assert lse.shape == (batch, heads, m) and lse.dtype == torch.float32
        assert seed.shape == (2,) and seed.dtype == offset.dtype == torch.uint64 and debug.numel() == 0
        expected, grads = reference(n - m if causal else None)
        torch.testing.assert_close(out.cpu().float(), expected, atol=2e-3, rtol=2e-3)
        out.float().square().sum().backward()
        for arg, grad in zip(args, grads):
            torch.testing.assert_close(arg.grad.cpu().float(), grad, atol=1e-2, rtol=1e-2)
    for mask_type, offset in ((0, None), (1, 0), (2, n - m)):
        args = [t.cuda().requires_grad_() for t in (q, k, v)]
        out, lse, seed, offset_t, max_q, max_k = torch.ops.aten._efficient_attention_forward(
            *args, None, None, None, None, None, 0.0, mask_type, True)
        assert lse.shape == (batch, heads, 32) and (lse[..., m:] == float("inf")).all().item()
        assert seed.dtype == offset_t.dtype == torch.int64 and (max_q, max_k) == (m, n)
        expected, grads = reference(offset)
        torch.testing.assert_close(out.cpu(), expected)
        out.square().sum().backward()
        for arg, grad in zip(args, grads):
            torch.testing.assert_close(arg.grad.cpu(), grad)
    args = [t.cuda().requires_grad_() for t in (q, k, v)]  # dropout: one mask, drawn from the returned seed, in both
    out, _, seed, _, _, _ = torch.ops.aten._efficient_attention_forward(*args, None, None, None, None, None, 0.5, 0,
                                                                        True)
    out.square().sum().backward()
    keep = torch.rand(batch, heads, m, n, generator=torch.Generator().manual_seed(int(seed.cpu()))) >= 0.5
    qf, kf, vf = (t.transpose(1, 2).requires_grad_() for t in (q.clone(), k.clone(), v.clone()))
    expected = (torch.softmax(qf @ kf.mT * dim ** -0.5, -1) * keep / 0.5) @ vf
    expected.square().sum().backward()
    torch.testing.assert_close(out.cpu().transpose(1, 2), expected.detach())
    for arg, reference in zip(args, (qf, kf, vf)):
        torch.testing.assert_close(arg.grad.cpu().transpose(1, 2), reference.grad)
    with pytest.raises(RuntimeError, match="with sliding_window is not modelled"):
        torch.ops.aten._flash_attention_forward(q.half().cuda(), k.half().cuda(), v.half().cuda(), None, None, m, n,
                                                0.0, False, False, window_size_left=4, window_size_right=0)
    with pytest.raises(RuntimeError, match="FlashAttention only support fp16 and bf16 data type"):
        torch.ops.aten._flash_attention_forward(q.cuda(), k.cuda(), v.cuda(), None, None, m, n, 0.0, False, False)


def test_varlen_attention_attends_each_packed_sequence_as_flash_does(emu):
    """`torch.nn.attention.varlen.varlen_attn` (flash's variable-length kernel over sequences packed along the first
    dimension; its custom op's body calls `_flash_attention_forward` with their offsets) gives each sequence's own
    attention, causal by the window (-1, 0), with gradients, as plain CPU torch's SDPA over each sequence gives them;
    the log-sum-exp is (heads, total)."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn
    torch.manual_seed(0)
    bounds = [0, 3, 9, 11]
    q, k, v = (torch.randn(11, 2, 8).bfloat16() for _ in range(3))

    def per_sequence(q, k, v):
        pieces = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True)
                  for a, b in zip(bounds, bounds[1:])]
        return torch.cat([p.transpose(0, 1) for p in pieces])

    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    want = per_sequence(*leaves)
    want.square().sum().backward()
    gpu = [t.cuda().requires_grad_() for t in (q, k, v)]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    out, lse = varlen_attn(*gpu, cu, cu, 6, 6, window_size=(-1, 0), return_aux=AuxRequest(lse=True))
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 11) and lse.dtype == torch.float32
    torch.testing.assert_close(out.float().cpu(), want.detach(), atol=2e-2, rtol=2e-2)
    for got, leaf in zip(gpu, leaves):
        torch.testing.assert_close(got.grad.float().cpu(), leaf.grad, atol=5e-2, rtol=5e-2)


def test_complex_kernels_that_conjugate_inside_agree_with_the_cpu(emu):
    """pinv, pinverse and lstsq build lazy conjugate views inside their C++ (`Vh.mH() * S`); under
    __torch_dispatch__ the dispatcher's Conjugate fallback was off, so the bit was dropped and the results silently
    wrong (the OpInfo sweep found it). Real dtypes take the same path as before."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.complex64, torch.complex128, torch.float64):
        a, b = torch.randn(4, 4, dtype=dtype, generator=gen), torch.randn(4, 2, dtype=dtype, generator=gen)
        for call in (torch.linalg.pinv, torch.pinverse, lambda m: torch.linalg.lstsq(m, b.to(m.device)).solution,
                     lambda m: torch.linalg.pinv(m @ m.mH, hermitian=True), lambda m: (m.conj() @ m.mT).conj()):
            got = call(a.cuda(1))
            assert got.device == torch.device("cuda", 1) and got.dtype == dtype
            torch.testing.assert_close(got.cpu(), call(a))
    z = torch.randn(3, 3, dtype=torch.complex64, generator=gen)
    assert not torch.equal(torch.linalg.pinv(z), torch.linalg.pinv(z.conj().resolve_conj()))  # the bit matters


def test_integer_vector_products_raise_cudas_error(emu):
    """CUDA's dot (which a real vdot calls) and addmv (which mv runs on) dispatch floating and complex dtypes only,
    as its matrix products do (aten/src/ATen/native/cuda/Blas.cpp); addmv returns zeros for an empty matrix before
    its dispatch. The emulator computed integer ones; now CUDA's errors, and the same numbers for floats."""
    v, m = torch.arange(3), torch.arange(6).reshape(2, 3)
    calls = [(lambda v, m: v @ v, "dot"), (lambda v, m: torch.dot(v, v), "dot"), (lambda v, m: torch.vdot(v, v), "dot"),
             (lambda v, m: m @ v, "addmv_impl_cuda"), (lambda v, m: m.mv(v), "addmv_impl_cuda"),
             (lambda v, m: torch.addmv(m[:, 0], m, v), "addmv_impl_cuda")]
    for call, name in calls:
        for dtype, c10_name in [(torch.long, "Long"), (torch.int32, "Int"), (torch.bool, "Bool")]:
            with pytest.raises(NotImplementedError, match=f'"{name}" not implemented for \'{c10_name}\''):
                call(v.to(dtype).cuda(), m.to(dtype).cuda())
        assert call(v, m).tolist() == call(v.double(), m.double()).long().tolist()  # the host computes them still
        floats = call(v.double().cuda(1), m.double().cuda(1))
        assert floats.device == torch.device("cuda", 1)
        torch.testing.assert_close(floats.cpu(), call(v.double(), m.double()))
    empty = torch.zeros(0, 3, dtype=torch.long).cuda()
    assert empty.mv(v.cuda()).shape == (0,) and torch.addmv(torch.zeros(0, dtype=torch.long).cuda(), empty,
                                                            v.cuda()).shape == (0,)


def test_dynamically_quantized_models_refuse_gpu_inputs_as_cuda_builds_do(emu):
    """quantize_dynamic's quantized::linear_dynamic has CPU kernels only: fed a cuda input, a GPU box raises the
    dispatcher's error, where the emulator computed it on the CPU kernel. On host inputs it still runs."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        quantized = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 3)), {nn.Linear},
                                                           dtype=torch.qint8)
    x = torch.randn(2, 4)
    expected = quantized(x)
    with pytest.raises(NotImplementedError, match=r"^Could not run 'quantized::linear_dynamic' with arguments from "
                                                  r"the 'CUDA' backend\..*only available for these backends: \[CPU"):
        quantized.cuda()(x.cuda())
    torch.testing.assert_close(quantized.cpu()(x), expected)


def _quantized_uses(device):
    """The quantized ops with CUDA kernels (native_functions.yaml: quantize_per_tensor / per_channel and
    _make_per_tensor_quantized_tensor for CUDA, dequantize, int_repr, q_scale, views, clone, relu for QuantizedCUDA)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, device=device)
    q = torch.quantize_per_tensor(x, 0.1, 3, torch.quint8)
    per_channel = torch.quantize_per_channel(x, torch.tensor([0.1, 0.05], device=device),
                                             torch.tensor([0, 2], device=device), 0, torch.qint8)
    made = torch._make_per_tensor_quantized_tensor(torch.arange(4, dtype=torch.uint8, device=device), 0.5, 1)
    views = [q.view(3, 2), q.reshape(6)[2:], q.clone(), torch.relu(q), q.t()]
    texts = [repr(t) for t in (q, per_channel, views[0])]
    return {"values": [q.int_repr(), q.dequantize(), per_channel.int_repr(), made.dequantize()]
            + [v.int_repr() for v in views] + [v.dequantize() for v in views],
            "params": [q.q_scale(), q.q_zero_point(), q.qscheme(), per_channel.q_per_channel_axis(), made.dtype],
            "devices": {t.device.type for t in [q, per_channel, made] + views}, "texts": texts}


def test_quantized_tensors_on_gpus_run_the_ops_cuda_has_and_refuse_the_rest(emu):
    """Quantized GPU tensors give CPU torch's values for the ops a CUDA build has kernels for, and print as a GPU
    prints them (they raised "load_scalar: invalid type"); an op with only a QuantizedCPU kernel raises the
    dispatcher's QuantizedCUDA error (the CPU kernels would have run it)."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions")  # their deprecation
        emu.stop()
        want = _quantized_uses("cpu")
        emu.start()
        got = _quantized_uses("cuda")
        q = torch.quantize_per_tensor(torch.randn(4, device="cuda"), 0.1, 0, torch.quint8)
    assert got["devices"] == {"cuda"} and got["params"] == want["params"]
    for mine, theirs in zip(got["values"], want["values"]):
        assert mine.device.type == "cuda"
        torch.testing.assert_close(mine.cpu(), theirs)
    for mine, theirs in zip(got["texts"], want["texts"]):  # the device first among the suffixes, as a GPU's
        assert mine.replace(", device='cuda:0'", "").split() == theirs.split() and "device='cuda:0'" in mine
    for op in (lambda: torch.cat([q, q]), lambda: torch.sigmoid(q), lambda: q.mean(0)):
        with pytest.raises(NotImplementedError, match="with arguments from the 'QuantizedCUDA' backend"):
            op()
    assert torch.cat([q.cpu(), q.cpu()]).is_quantized  # the host keeps its QuantizedCPU kernels


def test_histogram_has_no_cuda_kernel_as_on_a_gpu_box(emu):
    """torch.histogram / histogramdd are CPU-only in CUDA builds (torch.histc is the GPU's): the emulator computed
    them; now the dispatcher's error. Host tensors still get them."""
    x = torch.rand(50, device="cuda")
    for call, op in [(lambda t: torch.histogram(t, bins=4), "aten::histogram.bin_ct"),
                     (lambda t: torch.histogramdd(t.view(25, 2), bins=[2, 2]), "aten::_histogramdd_bin_edges")]:
        with pytest.raises(NotImplementedError, match=f"^Could not run '{op}' with arguments from the 'CUDA' backend"):
            call(x)
        call(x.cpu())
    assert torch.histc(x, bins=4).device == torch.device("cuda", 0)


def test_as_tensor_and_asarray_copy_to_a_gpu_and_alias_only_where_the_data_is(emu):
    """`torch.as_tensor(array, device="cuda")` owns GPU memory, as on a GPU box: a later write to the array, the host
    tensor or another GPU's tensor leaves it as it was (the values used to be shared). On its own device a GPU tensor
    is returned as it is, and `asarray(..., copy=False)` refuses to cross devices with ATen's ValueError."""
    array, host = numpy.arange(3, dtype=numpy.float32), torch.arange(3.0)
    made = [torch.as_tensor(array, device="cuda"), torch.asarray(array, device="cuda:1"),
            torch.as_tensor(host, device="cuda:2"), torch.asarray(host, device="cuda")]
    gpu = torch.arange(3.0).to("cuda:0")
    made += [torch.as_tensor(gpu, device="cuda:1"), torch.asarray(gpu, device="cuda:2")]
    array[:], gpu[:] = 7, 7
    host.fill_(7)
    assert [t.cpu().tolist() for t in made] == [torch.arange(3.0).tolist()] * 6
    assert [t.device.index for t in made] == [0, 1, 2, 0, 1, 2]
    assert torch.as_tensor(gpu, device="cuda:0") is gpu and torch.asarray(gpu, device="cuda", copy=False) is gpu
    with pytest.raises(ValueError, match=r"^can't alias tensor from device 'cuda:0' to 'cpu'\.$"):
        torch.asarray(gpu, device="cpu", copy=False)
    with pytest.raises(ValueError, match=r"^can't alias tensor from device 'cpu' to 'cuda:1'\.$"):
        torch.asarray(host, device="cuda:1", copy=False)


def test_factories_with_out_write_into_it_and_check_only_the_device_type(emu):
    """`torch.zeros(n, device=..., out=buf)` writes into `buf` where it is; PyTorch's bindings compare only the
    device type with `out`'s. `torch.range`, whose binding skips torch-function modes, makes GPU tensors too, and
    `.cuda("cpu")` is refused as on a GPU box."""
    buf = torch.full((5,), 3.0, device="cuda:1")
    assert torch.zeros(2, 2, device="cuda:0", out=buf) is buf
    assert buf.device == torch.device("cuda", 1) and buf.cpu().tolist() == torch.zeros(2, 2).tolist()
    perm = torch.empty(0, dtype=torch.long, device="cuda")
    torch.randperm(6, device="cuda", out=perm)
    assert sorted(perm.cpu().tolist()) == list(range(6))
    with pytest.raises(RuntimeError, match=r"^device type cpu does not match device type of out parameter \(cuda\)$"):
        torch.ones(2, device="cpu", out=buf)
    with pytest.warns(UserWarning, match="torch.range is deprecated"):
        made = torch.range(0, 3, device="cuda:2")
    assert made.device == torch.device("cuda", 2) and made.cpu().tolist() == torch.arange(4.0).tolist()
    with pytest.raises(RuntimeError, match="^Invalid device, must be cuda device$"):
        torch.tensor(5).cuda("cpu")


def test_factories_shaped_like_a_gpu_tensor_honour_a_host_device_and_type_as_moves(emu):
    """`torch.zeros_like(gpu_x, device="cpu")`, `gpu_x.new_zeros(n, device="cpu")` and `torch.as_tensor(gpu_x,
    device="cpu")` make host tensors (they came out on the GPU), and `x.type_as(y)` takes y's device as well as its
    dtype (ATen's `x.to(y.options())`), as `module.to(y)` does."""
    x = torch.arange(6.0, device="cuda:1").view(2, 3)
    made = [torch.zeros_like(x, device="cpu"), torch.empty_like(x, device=torch.device("cpu")),
            torch.full_like(x, 7.0, device="cpu"), torch.randn_like(x, device="cpu"), x.new_zeros(4, device="cpu"),
            x.new_full((2,), 3.0, device="cpu"), x.new_empty((1, 2), device="meta")]
    assert [str(t.device) for t in made] == ["cpu"] * 6 + ["meta"]
    assert made[2].tolist() == [[7.0] * 3] * 2 and made[0].shape == x.shape
    assert torch.zeros_like(x, device="cuda:2").device == torch.device("cuda", 2)
    for copy in (torch.as_tensor(x, device="cpu"), torch.tensor(x, device=torch.device("cpu")),
                 torch.asarray(x, device="cpu")):
        assert copy.device == torch.device("cpu") and copy.tolist() == x.tolist()
    assert torch.as_tensor(x, dtype=torch.float64).device == x.device  # no device: where it is
    moved = nn.Linear(3, 2).to(x.half())  # Module.to(tensor): the tensor's device and dtype
    assert {(p.device, p.dtype) for p in moved.parameters()} == {(torch.device("cuda", 1), torch.float16)}
    mask = torch.tensor([1, 0, 1]).type_as(x)
    assert (mask.device, mask.dtype) == (torch.device("cuda", 1), torch.float32)
    back = x.type_as(torch.ones(1, dtype=torch.float64))
    assert (back.device, back.dtype) == (torch.device("cpu"), torch.float64)
    assert back.tolist() == x.cpu().double().tolist()


def test_allowed_mixes_zero_dim_cpu_scalars_and_copy_(emu):
    a = torch.ones(3, device="cuda:0")
    assert (a * torch.tensor(2.0)).device.index == 0
    host = torch.zeros(3)
    host.copy_(a)
    torch.testing.assert_close(host, torch.ones(3))
    other = torch.zeros(3, device="cuda:2")
    other.copy_(a * 5)
    assert other.device.index == 2
    torch.testing.assert_close(other.cpu(), torch.full((3,), 5.0))


def _copy_into_a_saved_tensor(device, other):
    """A copy_ from another device into a tensor autograd saved: the version counter moves, backward refuses."""
    x = torch.ones(3, device=device, requires_grad=True)
    y = torch.ones(3, device=device)
    z = x * y
    before = y._version
    y.copy_(torch.zeros(3, device=other))
    try:
        z.sum().backward()
    except RuntimeError as error:
        return y._version - before, "modified by an inplace operation" in str(error)
    return y._version - before, False


def test_copy_across_devices_bumps_the_version_counter_as_on_the_host(emu):
    expected = _copy_into_a_saved_tensor("cpu", "cpu")
    assert expected == (1, True)
    assert _copy_into_a_saved_tensor("cuda:0", "cuda:1") == expected  # silently used the new values before
    assert _copy_into_a_saved_tensor("cuda:0", "cpu") == expected


class _MaxAndIndex(torch.autograd.Function):
    """Two outputs, one non-differentiable: backward gets materialized zeros for the index and for an unused max."""
    seen = []

    @staticmethod
    def forward(ctx, x):
        index = x.argmax().reshape(1)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        return x * 2, x.max().reshape(1), index

    @staticmethod
    def backward(ctx, grad_double, grad_max, grad_index):
        _MaxAndIndex.seen = [(g.device, g.dtype, g.tolist()) for g in (grad_double, grad_max, grad_index)]
        grad = grad_double * 2
        grad[ctx.saved_tensors[0]] += grad_max
        return grad


def _materialized_grads(device):
    x = torch.tensor([1.0, 5.0, 2.0], device=device, requires_grad=True)
    double, _, _ = _MaxAndIndex.apply(x)
    double.sum().backward()
    return x.grad.device, x.grad.tolist(), _MaxAndIndex.seen


def test_a_custom_functions_materialized_zero_grads_are_on_its_outputs_gpu(emu):
    expected_device, expected_grad, expected_seen = _materialized_grads("cpu")
    device, grad, seen = _materialized_grads("cuda:1")
    assert (device, grad) == (torch.device("cuda:1"), expected_grad)
    assert seen == [(torch.device("cuda:1"), dtype, values) for _, dtype, values in expected_seen]  # were on the host


def test_moves_and_copies_across_gpus_record_pytorchs_backward_nodes(emu):
    host = torch.ones(2, requires_grad=True)
    expected = [host.to(torch.float64).grad_fn, torch.zeros(2).copy_(host).grad_fn]  # aten._to_copy, copy_
    x = torch.ones(2, device="cuda:0", requires_grad=True)
    nodes = [x.to("cuda:1").grad_fn, torch.zeros(2, device="cuda:1").copy_(x).grad_fn]
    assert [node.name() for node in nodes] == [node.name() for node in expected]
    assert [type(node).__name__ for node in nodes] == [type(node).__name__ for node in expected]


def _foreach_writes_seen_by_autograd(device):
    """Versions after in-place foreach ops (an optimizer's step), and whether backward then refuses a saved tensor."""
    params = [torch.ones(2, device=device), torch.ones(3, device=device)]
    x = torch.ones(2, device=device, requires_grad=True)
    y = x * params[0]
    torch._foreach_add_(params, [torch.ones(2, device=device), torch.ones(3, device=device)], alpha=-0.1)
    torch._foreach_mul_(params, 2.0)
    versions = [p._version for p in params]
    try:
        y.sum().backward()
    except RuntimeError as error:
        return versions, "modified by an inplace operation" in str(error)
    return versions, False


def test_in_place_foreach_ops_bump_version_counters_as_cudas_kernels(emu):
    expected = _foreach_writes_seen_by_autograd("cpu")
    assert expected == ([2, 2], True)
    assert _foreach_writes_seen_by_autograd("cuda:0") == expected  # backward silently used the stepped values


def _fill_from_a_scalar_tensor(device, other):
    value = torch.tensor(3.0, device=other, requires_grad=True)
    filled = torch.zeros(4, device=device, requires_grad=True).clone()
    filled.fill_(value)
    (filled * torch.arange(4.0, device=device)).sum().backward()
    return filled.tolist(), filled._version, value.grad.item(), value.grad.device == value.device


def test_fill_reads_a_0_dim_value_from_another_gpu_as_aten_does(emu):
    """ATen's fill_(Tensor) takes a value on another device with item(); the emulator refused it as a device mix."""
    assert _fill_from_a_scalar_tensor("cuda:0", "cuda:1") == _fill_from_a_scalar_tensor("cpu", "cpu")


def _hooks_registered_before_a_move(device):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 1))
    seen = []
    net[0].weight.register_hook(lambda grad: seen.append(("hook", grad.device, grad.tolist())) or grad * 2)
    net[0].bias.register_post_accumulate_grad_hook(lambda p: seen.append(("post", p.grad.device, p.grad.tolist())))
    net.to(device)
    net(torch.ones(1, 2, device=device)).sum().backward()
    return seen, net[0].weight.grad.tolist()


def test_tensor_hooks_on_parameters_survive_a_move_to_a_gpu():
    """The emulator converts modules by swapping tensors; hooks a program registered before `.to("cuda")` were lost."""
    expected, grad = _hooks_registered_before_a_move("cpu")  # plain PyTorch, before the emulator starts
    assert len(expected) == 2
    with course.emulate(gpus=4):
        assert _hooks_registered_before_a_move("cpu") == (expected, grad)
        assert _hooks_registered_before_a_move("cuda:1") == (
            [(kind, torch.device("cuda:1"), values) for kind, _, values in expected], grad)


def test_foreach_lists_spanning_devices_run_per_index_as_cudas_slow_path(emu):
    """test_foreach.py's *_tensors_on_different_devices: a list over two GPUs and the host runs index by index."""
    torch.manual_seed(0)
    host = [torch.randn(3), torch.randn(2), torch.randn(4)]
    other = [torch.randn(3), torch.randn(2), torch.randn(4)]
    places = ["cuda:0", "cuda:1", "cpu"]
    on = [t.clone().to(d) for t, d in zip(host, places)]
    launched = len(emu.trace)
    sums = torch._foreach_add(on, [t.to(d) for t, d in zip(other, places)], alpha=2)
    kernels = [(e.name, e.device) for e in emu.trace[launched:] if e.kind == "kernel"]
    assert kernels == [("aten::_foreach_add", "cuda:0"), ("aten::_foreach_add", "cuda:1")]  # one per GPU tensor
    norms = torch._foreach_norm(on)
    assert [s.device for s in sums] == [n.device for n in norms] == [torch.device(d) for d in places]
    for s, n, x, y in zip(sums, norms, host, other):
        torch.testing.assert_close(s.cpu(), x + 2 * y, rtol=0, atol=0)
        torch.testing.assert_close(n.cpu(), torch.linalg.vector_norm(x), rtol=0, atol=0)
    torch._foreach_mul_(on, [1.0, 2.0, 3.0])
    for t, x, k in zip(on, host, [1.0, 2.0, 3.0]):
        torch.testing.assert_close(t.cpu(), x * k, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_add(on[:2], [on[1], on[0]])  # the tensors of one index must share a device, as per-tensor


def test_foreach_copy_and_packed_scalars_cross_devices_as_on_a_gpu(emu):
    """`_foreach_copy_` from another device copies index by index; addcdiv's scalars tensor is read on the host and
    refused on a GPU ("Expected scalars to be on CPU"), as ATen's convert_tensor_to_scalar_list does."""
    destinations = [torch.zeros(3, device="cuda:0"), torch.zeros(2, device="cuda:1")]
    torch._foreach_copy_(destinations, [torch.ones(3), torch.full((2,), 2.0, device="cuda:0")])
    assert [d.device.index for d in destinations] == [0, 1]
    assert [d.cpu().tolist() for d in destinations] == [[1.0] * 3, [2.0] * 2]
    tensors = [torch.ones(3, device="cuda:0"), torch.ones(2, device="cuda:0")]
    numerators = [torch.full((3,), 4.0, device="cuda:0"), torch.full((2,), 4.0, device="cuda:0")]
    denominators = [torch.full((3,), 2.0, device="cuda:0"), torch.full((2,), 8.0, device="cuda:0")]
    torch._foreach_addcdiv_(tensors, numerators, denominators, torch.tensor([0.5, -2.0]))
    assert [t.cpu().tolist() for t in tensors] == [[2.0] * 3, [0.0] * 2]
    with pytest.raises(RuntimeError, match="Expected scalars to be on CPU, got cuda:0 instead."):
        torch._foreach_addcmul(tensors, numerators, denominators, torch.tensor([0.5, 1.0], device="cuda:0"))


def test_foreach_add_refuses_a_host_scalar_tensor_where_cudas_fused_kernel_takes_the_list(emu):
    """test_foreach.py's test_0dim_tensor_overload_exception: `_foreach_add(gpu_tensors, host_scalar, alpha=...)`
    is refused when CUDA's multi-tensor kernel takes the list, and runs on the slow path (a strided view) as there."""
    tensors = [torch.ones(2, 2, device="cuda:1"), torch.ones(2, 2, device="cuda:1")]
    with pytest.raises(RuntimeError, match="scalar tensor expected to be on cuda:1 but is on cpu"):
        torch._foreach_add(tensors, torch.tensor(1.0), alpha=1.0)
    sums = torch._foreach_add([t[:, :1] for t in tensors], torch.tensor(1.5), alpha=2.0)
    assert [s.device.index for s in sums] == [1, 1] and [s.cpu().tolist() for s in sums] == [[[4.0], [4.0]]] * 2
    assert torch._foreach_mul(tensors, torch.tensor(3.0))[0].cpu().tolist() == [[3.0, 3.0]] * 2  # mul reads it
    with pytest.raises(RuntimeError, match="scalar tensor expected to be 0 dim but it has 1 dimensions and 2 elements"):
        torch._foreach_mul([torch.ones(2), tensors[0]], torch.tensor([1.0, 1.0], device="cuda:1"))


def test_foreach_optimizer_refuses_state_left_on_another_gpu_as_its_grouping_does(emu):
    """A model moved to cuda:1 after its optimizer stepped on cuda:0 keeps its state there: PyTorch's grouping before
    the foreach kernels refuses it (C++ saw every emulated tensor as a CPU one and let it through)."""
    model = nn.Linear(3, 2).to("cuda:0")
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)
    model(torch.ones(1, 3, device="cuda:0")).sum().backward()
    optimizer.step()
    model.to("cuda:1")
    model(torch.ones(1, 3, device="cuda:1")).sum().backward()
    with pytest.raises(RuntimeError, match="Tensors of the same index must be on the same device and the same dtype"):
        optimizer.step()
    grouped = torch.utils._foreach_utils._group_tensors_by_device_and_dtype(
        [[torch.ones(2, device="cuda:1")], [torch.tensor(3.0)]])  # a host float `step` may join a GPU's group
    assert list(grouped) == [(torch.device("cuda:1"), torch.float32)]


def test_invalid_device_ordinal(emu):
    with pytest.raises(torch.AcceleratorError, match="CUDA error: invalid device ordinal"):
        torch.zeros(1, device="cuda:4")
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
        torch.zeros(1).to("cuda:9")


def test_cuda_visible_devices_hides_and_renumbers_gpus_as_cuda_does(monkeypatch):
    """CUDA_VISIBLE_DEVICES set by the program (or a launcher) is read at the first question about devices, so after
    the emulator started, and numbers the GPUs it names from 0; workers are told the whole machine and the value the
    emulator started with, which describes the real machine (a cluster's allocation) and so hides nothing; an
    empty list hides every GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with course.emulate(gpus=4, force=True):
        assert torch.cuda.device_count() == 4  # as the emulator found it: the real machine's
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with course.emulate(gpus=4, force=True) as emu:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,1")
        assert (torch.cuda.device_count(), torch.cuda.is_available()) == (3, True)
        assert torch.ones(1, device="cuda:2").device == torch.device("cuda", 2)
        with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
            torch.ones(1, device="cuda:3")
        assert (emu._config()["gpus"], emu._config()["visible_at_start"]) == (4, None)
    for value, count in [("0,7,1", 1), ("1,1", 0), ("", 0)]:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        with course.emulate(gpus=4, force=True):
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
            assert len(torch.cuda._parse_visible_devices()) >= count  # PyTorch's parser, before the machine's cut
            assert (torch.cuda.device_count(), torch.cuda.is_available()) == (count, count > 0)


def test_cuda_visible_devices_keeps_the_machines_topology(monkeypatch):
    """On a machine preset the renumbered GPUs keep their own links: a pair that cannot reach each other directly
    still cannot when CUDA_VISIBLE_DEVICES makes them cuda:0 and cuda:1, and their copy costs the same."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def copy_ms(src, dst):
        x = torch.ones(1 << 20, device=f"cuda:{src}")
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.to(f"cuda:{dst}")
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    with course.emulate(machine="DGX-1V", force=True):
        far = next((a, b) for a in range(8) for b in range(8) if a != b and not torch.cuda.can_device_access_peer(a, b))
        far_ms, near_ms = copy_ms(*far), copy_ms(0, 1)
    assert far_ms != near_ms
    with course.emulate(machine="DGX-1V", force=True):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{far[0]},{far[1]}")
        assert torch.cuda.device_count() == 2 and not torch.cuda.can_device_access_peer(0, 1)
        assert copy_ms(0, 1) == far_ms


class _Tagged(torch.Tensor):
    """A tag kept through ops by PyTorch's default __torch_function__, which this one logs and then calls. Attribute
    reads are left out: a GPU tensor's `.device` is the emulator's Python property, which no handler sees."""
    calls = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func.__name__ != "__get__":
            _Tagged.calls.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


class _Plain(torch.Tensor):
    def doubled(self):
        return self * 2


class _OwnDispatch(torch.Tensor):
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _subclass_uses(device):
    """as_subclass and _make_subclass, ops, autograd and a move to the host, as public code tags tensors."""
    torch.manual_seed(0)
    _Tagged.calls = []
    x = torch.randn(4, 4, device=device, requires_grad=True)
    tagged = x.as_subclass(_Tagged)
    out = (tagged * 2).relu().sum(0)
    out.sum().backward()
    plain = torch.Tensor._make_subclass(_Plain, torch.randn(4, device=device)).doubled() + 1
    return {"types": [type(t).__name__ for t in (tagged, out, plain, plain.cpu(), out.detach().cpu())],
            "isinstance": [isinstance(out, _Tagged), isinstance(plain, _Plain), isinstance(plain.cpu(), _Plain)],
            "devices": [t.device.type for t in (tagged, out, plain, x.grad)], "calls": list(_Tagged.calls),
            "values": [t.detach().cpu() for t in (out, plain, x.grad)],
            "text": repr(plain).replace(", device='cuda:0'", "")}


def test_python_subclasses_of_gpu_tensors_keep_their_type_and_torch_function(emu):
    """`gpu_x.as_subclass(MyTensor)` is an alias of MyTensor's twin on emulated GPUs: MyTensor's type name,
    isinstance, methods and __torch_function__ (the default one keeps the subclass through ops), with the GPU's
    device, values and gradients; on the host, a subclass's __torch_function__ runs as in plain torch (the
    emulator's mode ran the op with it switched off). Compared with plain CPU torch: the same calls, types and
    values. A subclass with its own __torch_dispatch__ is refused by name; a wrapper subclass runs."""
    emu.stop()
    want = _subclass_uses("cpu")
    emu.start()
    for device in ("cpu", "cuda"):
        got = _subclass_uses(device)
        assert got["devices"] == [device] * 4
        assert {k: got[k] for k in ("types", "isinstance", "calls", "text")} == {
            k: want[k] for k in ("types", "isinstance", "calls", "text")}  # `_Plain([...])` printed, as torch prints it
        for mine, theirs in zip(got["values"], want["values"]):
            torch.testing.assert_close(mine, theirs)
    before = len(emu.trace)
    torch.ones(3, device="cuda").as_subclass(_Tagged).exp()
    assert len(emu.trace) > before  # timed on the GPU
    with pytest.raises(course.cuda.cuda_bindings.NotModelledError, match="subclass _OwnDispatch, which has its own"):
        torch.ones(2, device="cuda").as_subclass(_OwnDispatch)

    class Scaled(torch.Tensor):
        @staticmethod
        def __new__(cls, data, scale):
            return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

        def __init__(self, data, scale):
            self.data_, self.scale = data, scale

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda t: t.data_.float() * t.scale if isinstance(t, Scaled) else t  # noqa: E731
            return func(*torch.utils._pytree.tree_map(unwrap, args), **(kwargs or {}))

    q, w = torch.tensor([[2, -4], [6, 8]], dtype=torch.int8, device="cuda"), torch.randn(2, 3, device="cuda")
    out = torch.mm(Scaled(q, 0.5), w)
    assert out.device == torch.device("cuda", 0) and torch.equal(out.cpu(), (q.cpu().float() * 0.5) @ w.cpu())


class _Logged(torch.Tensor):
    """A wrapper subclass with its own __torch_dispatch__ (a LoggingTensor, torchao's tensors), made from the tensor
    it wraps on that tensor's device."""
    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                   device=elem.device, requires_grad=elem.requires_grad)

    def __init__(self, elem):
        self.elem = elem

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, context, size, stride):
        return _Logged(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, _Logged) else t  # noqa: E731
        wrap = lambda t: _Logged(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        tree_map = torch.utils._pytree.tree_map
        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


def _wrapper_uses(device, other):
    torch.manual_seed(0)
    x, weight = torch.randn(3, 4, device=device), _Logged(torch.randn(5, 4, device=device)).requires_grad_()
    out = F.linear(x, weight) + x.sum()  # an emulated tensor first: the wrapper's handler must still run
    moved = weight.to(other) * 2  # a move by its own _to_copy, with the gradient sent back
    (out.sum() + moved.sum().to(device)).backward()
    host_made = _Logged(torch.arange(3.0)).to(device)  # rebuilt around moved tensors (__tensor_flatten__)
    tensors = (out, moved, weight.grad, host_made, moved.cpu())
    return {"types": [type(t).__name__ for t in tensors], "devices": [str(t.device) for t in tensors],
            "inner": [str(t.elem.device) for t in tensors], "values": [t.elem.detach().cpu() for t in tensors]}


def test_wrapper_subclasses_with_their_own_dispatch_run_on_gpus(emu):
    """A program's `_make_wrapper_subclass` tensor made on an emulated GPU is made on the host and says which GPU it
    is on, as the emulator's own are: PyTorch made a C++ CUDA tensor, and the first gradient stopped the process
    (no CUDA device guard). Its handler runs before the emulator's, even when a GPU tensor comes first; moves go
    through its own `_to_copy`, whose `device=` the emulator now honours below the torch API (it gave a host tensor
    that said cuda:0), and gradients go back to where the wrapper was. Compared with plain CPU torch."""
    emu.stop()
    want = _wrapper_uses("cpu", "cpu")
    emu.start()
    got = _wrapper_uses("cuda:0", "cuda:1")
    assert got["types"] == want["types"] == ["_Logged"] * 5
    assert got["devices"] == got["inner"] == ["cuda:0", "cuda:1", "cuda:0", "cuda:0", "cpu"]
    for mine, theirs in zip(got["values"], want["values"]):
        torch.testing.assert_close(mine, theirs)
    on_gpu = torch.ones(2, device="cuda:1")
    with torch._C.DisableTorchFunction():  # as a dispatch mode or a subclass's handler calls it
        assert torch.ops.aten._to_copy.default(on_gpu, device=torch.device("cuda", 0)).device == torch.device("cuda", 0)

    class Unlisted(_Logged):
        __tensor_flatten__ = None
    with pytest.raises(course.cuda.cuda_bindings.NotModelledError, match="Moving a Unlisted .* from the host"):
        Unlisted(torch.ones(2)).cuda()


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.__name__.split(".")[0], out.device.type if isinstance(out, torch.Tensor) else None))
        return out


class _Biased(torch.Tensor):
    """A handler that makes a tensor on its input's device, as low-precision libraries' handlers do."""
    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _Biased(func(*[a.elem for a in args]) + torch.ones(args[0].shape, device=args[0].elem.device))


def _mode_uses(device):
    torch.manual_seed(0)
    with _OpLog() as log:
        made = [torch.zeros(3, device=device), torch.randn(4, device=device), torch.arange(3.0).to(device)]
        made.append((made[1] * 2).cpu())
    made.append((_Biased(torch.arange(2.0, device=device)) + _Biased(torch.ones(2, device=device))).elem)
    return log.ops, made


def test_dispatch_modes_see_factories_and_moves_as_on_a_gpu(emu):
    """A program's TorchDispatchMode sees `aten.zeros` or `aten._to_copy` with GPU tensors out, as on a GPU box, where
    it saw the emulator's own steps (a shape-only probe, the host factory, a detach) with host tensors out. A handler
    that makes a tensor on its input's GPU gets one (it stopped in torch.cuda's lazy init). Values as plain CPU's."""
    emu.stop()
    want_ops, want = _mode_uses("cpu")
    emu.start()
    ops, got = _mode_uses("cuda:1")
    assert want_ops == [("zeros", "cpu"), ("randn", "cpu"), ("arange", "cpu"), ("mul", "cpu")]  # no copies
    assert ops == [("zeros", "cuda"), ("randn", "cuda"), ("arange", "cpu"), ("_to_copy", "cuda"), ("mul", "cuda"),
                   ("_to_copy", "cpu")]
    assert [str(t.device) for t in got] == ["cuda:1"] * 3 + ["cpu", "cuda:1"]
    for mine, theirs in zip(got, want):
        assert torch.equal(mine.cpu(), theirs)


def test_numpy_needs_cpu_first_like_on_a_gpu(emu):
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu()"):
        torch.ones(2, device="cuda:0").numpy()
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):  # np.asarray, plt.plot
        numpy.asarray(torch.ones(2, device="cuda:0"))
    assert torch.ones(2, device="cuda:0").cpu().numpy().tolist() == [1.0, 1.0]
    assert numpy.asarray(torch.ones(2, device="cuda:0").cpu(), dtype=numpy.float64).dtype == numpy.float64
    assert torch.ones(2, device="cuda:0").tolist() == [1.0, 1.0]
    host = torch.tensor([1 + 2j, 3 - 1j]).conj()  # force=True is `t.detach().cpu().resolve_conj().resolve_neg()`
    numpy.testing.assert_array_equal(host.cuda().requires_grad_(False).numpy(force=True), host.numpy(force=True))
    weights = torch.arange(3.0, requires_grad=True)
    numpy.testing.assert_array_equal((weights.cuda() * 2).numpy(force=True), (weights * 2).numpy(force=True))


def test_outside_the_block_torch_is_untouched():
    with course.emulate(gpus=2):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        escaped = torch.ones(2, device="cuda:0")
    assert not torch.cuda.is_available()
    assert torch.cuda.device_count() == 0
    with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
        torch.zeros(1, device="cuda:0")
    with pytest.raises(RuntimeError, match=r"no `with course.emulate\(...\)` block is active"):
        escaped + 1
    assert not torch.__future__.get_swap_module_params_on_conversion()


def test_start_and_stop_span_notebook_cells():
    emulator = course.emulate(gpus=2).start()
    try:
        assert torch.ones(1, device="cuda:1").device.index == 1
        with pytest.raises(RuntimeError, match="already started"):
            emulator.start()
        with course.emulate(gpus=3, gpu="H100") as inner:
            assert torch.cuda.device_count() == 3 and torch.cuda.get_device_name() == inner.gpu.name
        assert torch.cuda.device_count() == 2  # the outer machine is back
        assert torch.ones(1, device="cuda:1").device.index == 1
    finally:
        emulator.stop()
    assert not torch.cuda.is_available()


def test_steps_aside_when_torch_sees_real_gpus(monkeypatch):
    # No GPU is lent to this project: only the decision is tested here, by answering as a CUDA build would.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert course.emulate(gpus=4).mode == "real"
    forced = course.emulate(gpus=4, force=True)
    assert forced.mode == "emulated" and forced.num_gpus == 4


def test_unsupported_torch_cuda_calls_name_the_emulator(emu):
    with pytest.raises(RuntimeError, match="torch.cuda.current_blas_handle is not modelled by the GPU emulator"):
        torch.cuda.current_blas_handle()


def test_seed_000_sharded_matmul_runs_unchanged():
    """The forum snippet of seed 000, indentation restored, gradients added."""
    torch.manual_seed(0)
    with course.emulate(gpus=4):
        ngpu = torch.cuda.device_count()
        N, M, K = 128, 256, 512  # example matmul sizes
        A = []
        B = torch.randn(M, K, device='cuda:0', requires_grad=True)
        for i in range(ngpu):
            A.append(torch.randn(N // ngpu, M, device='cuda:' + str(i), requires_grad=True))
        B_ = [B]
        for i in range(ngpu):
            if i != 0:
                B_.append(B.to('cuda:' + str(i)))
        C_ = []
        for i in range(ngpu):
            C_.append(torch.matmul(A[i], B_[i]))
        C = torch.empty(N, K)
        for i in range(ngpu):
            start_index = i * (N // ngpu)
            C[start_index:start_index + (N // ngpu), :].copy_(C_[i])

        A_cpu = torch.cat([a.detach().cpu() for a in A]).requires_grad_()
        B_cpu = B.detach().cpu().requires_grad_()
        expected = A_cpu @ B_cpu
        torch.testing.assert_close(C, expected)
        upstream = torch.randn(N, K)
        (C * upstream).sum().backward()
        (expected * upstream).sum().backward()
        assert B.grad.device.index == 0 and A[3].grad.device.index == 3
        torch.testing.assert_close(B.grad.cpu(), B_cpu.grad)
        torch.testing.assert_close(torch.cat([a.grad.cpu() for a in A]), A_cpu.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex128])
def test_convolutions_return_the_memory_format_cudnn_gives(emu, dtype):
    """cuDNN runs a channels-last image or weight channels-last, forward and backward, except in double precision,
    where its NHWC path is off (ConvUtils.h, `cudnn_conv_suggest_memory_format`): a float64 conv of channels-last
    tensors returns channels-first results on a GPU (test_modules' test_memory_format expects that failure on cuda for
    Conv2d float64), where the CPU kernels returned channels-last. The values stay the CPU's."""
    for make, shape, layout in ((nn.Conv2d, (2, 3, 6, 6), torch.channels_last),
                                (nn.ConvTranspose2d, (2, 3, 6, 6), torch.channels_last),
                                (nn.Conv3d, (2, 3, 4, 4, 4), torch.channels_last_3d)):
        torch.manual_seed(0)
        host = make(3, 4, 3).to(dtype).to(memory_format=layout)
        x = torch.randn(shape, dtype=dtype).contiguous(memory_format=layout)
        want = host(x), torch.autograd.grad(host(x.requires_grad_()).abs().sum(), (x, host.weight))
        gpu = copy.deepcopy(host).cuda()
        xg = x.detach().cuda().contiguous(memory_format=layout).requires_grad_()
        out = gpu(xg)
        grads = torch.autograd.grad(gpu(xg).abs().sum(), (xg, gpu.weight))
        double = dtype in (torch.float64, torch.complex128)
        for got in (out, *grads):
            assert got.is_contiguous(memory_format=layout) != double and got.is_contiguous() == double
        torch.testing.assert_close((out.cpu(), [g.cpu() for g in grads]), (want[0], list(want[1])))
        plain = gpu.to(memory_format=torch.contiguous_format)(xg.detach().contiguous())
        assert plain.is_contiguous()


def test_rnns_refuse_what_cudnn_refuses(emu):
    """cuDNN's RNN (which a GPU runs for float16/32/64 with cuDNN on) refuses a non-contiguous hidden state and a
    backward through an RNN run in eval mode; the CPU's RNN, which computes here, ran both. With cuDNN switched off,
    or in training mode, the values and gradients are the CPU's."""
    torch.manual_seed(0)
    host = nn.GRU(4, 3, num_layers=2, bidirectional=True)
    x, h = torch.randn(5, 2, 4), torch.randn(2, 4, 3).transpose(0, 1)
    gpu = copy.deepcopy(host).cuda()
    with pytest.raises(RuntimeError, match="rnn: hx is not contiguous"):
        gpu(x.cuda(), h.cuda())
    with torch.backends.cudnn.flags(enabled=False):
        torch.testing.assert_close(gpu(x.cuda(), h.cuda())[0].cpu(), host(x, h)[0])
    lstm = nn.LSTM(4, 3)
    on_gpu = copy.deepcopy(lstm).cuda()
    with pytest.raises(RuntimeError, match="cudnn RNN backward can only be called in training mode"):
        on_gpu.eval()(x.cuda())[0].sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(on_gpu(x.cuda())[0].cpu(), lstm.eval()(x)[0])
    lstm.train()(x)[0].sum().backward()
    on_gpu.zero_grad()
    on_gpu.train()(x.cuda())[0].sum().backward()
    torch.testing.assert_close([p.grad.cpu() for p in on_gpu.parameters()], [p.grad for p in lstm.parameters()])


def test_rnns_name_the_tensor_on_another_device_as_check_attributes_does(emu):
    """A batch left on the host, a model left on the host, an initial state made without `device=`: RNN.h's
    check_attributes words each (the CPU's kernel said only "Expected all tensors to be on the same device")."""
    x, h = torch.randn(3, 2, 4), torch.zeros(1, 2, 5)
    cases = [(nn.LSTM(4, 5).cuda(), x, None, "parameter tensors are not at the same device, found input tensor at "
              "cpu and parameter tensor at cuda:0"),
             (nn.GRU(4, 5), x.cuda(), None, "found input tensor at cuda:0 and parameter tensor at cpu"),
             (nn.GRU(4, 5).cuda(), x.cuda(), h, "Input and hidden tensors are not at the same device, found input "
              "tensor at cuda:0 and hidden tensor at cpu"),
             (nn.RNN(4, 5).to("cuda:1"), x.cuda(), None, "found input tensor at cuda:0 and parameter tensor at cuda:1")]
    for model, batch, state, words in cases:
        with pytest.raises(RuntimeError, match=words):
            model(batch, state)
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5)
    torch.testing.assert_close(copy.deepcopy(lstm).cuda()(x.cuda())[0].cpu(), lstm(x)[0])


def test_a_module_already_on_its_gpu_converts_nothing_in_its_forward(emu):
    """`self.cuda()` or `self.to(device)` inside a forward, on a model already there: on a GPU `param.data = param`
    changes nothing; a swap here poisoned the gradients the forward's graph was to accumulate."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x):
            h = self.a(x)
            self.to(x.device)
            return self.b(h.to(x.device))

    torch.manual_seed(0)
    host = Net()
    gpu = copy.deepcopy(host).cuda()
    weight = gpu.a.weight
    x = torch.randn(2, 3)
    host(x).sum().backward()
    gpu(x.cuda()).sum().backward()
    assert gpu.a.weight is weight and gpu.a.weight.device == torch.device("cuda:0")
    torch.testing.assert_close([p.grad.cpu() for p in gpu.parameters()], [p.grad for p in host.parameters()])
    assert gpu.half().a.weight.dtype == torch.float16 and gpu.to("cuda:1").b.bias.device == torch.device("cuda:1")


def test_out_of_range_labels_and_indices_trip_a_device_side_assert(emu):
    """A label past the classifier's width, a token past the embedding table, a gather, scatter or fancy index out of
    range, probabilities below 0: CUDA's kernels assert on the device ("CUDA error: device-side assert triggered",
    an AcceleratorError), where the CPU raised IndexError or RuntimeError in its own words. `F.one_hot` took a tensor
    subclass's path, which checks nothing, and gave a row of zeros. Host-side checks keep their errors."""
    torch.manual_seed(0)
    logits, table = torch.randn(4, 3), torch.randn(10, 2)
    labels, tokens = torch.tensor([0, 2, 1, 2]), torch.tensor([9, 0])
    on = lambda t: t.to("cuda:1")  # noqa: E731
    cases = [lambda: F.cross_entropy(on(logits), on(labels) + 1), lambda: F.embedding(on(tokens) + 1, on(table)),
             lambda: on(table)[on(tokens) + 1], lambda: on(logits).gather(1, on(labels)[:, None] + 1),
             lambda: torch.zeros(3, device="cuda").scatter_(0, on(tokens)[:1].cuda(), 1.0),
             lambda: F.one_hot(on(labels) + 1, 3), lambda: F.one_hot(on(labels) - 1),
             lambda: torch.multinomial(on(logits)[0], 1)]
    for case in cases:
        with pytest.raises(torch.AcceleratorError, match="CUDA error: device-side assert triggered"):
            case()
    with pytest.raises(IndexError, match="index 10 is out of bounds for dimension 0 with size 10"):
        on(table)[10]
    torch.testing.assert_close(F.cross_entropy(on(logits), on(labels)).cpu(), F.cross_entropy(logits, labels))
    torch.testing.assert_close(F.one_hot(on(labels)).cpu(), F.one_hot(labels))
    torch.testing.assert_close(F.embedding(on(tokens), on(table)).cpu(), F.embedding(tokens, table))


def test_layer_norm_of_mixed_dtypes_stops_as_cudas_kernel_does(emu):
    """CUDA's LayerNorm reads its weight and bias as the input's type: a float LayerNorm given half or bfloat16
    activations (or a `.half()` one given float) raises, where the CPU's mixed-type kernel computed. Under autocast
    both sides are float, and the values are the CPU's."""
    torch.manual_seed(0)
    norm, x = nn.LayerNorm(8), torch.randn(4, 8)
    on_gpu = copy.deepcopy(norm).cuda()
    for module, batch, words in ((on_gpu, x.cuda().half(), "expected scalar type Half but found Float"),
                                 (on_gpu, x.cuda().bfloat16(), "expected scalar type BFloat16 but found Float"),
                                 (copy.deepcopy(on_gpu).half(), x.cuda(), "expected scalar type Float but found Half")):
        with pytest.raises(RuntimeError, match=words):
            module(batch)
    with torch.autocast("cuda", dtype=torch.float16):
        out = on_gpu(x.cuda().half())
    torch.testing.assert_close(out.cpu(), norm(x.half().float()))


def test_batch_norm_of_mixed_dtypes_stops_where_cuda_does(emu):
    """BatchNorm with parameters of another dtype than its input. The emulator computed every mix in float; a GPU
    takes only its input's dtype or the input's accumulate type (float) for the weight (Normalization.cpp's
    `_select_batch_norm_backend` picks cuDNN, whose `cudnn_batch_norm` checks the types; cuda/Normalization.cuh's
    accessors and `const_data_ptr` check the rest), and the CPU, which also refuses these, says "mixed dtype (CPU)".
    Half activations into a float BatchNorm (autocast's case), half running statistics without affine parameters,
    and a strided input (a TensorIterator casts it) run, with plain CPU torch's values in float."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, 5, generator=gen)
    refused = [(nn.BatchNorm2d(3).half(), x, "Expected tensor for argument #1 'input' to have the same type as tensor "
                "for argument #2 'weight'; but type torch.cuda.FloatTensor does not equal torch.cuda.HalfTensor"),
               (nn.BatchNorm2d(3).bfloat16(), x, "Expected weight to have type Float but got BFloat16"),
               (nn.BatchNorm1d(3).half(), x[:, :, 0, 0], "expected scalar type Float but found Half"),
               (nn.BatchNorm2d(3).bfloat16(), x.half(), "Expected weight to have type Float but got BFloat16")]
    for module, batch, words in refused:
        with pytest.raises(RuntimeError, match=re.escape(words)):
            module.cuda()(batch.cuda())
    norm = nn.BatchNorm2d(3)
    torch.testing.assert_close(copy.deepcopy(norm).cuda()(x.half().cuda()).cpu(), norm(x.half()))
    plain = nn.BatchNorm2d(3, affine=False)
    on_gpu = copy.deepcopy(plain).half().cuda()
    torch.testing.assert_close(on_gpu(x.cuda()).cpu(), plain(x))
    torch.testing.assert_close(on_gpu.running_var.cpu(), plain.running_var.half())
    strided = x.transpose(2, 3)
    torch.testing.assert_close(nn.BatchNorm2d(3).bfloat16().eval().cuda()(strided.cuda()).cpu(),
                               nn.BatchNorm2d(3).eval()(strided))


def test_group_norm_of_half_activations_and_float_parameters_stops_as_cudas_kernel_does(emu):
    """A float GroupNorm given half or bfloat16 activations: group_norm.cpp's mixed-type check lets it through with
    float statistics, which CUDA's kernel writes as the input's type (group_norm_kernel.cu) and stops; the CPU's
    mixed-type kernel computed. Under autocast (group_norm runs in float) and in one dtype it runs with the CPU's
    values."""
    torch.manual_seed(0)
    norm, x = nn.GroupNorm(2, 4), torch.randn(3, 4, 5)
    on_gpu = copy.deepcopy(norm).cuda()
    for half, name in ((torch.float16, "Half"), (torch.bfloat16, "BFloat16")):
        with pytest.raises(RuntimeError, match=f"expected scalar type {name} but found Float"):
            on_gpu(x.to(half).cuda())
        norm(x.to(half))  # the CPU computes it
        torch.testing.assert_close(copy.deepcopy(on_gpu).to(half)(x.to(half).cuda()).cpu(),
                                   copy.deepcopy(norm).to(half)(x.to(half)))
        with torch.autocast("cuda", dtype=half):
            out = on_gpu(x.to(half).cuda())
        torch.testing.assert_close(out.cpu(), norm(x.to(half).float()))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_wide_unsigned_and_float8_ops_cuda_lacks_raise_cudas_error(emu):
    """uint16, uint32 and uint64 on a GPU: CUDA's mul and bitwise kernels (BinaryMulKernel.cu,
    BinaryBitwiseOpsKernels.cu) list no unsigned type wider than a byte, where the CPU's add AT_BAREBONES_UNSIGNED_TYPES
    and computed; nor does CUDA's abs list float8 (AbsKernel.cu), so `torch.isfinite` of a float8_e5m2 tensor stops
    too. Comparisons, copies, concatenation, sums and float8 `where`, whose CUDA kernels take them, still run as on the
    CPU. The dispatch error names c10's types (a complex32 matrix product's is 'ComplexHalf')."""
    for dtype, name in ((torch.uint16, "UInt16"), (torch.uint32, "UInt32"), (torch.uint64, "UInt64")):
        a, b = torch.tensor([1, 5, 3], dtype=dtype), torch.tensor([2, 2, 9], dtype=dtype)
        for call, kernel in ((torch.mul, "mul_cuda"), (torch.bitwise_and, "bitwise_and_cuda"),
                             (torch.bitwise_or, "bitwise_or_cuda"), (torch.bitwise_xor, "bitwise_xor_cuda")):
            with pytest.raises(NotImplementedError, match=f'"{kernel}" not implemented for \'{name}\''):
                call(a.cuda(), b.cuda())
            call(a, b)  # the host's kernels are untouched
        for call in (torch.eq, lambda p, q: torch.cat([p, q]), lambda p, q: p.sum() + q.float().sum()):
            assert torch.equal(call(a.cuda(), b.cuda()).cpu(), call(a, b))
    f8 = torch.tensor([0.5, -2.0, float("inf")]).to(torch.float8_e5m2)
    for call in (torch.abs, torch.isfinite):
        with pytest.raises(NotImplementedError, match="\"abs_cuda\" not implemented for 'Float8_e5m2'"):
            call(f8.cuda())
        call(f8)
    mask, zeros = torch.tensor([True, False, True]), torch.zeros(3, dtype=torch.float8_e5m2)
    kept = torch.where(mask.cuda(), f8.cuda(), zeros.cuda())
    assert torch.equal(kept.cpu().view(torch.uint8), torch.where(mask, f8, zeros).view(torch.uint8))
    c = torch.randn(2, 2, dtype=torch.complex64).to(torch.complex32).cuda()
    with pytest.raises(NotImplementedError, match="\"addmm_cuda\" not implemented for 'ComplexHalf'"):
        c @ c


def test_half_products_multiply_in_float_as_cudas_reduction_does(emu):
    """`prod` of half and bfloat16 tensors: CUDA's reduction multiplies in float and rounds once
    (ReduceSumProdKernel.cu's reduce_dispatch), the CPU's rounds after every factor (bfloat16 100 factors near 1:
    1.609 on the CPU, 1.688 on a GPU); a `dtype=` computes in that dtype on both."""
    x = torch.rand(100, generator=torch.Generator().manual_seed(0)) * 0.01 + 1
    for half in (torch.float16, torch.bfloat16):
        h = x.to(half)
        assert torch.equal(h.cuda().prod().cpu(), h.float().prod().to(half))
        assert torch.equal(h.view(4, 25).cuda().prod(1).cpu(), h.view(4, 25).float().prod(1).to(half))
        assert torch.equal(h.cuda().prod(dtype=torch.float32).cpu(), h.prod(dtype=torch.float32))


def _lazy_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.Flatten(), nn.LazyLinear(5))


def _lazy_run(net, device):
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(2)
    out = net(x)
    out.sum().backward()
    return out.detach().cpu(), [p.grad.cpu() for p in net.parameters()], {k: v.cpu() for k, v in net.state_dict().items()}


def test_lazy_modules_move_and_materialize_on_gpus_as_on_the_cpu(emu):
    """A lazy module moved before its first forward (`.to("cuda:1")`, `.cuda()`, factory `device="cuda"`) keeps
    uninitialized parameters on the GPU, and its first forward materializes them there, with plain CPU torch's values
    and gradients. `.to()` read the uninitialized parameter's size (a ValueError), a factory-made one materialized into
    a class without the emulator's dispatch (an internal assert), and the forced module swap made `.double()` of a CPU
    lazy module empty initialized parameters."""
    emu.stop()
    want = _lazy_run(_lazy_net(), "cpu")
    emu.start()
    for net, device in ((_lazy_net().to("cuda:1"), "cuda:1"), (_lazy_net().cuda(), "cuda:0")):
        assert all(isinstance(p, nn.UninitializedParameter) for p in net.parameters())
        assert {p.device for p in (*net.parameters(), *net.buffers())} == {torch.device(device)}
        got = _lazy_run(net, device)
        assert not any(nn.parameter.is_lazy(p) for p in net.parameters())
        assert all(isinstance(p, nn.Parameter) and p.device == torch.device(device) for p in net.parameters())
        torch.testing.assert_close(got, want)
    factory = nn.LazyLinear(3, device="cuda", dtype=torch.float64)
    assert nn.parameter.is_lazy(factory.weight) and factory.weight.device.type == "cuda"
    out = factory(torch.ones(2, 4, device="cuda", dtype=torch.float64))
    assert out.device.type == "cuda" and out.dtype == torch.float64 and factory.weight.shape == (3, 4)
    assert isinstance(factory.weight, nn.Parameter) and any(p is factory.weight for p in factory.parameters())
    host = nn.LazyLinear(3).double()
    assert nn.parameter.is_lazy(host.weight) and host(torch.ones(2, 4, dtype=torch.float64)).shape == (2, 3)


def test_to_empty_from_meta_unties_shared_weights_as_pytorch_does():
    """`to_empty` of a meta-initialized model gives each module a new Parameter (meta and GPU tensors are not
    shallow-copy compatible), so a tied embedding and head are two weights after it, as plain CPU torch's
    `to_empty(device="cpu")` leaves them; the emulator's forced swap kept them one. A program that asks for swaps
    itself keeps them tied in PyTorch too; a non-meta model moved to a GPU keeps its tie."""
    def tied(device):
        with torch.device("meta"):
            net = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False), nn.Linear(7, 7))
        net[1].weight = net[0].weight
        net.to_empty(device=device)
        return net[1].weight is net[0].weight, len(list(net.parameters())), {p.device for p in net.parameters()}

    want = tied("cpu")
    with course.emulate(gpus=1):
        assert want[:2] == (False, 4) and tied("cuda")[:2] == want[:2] and tied("cuda")[2] == {torch.device("cuda", 0)}
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            assert tied("cuda")[:2] == (True, 3)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        host = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
        host[1].weight = host[0].weight
        assert host.cuda()[1].weight is host[0].weight


def test_models_converted_in_threads_at_once_leave_module_swapping_off():
    """Rank threads convert their models at the same time; the swap flag `.to()` turns on must be off after all."""
    def convert():
        for _ in range(200):
            torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)]).double()

    with course.emulate(gpus=2):
        threads = [threading.Thread(target=convert) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not torch.__future__.get_swap_module_params_on_conversion()


@pytest.mark.parametrize("op", [lambda t: t.transpose_(0, 1), lambda t: t.t_(), lambda t: t.unsqueeze_(1),
                                lambda t: t[:, :1].squeeze_(1), lambda t: t.as_strided_((2, 2), (1, 4), 1),
                                lambda t: t.swapdims_(0, 1)])
def test_in_place_views_change_the_shape_pytorch_sees(emu, op):
    """`transpose_` and the like reshape the tensor itself: the emulated tensor kept its old shape and strides over
    the new values (a silent wrong `.shape`, and torch.func.grad of `vector @ matrix` failed)."""
    expected = op(torch.arange(12.0).view(3, 4))
    got = op(torch.arange(12.0, device="cuda:1").view(3, 4))
    assert got.device == torch.device("cuda", 1)
    assert (got.shape, got.stride(), got.storage_offset()) == (expected.shape, expected.stride(),
                                                                expected.storage_offset())
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(got.contiguous().view(-1).cpu(), expected.contiguous().view(-1))


def test_tensors_an_op_writes_and_resizes_take_their_new_shape(emu):
    """A per-channel QAT FakeQuantize (`_fused_moving_avg_obs_fq_helper`) grows its observer's empty min/max and its
    one-element scale and zero point to one per channel, without returning them: the emulated buffers kept their old
    shapes over the new values (scale.shape (1,), and `convert` found min inf and max -inf)."""
    import torch.ao.quantization as tq
    weight = torch.randn(4, 3)
    fakes = [tq.FusedMovingAvgObsFakeQuantize(observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                              quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
             for _ in range(2)]
    out = fakes[0].cuda(1)(weight.cuda(1))
    torch.testing.assert_close(out.cpu(), fakes[1](weight))
    for name in ("scale", "zero_point", "activation_post_process.min_val", "activation_post_process.max_val"):
        got, want = fakes[0].get_buffer(name), fakes[1].get_buffer(name)
        assert got.shape == want.shape == (4,) and got.device == torch.device("cuda", 1)
        torch.testing.assert_close(got.cpu(), want)


def test_per_sample_gradients_of_a_vector_matrix_product(emu):
    """matmul of a vector by a matrix squeezes its result in place; under torch.func.grad and vmap the wrong shape
    raised "returned an invalid gradient"."""
    weight, xs = torch.randn(3, 2), torch.randn(4, 3)
    per_sample = torch.func.vmap(torch.func.grad(lambda w, x: (x @ w).tanh().sum()), in_dims=(None, 0))
    torch.testing.assert_close(per_sample(weight.cuda(), xs.cuda()).cpu(), per_sample(weight, xs))


@pytest.mark.parametrize("op", [lambda a, out: torch.matmul(a, a.T, out=out), lambda a, out: torch.add(a, 1, out=out),
                                lambda a, out: torch.sum(a, 0, out=out), lambda a, out: torch.cat([a, a], out=out),
                                lambda a, out: torch.sort(a.flatten(), out=(out, torch.empty(0, dtype=torch.long,
                                                                                             device=a.device)))[0]])
def test_out_tensors_take_the_shape_the_op_resizes_them_to(emu, op):
    """An out= tensor of another shape is resized by the op: the emulated tensor kept its old shape over the new
    values (`torch.matmul(a, b, out=torch.empty(0))` reported shape (0,))."""
    a = torch.arange(6.0).view(2, 3)
    expected = op(a, torch.empty(5))
    got = op(a.to("cuda:2"), torch.empty(5, device="cuda:2"))
    assert (got.shape, got.stride()) == (expected.shape, expected.stride())
    torch.testing.assert_close(got.cpu(), expected)


@pytest.mark.parametrize("shape", [(0, 0), (3, 0), (2, 0, 0)])
def test_rank_and_condition_number_of_empty_matrices_stay_on_the_gpu(emu, shape):
    """For an empty matrix linalg_matrix_rank and linalg_cond return `at::zeros(shape, input.options())` without an op;
    on a CPU build those options name the host, on a GPU the result is a GPU tensor."""
    matrix = torch.zeros(shape, device="cuda:2")
    for result, expected in ((torch.linalg.matrix_rank(matrix), torch.linalg.matrix_rank(torch.zeros(shape))),
                             (torch.linalg.matrix_rank(matrix, hermitian=True, atol=0.5),
                              torch.linalg.matrix_rank(torch.zeros(shape), hermitian=True, atol=0.5))):
        assert result.device == torch.device("cuda", 2)
        assert torch.equal(result.cpu(), expected)
    if shape[-1] == shape[-2]:
        condition = torch.linalg.cond(matrix)
        assert condition.device == torch.device("cuda", 2)
        assert torch.equal(condition.cpu(), torch.linalg.cond(torch.zeros(shape)))


def test_parameters_print_as_parameters():
    """nn.Parameter keeps the emulator's tensor class; printed, a GPU parameter still starts with PyTorch's
    "Parameter containing:" line, and tensors derived from it (.data, detach, clone) do not."""
    def shown(device):
        torch.manual_seed(0)
        layer = nn.Linear(2, 2).to(device)
        frozen = nn.Parameter(torch.ones(2, device=device), requires_grad=False)
        texts = [repr(layer.weight), str(layer.bias), f"{frozen}", repr(copy.deepcopy(layer).bias),
                 repr(layer.weight.data), repr(layer.bias.detach()), repr(layer.bias.clone())]
        return [text.replace(", device='cuda:0'", "") for text in texts]
    plain = shown("cpu")
    with course.emulate(gpus=1):
        assert shown("cuda") == plain


def test_printed_dtypes_follow_pytorchs_rule():
    """A CUDA tensor prints like a CPU one plus its device: int64, bool and the default complex dtype are implied
    by the values shown, but an empty tensor names any dtype but the default."""
    cases = [lambda d: torch.empty(0, dtype=torch.int64, device=d), lambda d: torch.empty(2, 0, device=d),
             lambda d: torch.ones(2, dtype=torch.cfloat, device=d), lambda d: torch.ones(2, dtype=torch.cdouble, device=d),
             lambda d: torch.ones(2, dtype=torch.half, device=d), lambda d: torch.arange(3, device=d),
             lambda d: torch.empty(0, dtype=torch.bool, device=d)]
    plain = [repr(make("cpu")) for make in cases]
    with course.emulate(gpus=1):
        emulated = [repr(make("cuda")) for make in cases]
    assert [e.replace(", device='cuda:0'", "") for e in emulated] == plain
    assert all("device='cuda:0'" in e for e in emulated)


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions")  # their deprecation
def test_quantized_empty_factories_make_gpu_tensors_with_the_cpus_layout(emu):
    kwargs = dict(scale=2, zero_point=3, dtype=torch.quint8)
    host = torch._empty_affine_quantized([5, 4], **kwargs)
    q = torch._empty_affine_quantized([5, 4], device="cuda:1", **kwargs)
    assert q.device == torch.device("cuda", 1) and q.is_quantized
    assert (q.q_scale(), q.q_zero_point(), q.shape, q.stride()) == (2, 3, host.shape, host.stride())
    flat = q.ravel()
    assert flat._base is q and flat.is_contiguous()
    assert flat.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    copied = q.t().ravel()
    assert copied._base is not q and copied.is_contiguous() and copied.shape == (20,)


def test_index_put_takes_host_indices_but_not_host_values(emu):
    idx, values = torch.tensor([0, 3]), torch.tensor([1.0, 2.0])
    want = torch.zeros(5).index_put_((idx,), values, accumulate=True)
    x = torch.zeros(5, device="cuda:1")
    x[idx] = values.to("cuda:1")
    x[idx] += torch.tensor(0.0)  # a 0-dim host tensor joins any device
    torch.testing.assert_close(x.cpu(), want)
    with pytest.raises(RuntimeError, match="expected device cuda:1 but got device cpu for value tensor"):
        x.index_put_((idx,), values, accumulate=True)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x[idx] = values


def test_index_put_backward_gives_cpu_torchs_gradients(emu):
    """`out.index_put((rows,), values)` differentiates through zeros the autograd engine makes for the values (MoE
    dispatch code): PyTorch's own host stand-ins, not a program's host values."""
    def grads(device):
        torch.manual_seed(0)
        routed = torch.randn(6, 3, requires_grad=True)
        moved = routed.to(device)
        out = torch.zeros_like(moved)
        for rows in ([0, 2], [5]):  # the second put's backward zeroes the first's rows in its gradient
            rows = torch.tensor(rows, device=device)
            out = out.index_put((rows,), moved[rows] * 2)
        (out * torch.arange(3.0, device=device)).sum().backward()
        return routed.grad
    torch.testing.assert_close(grads("cuda:1"), grads("cpu"), rtol=0, atol=0)


def _scalar_parameter_grads(device):
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(-1.0))
    x = torch.randn(4, 3).to(device)
    for _ in range(2):
        (x * a + b).pow(2).sum().backward()
    return a.grad, b.grad, torch.autograd.grad((x * a).sum(), a)[0]


def test_a_host_scalar_parameter_gets_its_gradient_on_the_host(emu):
    for got, want in zip(_scalar_parameter_grads("cuda:2"), _scalar_parameter_grads("cpu")):
        assert got.device.type == "cpu"
        torch.testing.assert_close(got, want)


def test_grad_assignment_refuses_a_gradient_on_another_device(emu):
    x = torch.zeros(3, device="cuda:0")
    with pytest.raises(RuntimeError, match="with device type 'cuda' to a tensor with device type 'cpu'"):
        torch.zeros(3).grad = torch.ones(3, device="cuda:0")
    with pytest.raises(RuntimeError, match="with device type 'cpu' to a tensor with device type 'cuda'"):
        x.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="located on device with index '1' to a tensor located on device with index"):
        x.grad = torch.ones(3, device="cuda:1")
    x.grad = torch.ones(3, device="cuda:0")
    assert x.grad.device == torch.device("cuda", 0)



def _tensors_made_from_tensors(device, other):
    torch.manual_seed(0)
    x = torch.randn(3, device=device, requires_grad=True)
    same, wider = torch.as_tensor(x, device=device), torch.as_tensor(x, dtype=torch.float64)
    moved = torch.as_tensor(x, device=other)
    values = torch.randn(2, 2, dtype=torch.float64, device=device, requires_grad=True)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), values, (3, 2, 2), device=device)
    (sparse.to_dense().sin().sum() + (wider * 2).sum() + moved.to(device).sum()).backward()
    return same is x, [t.requires_grad for t in (wider, moved, sparse)], x.grad, values.grad, moved, x


def test_tensors_made_from_gpu_tensors_keep_autograd_and_their_own_memory(emu):
    """`torch.as_tensor(gpu_x, ...)` is `gpu_x.to(...)` and the sparse constructors move their values with `.to()`:
    autograd's graph is kept (they came out detached), and a copy to another GPU has its own memory."""
    emu.stop()
    want = _tensors_made_from_tensors("cpu", "cpu")
    emu.start()
    got = _tensors_made_from_tensors("cuda:0", "cuda:1")
    assert got[:2] == want[:2] == (True, [True, True, True])
    for mine, theirs in zip(got[2:4], want[2:4]):
        assert mine.device == torch.device("cuda", 0)
        torch.testing.assert_close(mine.cpu(), theirs)
    moved, x = got[4:]
    assert moved.device == torch.device("cuda", 1) and moved.data_ptr() != x.data_ptr()


def test_sparse_invariant_checks_read_gpu_indices(emu):
    """With PyTorch's sparse invariant checks on (its test suite turns them on) the constructors read the indices
    through host pointers, which an emulated tensor has none of ("data is not allocated yet")."""
    values = torch.ones(2, device="cuda:1")
    with torch.sparse.check_sparse_tensor_invariants():
        sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (3,))  # host indices go to the values' GPU
        assert sparse.device == torch.device("cuda", 1)
        torch.testing.assert_close(sparse.to_dense().cpu(), torch.tensor([1.0, 0.0, 1.0]))
        with pytest.raises(RuntimeError, match="size is inconsistent with indices: for dim 0, size is 3 but found"):
            torch.sparse_coo_tensor(torch.tensor([[0, 3]]), values, (3,), device="cuda:1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_sums_on_a_gpu_concatenate_as_cuda_does(emu, dtype):
    """CUDA's sparse + sparse appends the second tensor's entries to the first's, uncoalesced (no nnz read back), and
    so takes half precision, which the CPU's merging kernel refuses; the values are still the sum."""
    emu.stop()
    a = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 3.0]]).to_sparse()
    b = torch.tensor([[4.0, 0.0, 0.0], [5.0, 0.0, 0.0]]).to_sparse()
    dense = (a.to_dense() - 2 * b.to_dense()).to(dtype)
    emu.start()
    ga, gb = a.to("cuda:1", dtype), b.to("cuda:1", dtype)
    for diff in (ga - 2 * gb, torch.sub(ga, gb, alpha=2), ga.clone().sub_(gb, alpha=2)):
        assert diff.device == torch.device("cuda", 1) and diff.dtype == dtype and not diff.is_coalesced()
        assert diff._nnz() == a._nnz() + b._nnz()
        torch.testing.assert_close(diff._indices().cpu(), torch.cat([a._indices(), b._indices()], 1))
        torch.testing.assert_close(diff.to_dense().cpu(), dense)
    crowded = ga + ga + ga  # more entries than elements: coalesced, as CUDA's kernel then does
    assert crowded.is_coalesced() and crowded._nnz() == a._nnz()


def test_tensors_a_gpu_op_writes_on_another_device_are_refused_in_atens_words(emu):
    """A GPU op never writes a host tensor, `out=` or an in-place op's self, not even a 0-dim one (which it takes as
    an input): structured reductions refuse it in their generated resize_out's words (CPU torch says them for a meta
    out), TensorIterator ops in theirs, the others in the common device check's, mode in its own."""
    emu.stop()
    with pytest.raises(RuntimeError) as host:
        torch.max(torch.randn(3), 0, out=(torch.empty(0, device="meta"), torch.empty(0, dtype=torch.long)))
    emu.start()
    x = torch.randn(3, device="cuda:1")
    with pytest.raises(RuntimeError) as gpu:
        torch.max(x, 0, out=(torch.empty(0), torch.empty(0, dtype=torch.long, device="cuda:1")))
    assert str(gpu.value) == str(host.value).replace("cpu", "cuda:1").replace("meta", "cpu")
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, .* cuda:1 and cpu!$"):
        torch.amax(x, 0, out=torch.empty(()))
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, .* cuda:1 and cpu!$"):
        torch.tensor(2.0).add_(torch.tensor(2.0, device="cuda:1"))  # a host scalar is read by a GPU op, not written
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, .* cuda:1 and cpu!$"):
        torch.ones(3) + x  # TensorIterator names the GPU first, whatever the order
    with pytest.raises(RuntimeError, match=r"^expected device 'cpu' but got 'cuda:1' for values output$"):
        torch.mode(torch.ones(2), out=(torch.empty(0, device="cuda:1"), torch.empty(0, dtype=torch.long)))
    torch.testing.assert_close(torch.add(x, torch.tensor(2.0), out=torch.empty(3, device="cuda:1")).cpu(), x.cpu() + 2)


def test_take_along_dim_checks_devices_with_its_own_words(emu):
    t, i = torch.tensor([[3.0, 1.0, 2.0]], device="cuda:1"), torch.tensor([[1, 2, 0]])
    torch.testing.assert_close(torch.take_along_dim(t, i.to("cuda:1"), dim=1).cpu(), torch.tensor([[1.0, 2.0, 3.0]]))
    with pytest.raises(RuntimeError, match=r"^Expected tensor to have cuda:1 Device, but got tensor with cpu Device "
                                           r"\(while checking arguments for torch.take_along_dim\(\):\)"):
        torch.take_along_dim(t, i, dim=1)


def test_vander_stays_on_the_gpu_and_tensor_split_refuses_gpu_split_points(emu):
    """`torch.vander`'s C++ allocates its result with `x.options()`, which name the host for an emulated tensor: the
    matrix came back a CPU tensor. `tensor_split` reads tensor split points on the host and refuses a GPU tensor
    with its own words; here it read the wrapper's missing data ("data is not allocated yet")."""
    for x in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2, 3], dtype=torch.int8)):
        for n, increasing in ((None, False), (4, True), (0, False)):
            got = torch.vander(x.cuda(1), n, increasing=increasing)
            want = torch.vander(x, n, increasing=increasing)
            assert got.device == torch.device("cuda", 1) and got.dtype == want.dtype
            torch.testing.assert_close(got.cpu(), want)
    values = torch.arange(6, device="cuda:1")
    assert [t.tolist() for t in values.tensor_split(torch.tensor([1, 3]))] == [[0], [1, 2], [3, 4, 5]]
    with pytest.raises(RuntimeError, match="^tensor_split expected tensor_indices_or_sections to be on cpu, but it's "
                                           "on cuda:1$"):
        torch.tensor_split(values, torch.tensor([1, 3], device="cuda:1"))
