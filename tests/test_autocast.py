"""torch.autocast("cuda") and GradScaler on emulated GPUs behave as on a GPU box: CUDA's op lists, real dtypes,
gradients equal to plain CPU torch doing the same casts by hand, costs at the low-precision rate."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import course
from course.cuda import autocast
from course.machine import costs

LOW = [torch.bfloat16, torch.float16]


@pytest.fixture
def emu():
    with course.emulate(gpus=4) as emulator:
        yield emulator


def _registered(key: str) -> set:
    return {n for n in torch._C._dispatch_get_registrations_for_dispatch_key(key) if n.startswith("aten::")}


def test_policy_tables_cover_exactly_the_ops_torch_autocasts():
    assert set(autocast.policies("cuda")) == _registered("AutocastCUDA")
    cpu = autocast.policies("cpu")
    assert set(cpu) == _registered("AutocastCPU")
    # Everything the CPU source lists as lower precision or promote is there; the rest is its fp32 list.
    assert {n for n, p in cpu.items() if p == "lower_precision_fp"} >= {"aten::mm", "aten::linear", "aten::conv2d"}
    assert cpu["aten::cat"] == "promote" and cpu["aten::mse_loss"] == "fp32"


def _x(*shape, device="cuda", dtype=torch.float32):
    return torch.randn(*shape, device=device, dtype=dtype)


# (aten op named in CUDA's lists, the public call that reaches it, input shapes)
SAMPLES = [
    ("aten::mm", torch.mm, [(4, 5), (5, 3)]),
    ("aten::matmul", torch.matmul, [(2, 4, 5), (5, 3)]),
    ("aten::linear", F.linear, [(4, 5), (3, 5), (3,)]),
    ("aten::bmm", torch.bmm, [(2, 4, 5), (2, 5, 3)]),
    ("aten::baddbmm", torch.baddbmm, [(2, 4, 3), (2, 4, 5), (2, 5, 3)]),
    ("aten::addmm", torch.addmm, [(4, 3), (4, 5), (5, 3)]),
    ("aten::addmv", torch.addmv, [(4,), (4, 5), (5,)]),
    ("aten::addr", torch.addr, [(4, 5), (4,), (5,)]),
    ("aten::mv", torch.mv, [(4, 5), (5,)]),
    ("aten::einsum", lambda a, b: torch.einsum("ij,jk->ik", a, b), [(4, 5), (5, 3)]),
    ("aten::conv2d", F.conv2d, [(1, 2, 6, 6), (3, 2, 3, 3)]),
    ("aten::conv1d", F.conv1d, [(1, 2, 6), (3, 2, 3)]),
    ("aten::prelu", F.prelu, [(4, 5), (1,)]),
    ("aten::scaled_dot_product_attention", F.scaled_dot_product_attention, [(1, 2, 4, 8)] * 3),
    ("aten::gru_cell", lambda x, h, wi, wh: torch.gru_cell(x, h, wi, wh), [(2, 3), (2, 4), (12, 3), (12, 4)]),
    ("aten::exp", torch.exp, [(4, 5)]),
    ("aten::log", lambda a: torch.log(a.abs()), [(4, 5)]),
    ("aten::pow.Tensor_Scalar", lambda a: a ** 2, [(4, 5)]),
    ("aten::rsqrt", lambda a: torch.rsqrt(a.abs()), [(4, 5)]),
    ("aten::layer_norm", lambda a: F.layer_norm(a, (5,)), [(4, 5)]),
    ("aten::group_norm", lambda a: F.group_norm(a, 2), [(2, 4, 3)]),
    ("aten::mse_loss", F.mse_loss, [(4, 5), (4, 5)]),
    ("aten::softplus", F.softplus, [(4, 5)]),
    ("aten::cdist", torch.cdist, [(4, 5), (3, 5)]),
    ("aten::logsumexp", lambda a: torch.logsumexp(a, 1), [(4, 5)]),
    ("aten::softmax.int", lambda a: torch.softmax(a, -1), [(4, 5)]),
    ("aten::log_softmax.int", lambda a: F.log_softmax(a, -1), [(4, 5)]),
    ("aten::sum", torch.sum, [(4, 5)]),
    ("aten::cumsum", lambda a: torch.cumsum(a, 0), [(4, 5)]),
    ("aten::prod", torch.prod, [(4, 5)]),
    ("aten::norm.Scalar", torch.norm, [(4, 5)]),
    ("aten::addcmul", torch.addcmul, [(4, 5), (4, 5), (4, 5)]),
    ("aten::atan2", torch.atan2, [(4, 5), (4, 5)]),
    ("aten::dot", torch.dot, [(5,), (5,)]),
]


def _by_hand(policy, dtype, inputs):
    """The casts CUDA's policy prescribes, done explicitly on plain CPU tensors."""
    if policy == "lower_precision_fp":
        return [t.to(dtype) for t in inputs]
    if policy == "fp32":
        return [t.float() for t in inputs]
    return inputs


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name, fn, shapes", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_each_op_family_runs_in_the_dtype_cuda_lists_give_it(emu, dtype, name, fn, shapes):
    policy = autocast.policies("cuda")[name]
    torch.manual_seed(0)
    # Inputs of fp32-list ops arrive in low precision in real models; lower-precision ops get fp32 weights.
    host = [torch.randn(*s, dtype=torch.float32 if policy == "lower_precision_fp" else dtype) for s in shapes]
    if policy == "promote":
        host[1] = host[1].float()
    with torch.autocast("cuda", dtype=dtype):
        out = fn(*[t.to("cuda:1") for t in host])
    expected_dtype = {"lower_precision_fp": dtype, "promote": torch.float32}.get(policy, torch.float32)
    assert out.dtype == expected_dtype and out.device == torch.device("cuda", 1)
    if policy == "fp32_set_opt_dtype":
        reference = fn(*host) if name in ("aten::sum", "aten::prod") else fn(*[t.float() for t in host])
        reference = reference.float()
    elif policy == "fp32_append_dtype":
        reference = torch.norm(host[0].float())
    elif policy == "promote":
        reference = fn(*[t.float() for t in host])
    else:
        reference = fn(*_by_hand(policy, dtype, host))
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-2 if dtype is torch.float16 else 2e-2, atol=1e-3)


def test_ops_outside_the_lists_keep_type_promotion_and_low_precision_inputs_stay(emu):
    a, b = _x(4, 4), _x(4, 4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = a @ b
        assert (h + a).dtype == torch.float32  # add is not listed: ordinary promotion
        assert torch.cat([h, h]).dtype == torch.bfloat16  # cat is in CPU's promote list, not CUDA's
        assert torch.relu(h).dtype == torch.bfloat16
        assert torch.addcmul(h, h, h).dtype == torch.bfloat16  # promote: all bf16 stays bf16
        assert torch.softmax(h, -1, dtype=torch.float64).dtype == torch.float64  # an explicit dtype wins
        assert (a.double() @ b.double()).dtype == torch.float64  # float64 is never cast
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(a), torch.rand(4, 4, device="cuda"))


def test_cpu_tensors_are_not_cast_in_a_cuda_region(emu):
    c, g = torch.randn(4, 4), _x(4, 4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert (c @ c).dtype == torch.float32 and F.linear(c, c).dtype == torch.float32
        assert (g @ g).dtype == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")


def _cpu_autocast_results():
    torch.manual_seed(0)
    a, b, img, w = torch.randn(4, 5), torch.randn(5, 3), torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = a @ b
        return [h, F.linear(a, b.t()), F.conv2d(img, w), torch.cat([h, b.t()[:, :3].t()]),
                F.mse_loss(h, h.detach() + 1), torch.softmax(h, -1)]


def test_cpu_autocast_keeps_working_while_emulating_and_leaves_gpu_tensors_alone():
    plain = _cpu_autocast_results()
    with course.emulate(gpus=2):
        emulated = _cpu_autocast_results()
        g = _x(4, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert (g @ g).dtype == torch.float32
    for p, e in zip(plain, emulated):
        assert p.dtype == e.dtype and type(e) is torch.Tensor
        assert torch.equal(p, e)


def test_entry_points_nesting_and_disabling(emu):
    a = _x(4, 4)
    with torch.autocast(device_type="cuda"):
        assert (a @ a).dtype == torch.float16  # CUDA's default autocast dtype
        with torch.autocast(device_type="cuda", enabled=False):
            assert (a @ a).dtype == torch.float32
            with torch.amp.autocast("cuda", dtype=torch.bfloat16):
                assert (a @ a).dtype == torch.bfloat16
            assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.float16
    assert (a @ a).dtype == torch.float32
    with pytest.warns(FutureWarning, match="torch.cuda.amp.autocast"):  # torch's own deprecation notice
        legacy = torch.cuda.amp.autocast(dtype=torch.bfloat16)
    with legacy:
        assert (a @ a).dtype == torch.bfloat16

    @torch.autocast("cuda", dtype=torch.bfloat16)
    def forward(x):
        return x @ x

    assert forward(a).dtype == torch.bfloat16 and (a @ a).dtype == torch.float32


def test_no_warnings_in_normal_use(emu):
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(_x(2, 8)).float().pow(2).mean()
        loss.backward()
        scaler = torch.amp.GradScaler("cuda")
        scaler.scale(model(_x(2, 8)).sum()).backward()


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


@pytest.mark.parametrize("dtype", LOW)
def test_gradients_equal_plain_cpu_torch_doing_the_same_casts_by_hand(emu, dtype):
    torch.manual_seed(0)
    ref = TinyNet()
    x, target = torch.randn(5, 6), torch.randint(0, 3, (5,))
    gpu = TinyNet().cuda(2)
    gpu.load_state_dict(ref.state_dict())
    with torch.autocast("cuda", dtype=dtype):
        logits = gpu(x.cuda(2))
        loss = F.cross_entropy(logits, target.cuda(2))
    loss.backward()
    assert logits.dtype == dtype and loss.dtype == torch.float32

    h = F.linear(x.to(dtype), ref.fc1.weight.to(dtype), ref.fc1.bias.to(dtype))  # linear: lower precision
    h = F.layer_norm(h.float(), (8,), ref.norm.weight, ref.norm.bias)  # layer_norm: fp32
    out = F.linear(torch.relu(h).to(dtype), ref.fc2.weight.to(dtype), ref.fc2.bias.to(dtype))
    # CUDA's cross_entropy is not listed: its C++ body calls log_softmax(x, dim, x.dtype), an explicit dtype
    # the fp32_set_opt_dtype policy respects, so log-probs stay low precision; then nll_loss runs in fp32.
    ref_loss = F.nll_loss(F.log_softmax(out, 1).float(), target)
    ref_loss.backward()
    assert torch.equal(loss.cpu(), ref_loss)
    for (name, p), q in zip(gpu.named_parameters(), ref.parameters()):
        assert p.dtype == p.grad.dtype == torch.float32 and p.grad.device == torch.device("cuda", 2), name
        assert torch.equal(p.grad.cpu(), q.grad), name


def test_a_weight_used_twice_is_cast_once_per_region(emu):
    w = torch.randn(4, 4, device="cuda", requires_grad=True)
    before = len(emu.trace)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = (w @ w) @ w
    casts = [e for e in emu.trace[before:] if e.name == "aten::_to_copy"]
    assert y.dtype == torch.bfloat16 and len(casts) == 1  # C++'s cached_cast: leaf fp32 weights cast once
    y.float().sum().backward()
    manual = w.detach().cpu().to(torch.bfloat16).requires_grad_()
    ((manual @ manual) @ manual).float().sum().backward()
    assert torch.equal(w.grad.cpu(), manual.grad.float())


def _weight_cast_first_under_no_grad(device):
    """An eval pass under no_grad, then a training use of the same weight, in one autocast region."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    w_on, x_on = w.detach().to(device).requires_grad_(), x.to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        with torch.no_grad():
            x_on @ w_on
        y = x_on @ w_on
    y.float().sum().backward()
    return y.grad_fn is not None, w_on.grad


def test_a_cast_first_cached_under_no_grad_still_carries_the_gradient():
    """Since pytorch/pytorch#165068 the cached cast of a weight is made with grad mode on: the emulator cached the
    no_grad cast, so the later use had no grad_fn and the weight got no gradient (silently, with a custom
    autograd.Function's forward too). CPU autocast runs the same C++ cached_cast and is the reference."""
    has_graph, grad = _weight_cast_first_under_no_grad("cpu")
    with course.emulate(gpus=1):
        emulated_has_graph, emulated_grad = _weight_cast_first_under_no_grad("cuda")
        emulated_grad = emulated_grad.cpu()
    assert has_graph and emulated_has_graph
    torch.testing.assert_close(emulated_grad, grad)


def test_nothing_is_cached_under_inference_mode(emu):
    w = torch.randn(4, 4, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with torch.inference_mode():
            w @ w
        y = w @ w
    assert y.grad_fn is not None and not y.is_inference()


class _WeightCasts(TorchDispatchMode):
    """Counts the low-precision casts of one weight, as PyTorch's TestAutocastGPU.test_cache_disabled does."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.count = weight, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0] is self.weight and kwargs.get("dtype") is LOW[0]:
            self.count += 1
        return func(*args, **kwargs)


def _casts_of_a_registered_cached_tensor(device):
    w = torch.randn(4, 4, device=device, requires_grad=True)
    torch._C._set_cached_tensors_enabled(True)
    try:
        torch._C._add_cached_tensor(w)
        with _WeightCasts(w) as mode, torch.autocast(device, dtype=LOW[0]):
            (w @ w) @ w
        torch._C._remove_cached_tensor(w)
    finally:
        torch._C._set_cached_tensors_enabled(False)
    return mode.count


def test_a_tensor_registered_as_cached_is_cast_at_each_use():
    """C++'s cached_cast skips `at::caching::is_cached_tensor` tensors (CUDA graph trees' static inputs): the
    emulator cached them. CPU autocast runs the same cached_cast and is the reference."""
    expected = _casts_of_a_registered_cached_tensor("cpu")
    with course.emulate(gpus=1):
        assert _casts_of_a_registered_cached_tensor("cuda") == expected > 1


def _steps_with_grads_broken_after_unscale(device):
    """PyTorch's test_params_invalidated_with_grads_invalidated_between_unscale_and_step: grads set with
    `copy_(number)` after `unscale_` are not checked again, so the step writes nan/inf into the weights."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler(device, init_scale=128.0)
    scaler.scale(model(torch.randn(3, 4, device=device)).sum()).backward()
    scaler.unscale_(opt)
    for j, param in enumerate(model.parameters()):
        param.grad.copy_(torch.inf if j % 2 else torch.nan)
    scaler.step(opt)
    return [p.detach().cpu() for p in model.parameters()]


def test_copying_a_number_into_a_gpu_tensor_as_grad_breaking_tests_do():
    expected = _steps_with_grads_broken_after_unscale("cpu")
    with course.emulate(gpus=2):
        emulated = _steps_with_grads_broken_after_unscale("cuda:1")
    assert all(p.isnan().any() or p.isinf().any() for p in expected)
    for p, q in zip(emulated, expected):
        torch.testing.assert_close(p, q, equal_nan=True)


def test_dataparallel_replicas_autocast_inside_forward():
    with course.emulate(gpus=2):
        class Net(nn.Linear):
            @torch.autocast("cuda", dtype=torch.bfloat16)
            def forward(self, x):
                return super().forward(x)

        model = nn.DataParallel(Net(4, 4).cuda())
        out = model(torch.randn(6, 4, device="cuda"))
        assert out.dtype == torch.bfloat16 and out.shape == (6, 4)


def test_bf16_matmul_is_charged_at_the_bf16_tensor_core_rate():
    with course.emulate(gpus=1, gpu="A100-80GB", materialize=False) as emu:
        a = torch.randn(8192, 8192, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = a @ a
        mm = emu.trace[-1]
        fp32 = a @ a
        mm32 = emu.trace[-1]
        assert mm.name == mm32.name == "aten::mm" and y.dtype == torch.bfloat16
        bytes_bf16 = 3 * 8192 * 8192 * 2  # two bf16 inputs read, one bf16 output written
        assert mm.bytes == bytes_bf16 and mm32.bytes == 2 * bytes_bf16
        shape = (1, 8192, 8192, 8192)
        assert mm.duration_ns == costs.kernel_ns(emu.gpu, mm.flops, bytes_bf16, torch.bfloat16, True, False, shape)
        assert mm32.duration_ns == costs.kernel_ns(emu.gpu, mm.flops, 2 * bytes_bf16, torch.float32, True, False, shape)
        assert mm.duration_ns * 10 < mm32.duration_ns  # 312 vs 19.5 TFLOP/s on an A100
        assert torch.cuda.memory_allocated() == 8192 * 8192 * (4 + 2 + 4)
        del fp32


def _scaler_run(device: str):
    """fp16 steps with GradScaler; step 2 gets an inf gradient. Returns scales, skipped flags and weights."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    data = torch.randn(6, 4, 4)
    scales, skipped, norms = [], [], []
    for step in range(6):
        opt.zero_grad()
        x = data[step].to(device)
        out = F.linear(x.half(), model.weight.half(), model.bias.half()).float()  # the same casts on both sides
        loss = out.pow(2).mean() * (float("inf") if step == 2 else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        before = model.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped.append(torch.equal(before, model.weight.detach()))
        scales.append(scaler.get_scale())
    return scales, skipped, norms, model.weight.detach().cpu(), scaler._scale.device.type


def test_gradscaler_matches_the_cpu_scaler_step_by_step():
    plain = _scaler_run("cpu")
    with course.emulate(gpus=2):
        emulated = _scaler_run("cuda")
    scales, skipped, norms, weight, device = emulated
    assert plain[1] == [False, False, True, False, False, False]  # the inf step is skipped
    assert scales == plain[0] and skipped == plain[1] and device == "cuda"
    assert plain[0][2] == plain[0][1] / 2 and plain[0][4] == plain[0][3] * 2  # backed off, then grew
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(plain[2]), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(weight, plain[3])


def test_legacy_cuda_gradscaler_works(emu):
    with pytest.warns(FutureWarning):
        scaler = torch.cuda.amp.GradScaler()
    w = torch.ones(3, device="cuda:1", requires_grad=True)
    scaler.scale((w * 2).sum()).backward()
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w.detach().cpu(), torch.full((3,), -1.0)) and scaler.get_scale() == 65536.0


def test_stop_gives_torch_back_its_own_autocast():
    enter = torch.amp.autocast_mode.autocast.__enter__
    with course.emulate(gpus=1):
        with course.emulate(gpus=2):
            pass
        a = _x(2, 2)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert (a @ a).dtype == torch.bfloat16  # the inner emulator's stop left the outer one's autocast
    assert torch.amp.autocast_mode.autocast.__enter__ is enter
    assert "autocast_mode.cpp" in [line for line in torch._C._dispatch_dump("aten::mm").splitlines()
                                   if line.startswith("AutocastCUDA:")][0]
    assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.AutocastCUDA)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_rnns_in_a_cuda_region_run_in_float16_as_cudnn_does(emu, cls):
    """A GPU sends LSTM/GRU/RNN to cuDNN, whose autocast wrapper casts input, hidden state and weights to float16
    whatever the region's dtype (AutocastRNN.cpp); with cuDNN off, its own cells run in the region's dtype."""
    torch.manual_seed(0)
    model, x = cls(4, 6, num_layers=2, bidirectional=True), torch.randn(5, 3, 4)
    reference = copy.deepcopy(model).half()(x.half())
    gpu = model.to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, hidden = gpu(x.to("cuda"))
        packed, _ = gpu(nn.utils.rnn.pack_padded_sequence(x.to("cuda"), [5, 4, 2]))
    hidden, expected_hidden = (hidden[0], reference[1][0]) if cls is nn.LSTM else (hidden, reference[1])
    assert out.dtype == hidden.dtype == packed.data.dtype == torch.float16
    torch.testing.assert_close(out.cpu(), reference[0])
    torch.testing.assert_close(hidden.cpu(), expected_hidden)
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 and p.grad.device.type == "cuda" for p in gpu.parameters())
    torch.backends.cudnn.enabled = False
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert gpu(x.to("cuda"))[0].dtype == torch.bfloat16
    finally:
        torch.backends.cudnn.enabled = True
    assert gpu(x.to("cuda"))[0].dtype == torch.float32
