"""Idioms common in public training scripts, each checked against plain CPU torch under the emulator."""
import copy
import queue
import re
import threading
import warnings
import weakref

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


def _packed_lstm_run(device):
    """Seq2seq-style: pack with CPU lengths (sorted and not), a bidirectional LSTM, pad back, backward."""
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, bidirectional=True).to(device)
    padded = torch.randn(5, 3, 3).to(device).requires_grad_()
    lengths = torch.tensor([2, 5, 3])  # on the CPU, as CUDA requires
    packed = nn.utils.rnn.pack_padded_sequence(padded, lengths, enforce_sorted=False)
    out, (h, _) = lstm(packed)
    unpacked, out_lengths = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=6)
    (unpacked.square().sum() + h.sum()).backward()
    sequences = [torch.arange(n * 2.0).view(n, 2).to(device) for n in (2, 4)]
    left = nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=-1.0, padding_side="left")
    return {"devices": [str(packed.data.device), str(packed.batch_sizes.device), str(unpacked.device),
                        str(out_lengths.device), str(left.device)],
            "values": [unpacked.detach().cpu(), out_lengths, padded.grad.cpu(), lstm.weight_hh_l0_reverse.grad.cpu(),
                       left.cpu()]}


def test_packed_sequences_take_cpu_lengths_and_match_cpu():
    want = _packed_lstm_run("cpu")
    with course.emulate(gpus=1):
        got = _packed_lstm_run("cuda")
        with pytest.raises(RuntimeError, match="'lengths' argument should be a 1D CPU int64 tensor, but got 1D cuda:0"):
            nn.utils.rnn.pack_padded_sequence(torch.ones(3, 2, 1, device="cuda"), torch.tensor([3, 2], device="cuda"))
    # the padded data follows the GPU; batch sizes and lengths stay on the host, where CUDA's kernels read them
    assert got["devices"] == ["cuda:0", "cpu", "cuda:0", "cpu", "cuda:0"]
    for mine, theirs in zip(got["values"], want["values"]):
        torch.testing.assert_close(mine, theirs)


def test_legacy_types_tell_host_from_gpu_tensors(emu):
    on_gpu, on_host = torch.ones(2, device="cuda"), torch.ones(2)
    assert not isinstance(on_gpu, torch.FloatTensor) and isinstance(on_gpu, torch.cuda.FloatTensor)
    assert isinstance(on_host, torch.FloatTensor) and not isinstance(on_host, torch.cuda.FloatTensor)
    assert isinstance(nn.Parameter(on_host), torch.FloatTensor) and not isinstance(on_host, torch.LongTensor)
    assert isinstance(on_gpu.long(), torch.cuda.LongTensor) and not isinstance(on_gpu.long(), torch.LongTensor)
    assert torch.LongTensor([1, 2]).dtype == torch.int64 and on_host.type(torch.DoubleTensor).dtype == torch.float64
    torch.set_default_tensor_type(torch.FloatTensor)
    with pytest.raises(TypeError, match=r"^expected TensorOptions\(dtype=float, device=cpu, .*\(got TensorOptions\("
                                        r"dtype=float, device=cuda:0, "):
        torch.FloatTensor(on_gpu)


def test_legacy_cuda_types_alias_a_gpu_tensor_of_their_dtype_as_cpu_types_alias_a_host_one():
    """`torch.cuda.FloatTensor(t)` (old GAN and detection code) is `t` itself, seen anew, as `torch.FloatTensor(t)`
    is on the host; a tensor of another dtype or device type gets tensor_new.cpp's TypeError."""
    host = torch.arange(3.0, requires_grad=True)
    host_alias = torch.FloatTensor(host)
    with pytest.raises(TypeError) as host_error:
        torch.FloatTensor(host.long())
    with course.emulate(gpus=2):
        gpu = torch.arange(3.0, device="cuda:1", requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            alias = torch.cuda.FloatTensor(gpu)
            with pytest.raises(TypeError) as gpu_error:
                torch.cuda.FloatTensor(gpu.long())
            with pytest.raises(TypeError, match=r"^expected TensorOptions\(dtype=float, device=cuda, .*device=cpu, "):
                torch.cuda.FloatTensor(host.detach())
        assert (alias.device, alias.requires_grad, alias._base is gpu) == (torch.device("cuda", 1), True, True)
        alias.detach()[0] = 7.0
        assert gpu[0].item() == 7.0
    assert (host_alias.requires_grad, host_alias._base is host) == (True, True)
    assert str(gpu_error.value) == str(host_error.value).replace("device=cpu", "device=cuda", 1).replace(
        "device=cpu", "device=cuda:1")


def test_lists_of_gpu_scalars_become_host_tensors_with_their_dtype(emu):
    """The chatbot tutorial's `torch.LongTensor([[topi[i][0] for i in ...]])`, and `torch.tensor([loss_a, loss_b])`."""
    scores = torch.tensor([[0.1, 0.9], [0.8, 0.2]], device="cuda")
    _, top = scores.topk(1)
    picked = torch.LongTensor([[top[i][0] for i in range(2)]])
    assert picked.tolist() == [[1, 0]] and picked.device.type == "cpu"
    doubles = torch.tensor([scores[0, 0].double(), scores[1, 0].double()])
    assert doubles.dtype == torch.float64 and doubles.tolist() == pytest.approx([0.1, 0.8])
    assert torch.tensor(scores[0, 1]).device == torch.device("cuda", 0)  # a tensor itself is copied where it is
    on_gpu = torch.tensor([[scores[0, 1]]], device="cuda")
    assert on_gpu.device == torch.device("cuda", 0) and on_gpu.item() == pytest.approx(0.9)
    # `x.new_tensor([loss_a, loss_b])` (common_nn's nllloss_reference): a C++ error about unallocated data
    losses = scores.new_tensor([scores[0, 1] * 2, scores[1, 0]])
    assert losses.device == torch.device("cuda", 0) and losses.tolist() == pytest.approx([1.8, 0.8])
    assert torch.ones(1).new_tensor([scores[0, 0]]).device.type == "cpu"


def test_storages_of_gpu_tensors_are_on_the_gpu(emu):
    x = torch.arange(6.0, device="cuda:1")
    storage = x.untyped_storage()
    assert storage.device == torch.device("cuda", 1) and storage.is_cuda and storage.nbytes() == 24
    assert x.storage().device == torch.device("cuda", 1) and x.storage().is_cuda
    assert storage.data_ptr() == x.data_ptr() and x[2:].untyped_storage().data_ptr() == x.data_ptr()
    host = storage.cpu()
    assert host.device.type == "cpu" and torch.tensor([], dtype=torch.float32).set_(host).tolist() == x.tolist()
    assert x.cpu().untyped_storage().device.type == "cpu"
    # share_memory_() leaves a CUDA tensor as it is, and it counts as shared (it shared the placeholder, and crashed)
    assert x.share_memory_() is x and x.is_shared() and x.tolist() == list(range(6))
    host = torch.ones(2).share_memory_()
    assert host.is_shared()


def test_storages_made_on_a_gpu_hold_what_cpu_storages_hold():
    """`torch.UntypedStorage(n, device="cuda")`, `torch.TypedStorage(data, device="cuda")` and
    `torch.cuda.FloatStorage(n)` are GPU storages (C++ knew no 'cuda' device: "Storage device not recognized"),
    written and read as CPU torch's; once the emulator stops, storages are CPU torch's again."""
    def run(device, legacy):
        made = legacy(4)
        made[:] = 0
        made[1] = 5
        return [torch.UntypedStorage(8, device=device).nbytes(), torch.UntypedStorage([1, 2], device=device).tolist(),
                torch.TypedStorage([1, 2], dtype=torch.float, device=device).tolist(), made.tolist()]

    want = run("cpu", torch.FloatStorage)
    with course.emulate(gpus=2):
        assert torch.cuda.FloatStorage(2).device == torch.device("cuda", 0)
        assert torch.UntypedStorage(4, device="cuda:1").device == torch.device("cuda", 1)
        assert run("cuda:1", torch.cuda.FloatStorage) == want
    assert torch.UntypedStorage(4).device.type == "cpu" and run("cpu", torch.FloatStorage) == want


def test_python_functions_that_make_tensors_on_their_inputs_device():
    def run(device):
        torch.manual_seed(0)
        bag = nn.EmbeddingBag(10, 3, mode="max").to(device)
        out = bag(torch.tensor([[1, 2], [3, 4]], device=device))
        out.sum().backward()
        sample_weights = torch.tensor([[0.5, 1.0], [2.0, 0.1]], device=device)
        weighted = nn.EmbeddingBag(10, 3, mode="sum").to(device)(torch.tensor([[1, 2], [3, 4]], device=device),
                                                                 per_sample_weights=sample_weights)
        coordinates = torch.unravel_index(torch.tensor([5, 11], device=device), (3, 4))
        attention = nn.MultiheadAttention(8, 2, add_zero_attn=True, add_bias_kv=True).to(device)
        x = torch.randn(5, 3, 8, device=device, requires_grad=True)
        attended, weights = attention(x, x, x)
        attended.sum().backward()
        image = torch.randn(2, 3, 9, 9, device=device, requires_grad=True)
        pooled, where = nn.functional.fractional_max_pool2d(image, 2, output_ratio=(0.5, 0.5), return_indices=True)
        pooled.sum().backward()
        _, singular_values, _ = torch.svd_lowrank(torch.randn(30, 12, device=device), q=4, niter=2)
        made = [out.detach(), bag.weight.grad, weighted.detach(), *coordinates, attended.detach(), weights.detach(),
                x.grad, attention.in_proj_weight.grad, pooled.detach(), where, image.grad, singular_values]
        assert {t.device.type for t in made} == {torch.device(device).type}
        return [t.cpu() for t in made]
    want = run("cpu")
    with course.emulate(gpus=1):
        got = run("cuda")
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs)


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.Linear(6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class _NamesItsDevice(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return x + self.make(x)


def test_export_of_a_gpu_model_gives_the_host_graph_and_runs_on_the_gpu(emu):
    """torch.export of a model on an emulated GPU is traced on its host twin (a fake GPU tensor would abort a CPU
    build): the graph CPU torch exports, the model's own emulated parameters in the program, and `ep.module()(x)`
    running on the GPU with eager's numbers. A forward that names a second GPU, CUDA autocast, or a model spread
    over devices would give a graph other than a GPU's: refused, naming it."""
    torch.manual_seed(0)
    host_model, host_x = _ConvNet().eval(), torch.randn(2, 3, 8, 8)
    model, x = copy.deepcopy(host_model).to("cuda:1"), host_x.to("cuda:1")
    program = torch.export.export(model, (x,))
    host_program = torch.export.export(host_model, (host_x,))
    assert [(n.op, n.target) for n in program.graph.nodes] == [(n.op, n.target) for n in host_program.graph.nodes]
    assert program.state_dict["conv.weight"] is model.conv.weight and program.example_inputs[0][0] is x
    before = len(emu.trace)
    out = program.module()(x)
    assert out.device == torch.device("cuda", 1) and len(emu.trace) > before
    torch.testing.assert_close(out.cpu(), host_program.module()(host_x))
    torch.testing.assert_close(out, model(x))
    for other_gpu in (lambda t: torch.ones(1).cuda(), lambda t: torch.ones(1, device="cuda:0")):
        with pytest.raises(RuntimeError, match="a model whose forward moves tensors from cuda:1 to cuda:0"):
            torch.export.export(_NamesItsDevice(other_gpu), (x,))  # the current device is cuda:0
    with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="under CUDA autocast"):
        torch.export.export(model, (x,))  # it casts GPU tensors only
    with pytest.raises(RuntimeError, match=r"spread over \['cuda:0', 'cuda:1'\]"):
        torch.export.export(_ConvNet().to("cuda:0"), (x,))
    with pytest.raises(RuntimeError, match="A fake tensor .* of a tensor on an emulated GPU"):
        program.run_decompositions()  # it re-traces from the GPU parameters
    assert torch.export.export(host_model, (host_x,)).module()(host_x).device == torch.device("cpu")


class _TinyGPT(nn.Module):
    """nanoGPT's shape: positions from `torch.arange(t, device=idx.device)`, a causal mask made on the input's device."""

    def __init__(self, vocab=17, width=16, context=8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.attn, self.head = nn.Linear(width, 3 * width), nn.Linear(width, vocab)

    def forward(self, idx):
        t = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        q, k, v = self.attn(x).split(x.size(-1), dim=2)
        causal = torch.ones(t, t, device=x.device).tril()
        scores = (q @ k.transpose(-2, -1)).masked_fill(causal == 0, float("-inf"))
        return self.head(x + scores.softmax(-1) @ v)


class _LSTMTagger(nn.Module):
    """An LSTM with its initial state made on the input's device, and one PyTorch's LSTM makes itself."""

    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x):
        h0 = torch.zeros(1, x.size(0), 5, device=x.device)
        given, _ = self.lstm(x, (h0, h0))
        own, _ = self.lstm(x)
        return self.fc(given[:, -1] + own[:, -1])


@pytest.mark.parametrize("make, make_input", [(_TinyGPT, lambda: torch.randint(0, 17, (2, 8))),
                                              (_LSTMTagger, lambda: torch.randn(2, 3, 4))])
def test_export_of_a_forward_that_makes_tensors_on_its_device(emu, make, make_input):
    """Export burns a forward's devices into its graph (pytorch#151010): the twin's graph names the host where a
    GPU's names cuda:1, which is written back, so the program's nodes are CPU torch's with cuda:1 for cpu, and
    `ep.module()(x)` gives eager's values and gradients on the GPU."""
    torch.manual_seed(0)
    host_model, host_x = make(), make_input()
    model, x = copy.deepcopy(host_model).to("cuda:1"), host_x.to("cuda:1")
    program, host_program = torch.export.export(model, (x,)), torch.export.export(host_model, (host_x,))

    def devices(graph):
        return [leaf for node in graph.nodes for leaf in torch.utils._pytree.tree_leaves((node.args, node.kwargs))
                if isinstance(leaf, torch.device)]
    assert [(n.op, n.target) for n in program.graph.nodes] == [(n.op, n.target) for n in host_program.graph.nodes]
    assert devices(host_program.graph) and set(devices(host_program.graph)) == {torch.device("cpu")}
    assert devices(program.graph) == [torch.device("cuda", 1)] * len(devices(host_program.graph))
    out, want = program.module()(x), host_model(host_x)
    assert out.device == torch.device("cuda", 1)
    torch.testing.assert_close(out.cpu(), want)
    out.square().sum().backward()
    want.square().sum().backward()
    for mine, theirs in zip(model.parameters(), host_model.parameters()):
        assert mine.grad.device == torch.device("cuda", 1)
        torch.testing.assert_close(mine.grad.cpu(), theirs.grad)


def test_export_gives_a_forward_asking_devices_the_gpus_answers(emu):
    """While the twin is traced, the forward asking a tensor's device gets a GPU's answer (its GPU branch is taken,
    `.to(t.device)` and `.to(t)` move to the GPU, a host tensor stays on the host), and so do PyTorch's functions
    that make tensors on their input's device midway (unravel_index, svd_lowrank, embedding_bag); PyTorch code
    outside those libraries asking the twin, which answers the host's device, is refused by name."""
    x = torch.randn(2, 3, device="cuda:1")
    forwards = [lambda t: t * 2 if t.is_cuda else t, lambda t: t * 2 if t.device.type == "cuda" else t,
                lambda t: t + t.get_device(), lambda t: t + torch.ones(3).to(t.device), lambda t: t + torch.ones(3).to(t),
                lambda t: t + torch.ones(3, dtype=torch.float64).type_as(t), lambda t: t.cpu() + torch.zeros(3),
                lambda t: t + torch.tensor([1.0, 2.0, 3.0], device=t.device), lambda t: t.to("cpu") * 2,
                lambda t: t + torch.unravel_index(t.argmax(), (2, 3))[1], lambda t: torch.svd_lowrank(t, q=2)[1],
                lambda t: nn.functional.embedding_bag(torch.tensor([[0, 1], [1, 0]], device=t.device), t)]
    for forward in forwards:
        model = _NamesItsDevice(forward)
        model.forward = forward  # its own output, on the host for the last ones
        out, want = torch.export.export(model, (x,)).module()(x), model(x)
        assert out.device == want.device
        torch.testing.assert_close(out.cpu(), want.cpu())
    with pytest.raises(RuntimeError, match="names a device where PyTorch's code asked a tensor for it"):
        torch.export.export(_NamesItsDevice(lambda t: torch.masked.mean(t, 1, keepdim=True)), (x,))  # torch.masked's
    with pytest.raises(RuntimeError, match=r"a model traced with strict=True \(TorchDynamo\)"):
        torch.export.export(_NamesItsDevice(lambda t: t * 2), (x,), strict=True)  # it raised Dynamo's AssertionError


def test_dlpack_capsules_of_gpu_tensors_are_refused_by_name_torch_to_torch_shares(emu):
    """A capsule of a GPU tensor would hand its consumer host memory: refused. torch.from_dlpack of a torch GPU
    tensor is, as on a GPU, a tensor on the same device over the same memory, outside autograd, after PyTorch's
    own refusals (a tensor that requires grad, one on another GPU than the current one)."""
    x = torch.ones(1, 2, device="cuda:1", requires_grad=True)
    with torch.cuda.device(1):
        for export in (torch.utils.dlpack.to_dlpack, lambda t: t.__dlpack__(),
                       lambda t: torch.from_dlpack(t, copy=True)):
            with pytest.raises(RuntimeError, match="DLPack export of a tensor on an emulated GPU"):
                export(x.detach())
        before = torch.cuda.memory_allocated(1)
        for exchange in (torch.from_dlpack, torch.utils.dlpack.from_dlpack):
            with pytest.raises(BufferError, match="Can't export tensors that require gradient, use tensor.detach()"):
                exchange(x)
            shared = exchange(x.detach())
            assert (shared.device, shared.requires_grad, shared.data_ptr()) == (x.device, False, x.data_ptr())
            shared.add_(1)
        assert x.tolist() == [[3.0, 3.0]] and torch.cuda.memory_allocated(1) == before
    with pytest.raises(BufferError, match="Can't export tensors on a different CUDA device index. Expected: 1. "
                                          "Current device: 0."):
        torch.from_dlpack(x.detach())
    assert torch.from_dlpack(torch.ones(2)).sum().item() == 2.0
    assert torch.from_dlpack(torch.utils.dlpack.to_dlpack(torch.ones(2))).device == torch.device("cpu")


def test_strided_nested_tensors_on_a_gpu_are_refused_by_name(emu):
    """Strided-layout nested tensors are C++ tensors (NestedTensorImpl) the emulator cannot hold: PyTorch's internal
    errors there ("NestedTensorImpl doesn't support sizes", a device mismatch) became one error that names it."""
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    makers = [lambda: torch.nested.nested_tensor([a.cuda(), b.cuda()]),
              lambda: torch.nested.nested_tensor([a, b], device="cuda"),
              lambda: torch.nested.nested_tensor([a, b]).cuda()]
    for make in makers:
        with pytest.raises(RuntimeError, match="A strided-layout nested tensor on an emulated GPU is not modelled"):
            make()
    on_host = torch.nested.nested_tensor([a, b])
    assert on_host.to_padded_tensor(0.0).cuda().shape == (2, 4, 3)


def _jagged_attention_step(device):
    """A variable-length attention step on jagged tensors, as recent attention code writes it; its output, the
    gradients of its weight and of its input, and the jagged tensors it made along the way."""
    torch.manual_seed(0)
    seqs = [torch.randn(n, 8) for n in (3, 5, 2)]
    w = torch.randn(8, 8).to(device).requires_grad_()
    leaf = torch.nested.nested_tensor([s.to(device) for s in seqs], layout=torch.jagged, device=device,
                                      requires_grad=True)
    q = torch.nn.functional.linear(leaf, w).unflatten(-1, (2, 4)).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(-2)
    out = out.softmax(-1) * torch.nested.nested_tensor_from_jagged(torch.cat(seqs).to(device), out.offsets())
    padded = torch.nested.to_padded_tensor(out, 0.0)
    (padded ** 2).sum().backward()
    return padded, w.grad, leaf.grad, [leaf, q, out], out.unbind()


def test_jagged_nested_tensors_run_on_emulated_gpus_with_cpu_values(emu):
    """A jagged nested tensor is a Python tensor over ordinary tensors (values, offsets), so on emulated GPUs its ops
    are emulated kernels: the same numbers and gradients as CPU torch, `cuda` devices, and a timeline."""
    expected = _jagged_attention_step("cpu")
    before = len(emu.trace)
    got = _jagged_attention_step("cuda:1")
    assert len(emu.trace) > before + 10  # linear, attention, softmax, padding, backward: kernels on the timeline
    for nt in got[3]:
        assert nt.is_nested and nt.layout is torch.jagged and nt.is_cuda and nt.device == torch.device("cuda", 1)
        assert nt.values().device == nt.offsets().device == torch.device("cuda", 1)
    assert got[0].device == got[1].device == torch.device("cuda", 1) and got[2].is_cuda
    torch.testing.assert_close(got[0].cpu(), expected[0])
    torch.testing.assert_close(got[1].cpu(), expected[1])
    torch.testing.assert_close(got[2].cpu().values(), expected[2].values())
    assert [p.shape for p in got[4]] == [p.shape for p in expected[4]] and all(p.is_cuda for p in got[4])
    back = got[3][2].cpu()
    assert not back.is_cuda and back.device == torch.device("cpu")
    torch.testing.assert_close(back.values(), expected[3][2].values())
    with pytest.raises(RuntimeError, match="same device|Expected all tensors"):
        got[3][2] + got[3][2].to("cuda:0")


def test_a_host_jagged_tensor_moved_and_cast_on_a_gpu_sends_its_gradient_home(emu):
    """`.to("cuda")` and a dtype change of a jagged tensor, as NJT's own `_to_copy` does them (values, offsets and
    lengths each moved, the ragged size kept): the copies are timed, and the gradient goes back to the host leaf."""
    leaf = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged,
                                      requires_grad=True)
    before = len(emu.trace)
    moved = leaf.to("cuda:1").to(torch.float64)
    assert [e.kind for e in emu.trace[before:]].count("copy") >= 2  # values and offsets cross the host link
    assert moved.is_cuda and moved.dtype == torch.float64 and moved.shape == leaf.shape  # the same ragged size
    (torch.nested.to_padded_tensor(moved, 0.0) * 3).sum().backward()
    assert leaf.grad.device == torch.device("cpu") and leaf.grad.dtype == torch.float32
    torch.testing.assert_close(leaf.grad.values(), torch.full((6, 3), 3.0))


def test_causal_jagged_attention_is_causal_within_each_sequence_as_on_a_gpu(emu):
    """CPU torch has no causal jagged SDPA (its math path refuses it); a GPU's memory-efficient kernel masks each
    sequence from its top-left (torch/nested/_internal/sdpa.py passes custom_mask_type=int(is_causal)): the same
    numbers as dense causal attention over each sequence alone."""
    torch.manual_seed(0)
    seqs = [torch.randn(2, n, 4) for n in (3, 5, 2)]  # (heads, length, dim)
    nt = torch.nested.nested_tensor([s.transpose(0, 1) for s in seqs], layout=torch.jagged).to("cuda").transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(nt, nt, nt, is_causal=True)
    for got, s in zip(out.unbind(), seqs):
        expected = torch.nn.functional.scaled_dot_product_attention(s, s, s, is_causal=True)
        torch.testing.assert_close(got.cpu(), expected)


def test_fake_tensors_of_gpu_tensors_are_refused_by_name_not_an_abort(emu):
    """opcheck and FakeTensorMode.from_tensor would make a C++ tensor on a CUDA device, which a CPU build's autograd
    aborts the process on ('PyTorch is not linked with support for cuda devices'): a named error instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    @torch.library.custom_op("course_test_fake::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    double.register_fake(lambda x: torch.empty_like(x))
    with pytest.raises(RuntimeError, match="fake tensor .* of a tensor on an emulated GPU is not modelled"):
        FakeTensorMode().from_tensor(torch.ones(2, device="cuda"))
    with pytest.raises(Exception, match="fake tensor .* of a tensor on an emulated GPU is not modelled"):
        torch.library.opcheck(double, (torch.ones(3, device="cuda", requires_grad=True),))
    assert FakeTensorMode().from_tensor(torch.ones(2)).shape == (2,)
    assert all(v == "SUCCESS" for v in torch.library.opcheck(double, (torch.ones(3),)).values())


def test_gradients_made_from_sizes_alone_are_on_the_gpu():
    """Backward formulas that make a zero gradient from the input's sizes and options (`copysign`'s sign argument,
    `sgn`, `repeat(0, ...)`) made it on the host: `.grad` of a GPU tensor was a CPU tensor."""
    def run(device):
        torch.manual_seed(0)
        a, b = (torch.randn(3, device=device, requires_grad=True) for _ in range(2))
        torch.copysign(a, b).sum().backward()
        c = torch.randn(3, device=device, requires_grad=True)
        (c.sgn() + c.repeat(0, 2).sum()).sum().backward()
        by_grad = torch.autograd.grad(torch.copysign(a, b).sum(), [a, b])
        return [a.grad, b.grad, c.grad, *by_grad]
    want = run("cpu")
    with course.emulate(gpus=1):
        got = run("cuda")
        assert [g.device for g in got] == [torch.device("cuda", 0)] * len(got)
        got = [g.cpu() for g in got]
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs)


def test_batched_gradients_on_a_gpu_equal_the_cpus():
    """gradcheck's batched-gradient check (`check_batched_grad=True`, on in PyTorch's OpInfo gradient tests) and
    `autograd.grad(is_grads_batched=True)` vmap the backward: the batched gradient of a GPU input stopped the
    emulator ("Batching rule not implemented for aten::detach"), which tried to copy it to the GPU it is already on."""
    def run(device):
        torch.manual_seed(0)
        x = torch.randn(3, 4, dtype=torch.double, device=device, requires_grad=True)
        sign = torch.randn(3, 4, dtype=torch.double, device=device, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x: (x @ x.T).tanh(), (x,), check_batched_grad=True)
        assert torch.autograd.gradgradcheck(torch.copysign, (x, sign), check_batched_grad=True)
        out = torch.copysign(x, sign).sin()
        cotangents = torch.randn(2, 3, 4, dtype=torch.double).to(device)
        return torch.autograd.grad(out, (x, sign), cotangents, is_grads_batched=True)
    want = run("cpu")
    with course.emulate(gpus=1):
        got = run("cuda")
        assert [g.device.type for g in got] == ["cuda", "cuda"]
        torch.testing.assert_close([g.cpu() for g in got], list(want))


def test_forward_ad_with_an_input_that_has_no_tangent_matches_the_cpu():
    """Forward-mode AD gives an input without a tangent PyTorch's efficient zero tensor, which has no memory: a GPU
    op that met one beside a GPU tensor ran the CPU kernel on it and crashed the process (gradcheck's
    `check_forward_ad=True`, on in PyTorch's OpInfo gradient tests, makes one for every input)."""
    import torch.autograd.forward_ad as fwAD

    def run(device):
        torch.manual_seed(0)
        x, y, m = (torch.randn(*shape, dtype=torch.double).to(device) for shape in ((6,), (6,), (4, 6)))
        tangents = []
        with fwAD.dual_level():
            dual_y = fwAD.make_dual(y, torch.ones_like(y))
            for out in (torch.matmul(x, dual_y), m @ dual_y, torch.addcmul(x, x, dual_y)):
                tangents.append(fwAD.unpack_dual(out).tangent)
        assert torch.autograd.gradcheck(torch.matmul, (m.requires_grad_(), y.requires_grad_()), check_forward_ad=True)
        return tangents
    want = run("cpu")
    with course.emulate(gpus=1):
        got = run("cuda")
        assert all(t.device.type == "cuda" for t in got)
        torch.testing.assert_close([t.cpu() for t in got], want)


def test_in_place_ops_that_reshape_a_tensor_reshape_the_gpu_tensor():
    """`img.unsqueeze_(0)`, `x.t_()`, `buf.resize_(n)`, `x.set_(y)` give the tensor new sizes, strides or storage: the
    GPU tensor must show them (it kept its old shape over reshaped data), and gradients flow as on the CPU."""
    reshapes = [lambda x: x.t_(), lambda x: x.unsqueeze_(0), lambda x: x.unsqueeze_(0).squeeze_(0),
                lambda x: x.transpose_(0, 1), lambda x: x.swapdims_(0, 1), lambda x: x.resize_(3, 2),
                lambda x: x.resize_(4, 4)[:1], lambda x: x.as_strided_((3,), (2,)),
                lambda x: x.resize_as_(torch.empty(6, device=x.device)),
                lambda x: x.set_(torch.full((5,), 7.0, device=x.device))]

    def run(device):
        torch.manual_seed(0)
        shown = []
        for reshape in reshapes:
            x = torch.arange(6.0, device=device).view(2, 3).clone()
            out = reshape(x)
            shown.append((tuple(x.shape), x.stride(), x.storage_offset(), out.cpu()))
        resized = torch.empty(0, device=device)  # an out= tensor of the wrong shape is resized (with a warning)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.add(torch.arange(6.0, device=device).view(2, 3), 1, out=resized)
        one_pixel = torch.ones(1, 3, 1, 1, device=device).to(memory_format=torch.channels_last)
        row = torch.ones(1, 2, device=device).t_()
        for x in (resized, one_pixel, row):
            shown.append((tuple(x.shape), x.stride(), x.storage_offset(), x.cpu()))
        w = torch.randn(3, 4, device=device, requires_grad=True)
        y = w * 2
        y.unsqueeze_(0).transpose_(1, 2).squeeze_(0)
        (y ** 2).sum().backward()
        return shown, w.grad.cpu()
    want_shown, want_grad = run("cpu")
    with course.emulate(gpus=2):
        got_shown, got_grad = run("cuda:1")
        grown = torch.empty(0, device="cuda:1")
        before = torch.cuda.memory_allocated(1)
        grown.resize_(2**20)
        assert torch.cuda.memory_allocated(1) - before == 4 * 2**20  # the bigger buffer is counted
        storage = torch.arange(4.0, device="cuda:1").untyped_storage()
        copy = storage.clone()
        assert copy.device == torch.device("cuda:1") and bytes(copy.cpu()) == bytes(storage.cpu())
    for (*metadata, values), (*want_metadata, want_values) in zip(got_shown, want_shown):
        assert metadata == want_metadata
        torch.testing.assert_close(values, want_values)  # resize_(4, 4)'s first row: the part PyTorch keeps
    torch.testing.assert_close(got_grad, want_grad)


def test_threads_the_program_starts_use_the_emulated_gpus():
    """One thread per GPU, and a thread prefetching batches to the GPU through a queue: plain `threading.Thread`s,
    whose factory calls and copies raised "Cannot access accelerator device" (the emulator's mode is per thread).
    A new thread's current device is 0, as CUDA's is per thread; its GPU work shows on the clock."""
    def run(device_of):
        per_gpu = [None, None]

        def matmul_on(index):  # its own generator: plain threads share torch's default one, and would race on it
            x = torch.randn(32, 32, generator=torch.Generator().manual_seed(index)).to(device_of(index))
            per_gpu[index] = (x @ x).sum().cpu()
        threads = [threading.Thread(target=matmul_on, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        batches, ready = [torch.full((4, 3), float(i)) for i in range(5)], queue.Queue(maxsize=2)

        def prefetch():
            for batch in batches:
                pinned = batch.pin_memory() if device_of(0) != "cpu" else batch  # a CPU-only build cannot pin
                ready.put(pinned.to(device_of(0), non_blocking=True))
            ready.put(None)
        threading.Thread(target=prefetch, daemon=True).start()
        sums = []
        while (batch := ready.get()) is not None:
            assert batch.device == torch.device(device_of(0))
            sums.append(batch.sum().item())
        return per_gpu, sums
    want = run(lambda i: "cpu")
    with course.emulate(gpus=2) as emu:
        got = run(lambda i: f"cuda:{i}")
        torch.cuda.set_device(1)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(torch.cuda.current_device()))
        thread.start()
        thread.join()
        assert seen == [0]
        assert {event.device for event in emu.trace if event.kind == "kernel"} >= {"cuda:0", "cuda:1"}
    torch.testing.assert_close(got[0], want[0])
    assert got[1] == want[1]


def _offloaded_step(device):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.GELU(), nn.Linear(12, 1)).to(device)
    x = torch.randn(5, 6).to(device)
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        loss = net(x).pow(2).mean()
    loss.backward()
    return loss.item(), [p.grad for p in net.parameters()]


def test_save_on_cpu_with_pinned_memory_matches_cpu():
    """Autograd packs saved tensors while the emulator handles the op that saves them, where its mode is off: the
    hook's pinned buffer met CPU-only torch ("requires a CUDA or other accelerator backend")."""
    expected_loss, expected = _offloaded_step("cpu")
    with course.emulate(gpus=2):
        loss, grads = _offloaded_step("cuda")
        assert all(g.device == torch.device("cuda", 0) for g in grads)
        grads = [g.cpu() for g in grads]
    assert loss == pytest.approx(expected_loss)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_sparse_cpu_tensor_moves_to_a_gpu_and_multiplies_as_on_cpu(emu):
    """A sparse COO tensor has no storage to look up pinning by: `sparse.to("cuda")` raised "Cannot access storage
    of SparseTensorImpl"."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1, 3], [2, 0, 2, 1]]), torch.tensor([3.0, 4.0, 5.0, -1.0]),
                                     (4, 3))
    dense = torch.randn(3, 2)
    on_gpu = sparse.to("cuda")
    assert on_gpu.is_sparse and on_gpu.device == torch.device("cuda", 0)
    torch.testing.assert_close(torch.sparse.mm(on_gpu, dense.cuda()).cpu(), torch.sparse.mm(sparse, dense))
    back = on_gpu.to("cuda:1").cpu()
    assert back.is_sparse
    torch.testing.assert_close(back.to_dense(), sparse.to_dense())


def test_sparse_constructors_on_a_gpu_infer_their_size_and_count_their_parts():
    """GNN code's `torch.sparse_coo_tensor(edge_index, weights, device=device)` and `sparse_csr_tensor(crow, col,
    values, device="cuda")` without a size, and COO parts already on the GPU: the size read from the indices as CPU
    torch reads it (negative indices refused alike); memory is the parts' bytes, not the dense shape's. Without a size
    they raised "Tensor.item() cannot be called on meta tensors" or "data is not allocated yet"; with one, a
    1000x1000 COO tensor of two entries counted 4 MB."""
    index, values = torch.tensor([[0, 3, 1], [2, 0, 4]]), torch.arange(6.0).view(3, 2)
    crow, col = torch.tensor([0, 1, 3]), torch.tensor([2, 0, 1])
    makers = [lambda d: torch.sparse_coo_tensor(index, values, device=d),
              lambda d: torch.sparse_coo_tensor(index.to(d), values.to(d)),
              lambda d: torch.sparse_csr_tensor(crow, col, values[:, 0], device=d),
              lambda d: torch.sparse_csc_tensor(crow, col, values[:, 0], device=d)]
    plain = [make("cpu") for make in makers]
    with course.emulate(gpus=1):
        for make, want in zip(makers, plain):
            got = make("cuda")
            assert got.device == torch.device("cuda", 0) and got.layout == want.layout and got.shape == want.shape
            torch.testing.assert_close(got.to_dense().cpu(), want.to_dense())
        with pytest.raises(RuntimeError, match="found negative index -1 for dim 0"):
            torch.sparse_coo_tensor(torch.tensor([[-1, 0]], device="cuda"), torch.ones(2, device="cuda"))
        before = torch.cuda.memory_allocated()
        big = torch.sparse_coo_tensor(index, values[:, 0], (1000, 1000), device="cuda")
        assert 0 < torch.cuda.memory_allocated() - before <= 1024  # 48 + 12 bytes of parts (a GPU: two 512-B blocks)
        del big


@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr"])
def test_sparse_tensors_made_on_a_gpu_compute_print_and_save_as_on_cpu(emu, layout):
    """Pruning and graph code: `to_sparse()` / `to_sparse_csr()` of a GPU tensor, its parts, sparse @ dense (with the
    dense side's gradient), addmm, coalesce, `to_dense()`, a move to another GPU, printing and torch.save: CPU
    torch's values, on the GPU. Compressed layouts (CSR, CSC, BSR) were a "not modelled" error."""
    import io
    torch.manual_seed(0)
    dense = torch.randn(6, 4) * (torch.rand(6, 4) > 0.5)
    rhs = torch.randn(4, 3, requires_grad=True)
    make = {"coo": lambda t: t.to_sparse(), "csr": lambda t: t.to_sparse_csr(), "csc": lambda t: t.to_sparse_csc(),
            "bsr": lambda t: t.to_sparse_bsr((2, 2))}[layout]
    on_cpu = make(dense)
    sparse = make(dense.cuda())
    assert sparse.layout == on_cpu.layout and sparse.device == torch.device("cuda", 0)
    for got, want in zip(_sparse_parts(sparse), _sparse_parts(on_cpu)):
        assert got.device == sparse.device
        torch.testing.assert_close(got.cpu(), want)
    assert sparse._nnz() == on_cpu._nnz()
    torch.testing.assert_close(sparse.to_dense().cpu(), dense)
    if layout in ("coo", "csr"):  # the layouts CPU torch multiplies
        rhs_gpu = rhs.detach().cuda().requires_grad_()
        (sparse @ rhs_gpu).sum().backward()
        (on_cpu @ rhs).sum().backward()
        torch.testing.assert_close(rhs_gpu.grad.cpu(), rhs.grad)
        torch.testing.assert_close(torch.addmm(torch.ones(6, 3, device="cuda"), sparse, rhs_gpu).cpu(),
                                   torch.addmm(torch.ones(6, 3), on_cpu, rhs))
    if layout == "coo":
        torch.testing.assert_close((sparse + sparse).coalesce().values().cpu(), (on_cpu + on_cpu).coalesce().values())
    moved = sparse.to("cuda:1")
    assert moved.device == torch.device("cuda", 1) and moved.layout == on_cpu.layout
    text, cpu_text = repr(sparse), repr(on_cpu)
    assert text.startswith(cpu_text[:cpu_text.rfind("values=")])  # the parts as CPU torch prints them
    assert f"device='cuda:0', size=(6, 4), nnz={on_cpu._nnz()}," in " ".join(text.split())  # then the device first
    assert repr(sparse.cpu()) == cpu_text
    buffer = io.BytesIO()
    torch.save({"w": sparse}, buffer)
    for location, device in (("cpu", torch.device("cpu")), ({"cuda:0": "cuda:1"}, torch.device("cuda", 1))):
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=location)["w"]
        assert loaded.layout == on_cpu.layout and loaded.device == device
        torch.testing.assert_close(loaded.to_dense().cpu(), dense)


def _sparse_parts(tensor):
    if tensor.layout is torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]


def test_kv_cache_slices_written_under_inference_mode(emu):
    """A decode loop writes each step's keys into a slice of a cache made before `inference_mode`: the slice's
    wrapper was an inference tensor, which autograd cannot give the cache's version counter (it raised)."""
    cache, keys = torch.zeros(2, 6), torch.arange(4.0).view(2, 2)
    on_gpu = cache.cuda()
    with torch.inference_mode():
        cache[:, 2:4] = keys
        on_gpu[:, 2:4] = keys.cuda()
        window = on_gpu[:, :4]
    assert not window.is_inference() and not on_gpu.is_inference()
    torch.testing.assert_close(on_gpu.cpu(), cache)
    torch.testing.assert_close(window.sum().item(), cache[:, :4].sum().item())


def test_module_moves_to_a_gpu_while_a_weak_id_dictionary_holds_its_parameters(emu):
    """torch.export (pipelining's `pipeline()`) keeps each traced parameter in a WeakIdKeyDictionary; the swap that
    moves a parameter to an emulated GPU refused it ("has weakref associated with it"), then `param.data = ...`
    could not move it. Any other weak reference still stops the swap, as in PyTorch."""
    layer = nn.Linear(3, 2)
    memo = torch.utils.weak.WeakIdKeyDictionary({layer.weight: "traced"})
    expected = layer(torch.ones(1, 3))
    layer.to("cuda:1")
    assert layer.weight.device == torch.device("cuda", 1) and memo[layer.weight] == "traced"
    torch.testing.assert_close(layer(torch.ones(1, 3, device="cuda:1")).cpu(), expected)
    held = weakref.ref(layer.bias)
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(layer.bias, nn.Parameter(torch.zeros(2, device="cuda:1")))
    assert held() is layer.bias


class _ScaleWithBuffer(torch.autograd.Function):
    """A backward that makes its gradient buffer on the gradient's device, as torch.distributed.nn's collectives do."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, device=grad.device, dtype=grad.dtype)
        return out.copy_(grad * 3) + torch.ones(grad.shape, device=grad.device)


def test_custom_function_backward_makes_tensors_on_the_gradient_device(emu):
    """The engine calls a Function's backward while the emulator's mode is off (it is handling `.backward()`): its
    `torch.empty(..., device=grad.device)` raised "not modelled" unless FSDP2 had been imported."""
    x = torch.arange(4.0, device="cuda:1", requires_grad=True)
    _ScaleWithBuffer.apply(x).pow(2).sum().backward()
    plain = torch.arange(4.0, requires_grad=True)
    _ScaleWithBuffer.apply(plain).pow(2).sum().backward()
    assert x.grad.device == torch.device("cuda", 1)
    torch.testing.assert_close(x.grad.cpu(), plain.grad)


def test_tensor_from_a_list_mixing_numbers_and_gpu_scalars(emu):
    """Metric code builds `torch.tensor([loss.item(), count, correct.sum()], device=...)`: only lists led by a GPU
    tensor were read on the host first, so a number first made C++ read the emulated scalar in place and raise."""
    scalar = torch.tensor(3.5, device="cuda:1")
    for data, expected in [([1.0, 2.0, scalar, scalar * 2], [1.0, 2.0, 3.5, 7.0]),
                           ([[1.0, scalar], [2.0, scalar]], [[1.0, 3.5], [2.0, 3.5]])]:
        made = torch.tensor(data, device="cuda:1")
        assert made.device == torch.device("cuda", 1) and made.tolist() == expected


def test_vmap_random_factories_draw_per_batch_element_on_the_gpu():
    """vmap(randomness="different") batches a random factory (one draw per element): the draw lives on the GPU,
    batched again, with plain CPU torch's values from the same seed; it could not be unbatched before."""
    def draws(device):
        torch.manual_seed(0)
        x = torch.zeros(3, 4, device=device)
        different = torch.func.vmap(lambda t: t + torch.randn(4, device=device), randomness="different")(x)
        same = torch.func.vmap(lambda t: t + torch.rand(4, device=device), randomness="same")(x)
        return different, same
    plain = draws("cpu")
    with course.emulate(gpus=1):
        emulated = draws("cuda")
        assert all(t.device == torch.device("cuda", 0) for t in emulated)
        for expected, got in zip(plain, emulated):
            assert torch.equal(got.cpu(), expected)


def test_inside_torch_func_transforms_a_gpu_tensor_says_where_it_is_and_factories_follow():
    """Per-sample-gradient and Jacobian code makes tensors on `x.device` inside the function it transforms: inside
    vmap, grad and jacrev/jacfwd a GPU tensor's wrapper said "cpu" (so they were made on the host), and a tensor made
    or moved there failed ("Cannot access data pointer", autograd.Function without setup_context, torch.tensor's
    "mutate a captured Tensor"); linearize's JVP gave zeros. CPU torch's values, on the GPU; the answers are PyTorch's
    own again outside the transforms."""
    def run(device):
        x = torch.linspace(-1, 1, 6, device=device).view(2, 3)
        seen = []
        def per_row(row):
            seen.append((str(row.device), row.is_cuda, row.get_device()))
            return (row * torch.arange(3.0, device=row.device) + torch.ones(3).to(row.device)).sum()
        grads = torch.func.vmap(torch.func.grad(per_row))(x)
        jac = torch.func.jacrev(lambda v: v.sin() * torch.ones(3, device=v.device))(x[0])
        fwd = torch.func.jacfwd(lambda v: v * torch.arange(3.0).to(v.device))(x[1])
        scaled = torch.func.grad(lambda v: (v * torch.tensor(2.0, device=v.device)).sum())(x[0])
        # PyTorch's own linearize traces with make_fx (slow): jvp gives the plain run's values
        linearize = torch.func.linearize if x.is_cuda else lambda f, v: (f(v), lambda t: torch.func.jvp(f, (v,), (t,))[1])
        value, jvp_fn = linearize(lambda v: v.sin() * v, x[1])
        results = (grads, jac, fwd, scaled, value, jvp_fn(torch.ones(3, device=device)))
        return seen, [t.device for t in results], [t.cpu() for t in results]
    seen, devices, plain = run("cpu")
    assert seen[0] == ("cpu", False, -1)
    with course.emulate(gpus=2):
        seen, devices, emulated = run("cuda:1")
        assert seen[0] == ("cuda:1", True, 1) and all(d == torch.device("cuda", 1) for d in devices)
        assert "device" not in vars(torch.Tensor)
    for got, want in zip(emulated, plain):
        torch.testing.assert_close(got, want)


def test_make_fx_of_gpu_tensors_is_refused_by_name(emu):
    """make_fx traced the ops the emulator runs on a GPU tensor's host tensor as constants: its graph gave wrong
    values. It is refused by name; CPU tensors trace as before."""
    from torch.fx.experimental.proxy_tensor import make_fx
    def f(x):
        return x.sin() + torch.ones(3, device=x.device)
    with pytest.raises(RuntimeError, match=r"make_fx .* of GPU tensors is not modelled"):
        make_fx(f)(torch.zeros(3, device="cuda"))
    torch.testing.assert_close(make_fx(f)(torch.zeros(3))(torch.ones(3)), f(torch.ones(3)))


def test_ensemble_base_model_moves_to_meta_and_vmap_matches_each_model(emu):
    """torch.func's ensembling tutorial: stack_module_state of GPU models, a copy of one moved to 'meta' as the
    stateless base, vmap over functional_call; each slice is that model's own output."""
    import copy
    from torch.func import functional_call, stack_module_state, vmap
    torch.manual_seed(0)
    models = [nn.Linear(4, 3).to("cuda") for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    assert base.weight.is_meta and base.weight.shape == (3, 4)
    x = torch.randn(5, 4, device="cuda")
    out = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)
    assert out.device == torch.device("cuda", 0)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i].cpu(), (x.cpu() @ m.weight.detach().cpu().T + m.bias.detach().cpu()))
    assert torch.ones(2, device="cuda").to("meta", torch.float16).dtype == torch.float16


def test_forward_mode_jacobians_of_gpu_functions_match_the_cpu(emu):
    """jvp, jacfwd and hessian capture GPU tensors whose zero tangents PyTorch's C++ makes with the CPU device
    of the emulated tensor underneath: they must join the GPU, and the numbers must be the CPU's."""
    from torch.func import hessian, jacfwd, jacrev, jvp
    torch.manual_seed(0)
    w, x = torch.randn(4, 4), torch.randn(4)
    wg, xg = w.to("cuda"), x.to("cuda")

    def f(w, x):
        return torch.tanh(w @ x).sin()

    torch.testing.assert_close(jacfwd(lambda x: f(wg, x))(xg).cpu(), jacfwd(lambda x: f(w, x))(x))
    torch.testing.assert_close(jacfwd(lambda x: f(wg, x))(xg).cpu(), jacrev(lambda x: f(wg, x))(xg).cpu())
    torch.testing.assert_close(hessian(lambda x: f(wg, x).sum())(xg).cpu(), hessian(lambda x: f(w, x).sum())(x))
    out, tangent = jvp(lambda x: f(wg, x), (xg,), (torch.ones_like(xg),))
    assert tangent.device == xg.device
    torch.testing.assert_close(tangent.cpu(), jvp(lambda x: f(w, x), (x,), (torch.ones_like(x),))[1])
    with pytest.raises(RuntimeError, match="same device"):  # a real CPU tensor inside a transform still refuses
        jacfwd(lambda x: x + torch.ones(4))(xg)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_transformer_encoder_fast_path_zeroes_padded_positions_as_without_the_emulator(mask_dtype):
    """In eval without gradients PyTorch packs the batch into a nested tensor and pads the output with zeros (then
    the final norm), on a GPU as on the CPU; it skips that path for tensor subclasses and under a torch-function
    mode, so under the emulator GPU and CPU tensors alike must still get those zeros."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16)).eval()
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:], pad[2, 2:] = True, True
    mask = pad if mask_dtype is torch.bool else torch.zeros(3, 6).masked_fill(pad, float("-inf"))
    with torch.no_grad():
        plain = encoder(x, src_key_padding_mask=mask)
        with course.emulate(gpus=2):
            cpu = encoder(x, src_key_padding_mask=mask)
            gpu = encoder.to("cuda")(x.to("cuda"), src_key_padding_mask=mask.to("cuda")).cpu()
            norm_of_zero = encoder.norm(torch.zeros(16, device="cuda")).cpu()
            encoder.cpu()
    torch.testing.assert_close(cpu, plain)
    torch.testing.assert_close(gpu, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu[pad], norm_of_zero.expand(int(pad.sum()), 16))
    encoder.train()  # training mode: no fast path, every position is computed
    assert not torch.allclose(encoder(x, src_key_padding_mask=mask)[pad], norm_of_zero.expand(int(pad.sum()), 16))


def test_lstsq_on_a_gpu_uses_gels_as_cuda_does(emu):
    """CUDA has only the gels driver (the CPU defaults to gelsy): residuals come back, rank does not, and asking
    for another driver is CUDA's error."""
    torch.manual_seed(0)
    a, b = torch.randn(7, 3), torch.randn(7, 2)
    on_gpu = torch.linalg.lstsq(a.to("cuda"), b.to("cuda"))
    as_cuda = torch.linalg.lstsq(a, b, driver="gels")
    torch.testing.assert_close(on_gpu.solution.cpu(), as_cuda.solution)
    torch.testing.assert_close(on_gpu.residuals.cpu(), as_cuda.residuals)
    assert on_gpu.rank.numel() == 0 and on_gpu.rank.dtype == torch.int64
    with pytest.raises(RuntimeError, match="`driver` other than `gels` is not supported on CUDA"):
        torch.linalg.lstsq(a.to("cuda"), b.to("cuda"), driver="gelsd")
    assert torch.linalg.lstsq(a, b).rank.item() == 3  # CPU tensors keep the CPU's drivers


def test_svd_on_a_gpu_takes_cusolvers_drivers(emu):
    """`driver=` gesvd / gesvdj / gesvda is cuSOLVER's choice (the CPU's LAPACK kernel refuses any driver): the same
    singular values as the CPU's, an unknown name is CUDA's error, and CPU tensors keep the CPU's refusal."""
    torch.manual_seed(0)
    a = torch.randn(6, 4)
    expected = torch.linalg.svdvals(a)
    for driver in ("gesvd", "gesvdj", "gesvda"):
        u, s, vh = torch.linalg.svd(a.to("cuda"), full_matrices=False, driver=driver)
        assert s.device == torch.device("cuda", 0)
        torch.testing.assert_close(s.cpu(), expected)
        torch.testing.assert_close((u @ torch.diag(s) @ vh).cpu(), a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.linalg.svdvals(a.to("cuda"), driver=driver).cpu(), expected)
    with pytest.raises(RuntimeError, match="unknown svd driver gesdd in svd_cusolver computation"):
        torch.linalg.svd(a.to("cuda"), driver="gesdd")
    with pytest.raises(RuntimeError, match="only supported on CUDA inputs"):
        torch.linalg.svd(a, driver="gesvdj")


def _float8(shape):
    x = torch.randn(*shape)
    return (x * 448 / x.abs().max()).to(torch.float8_e4m3fn), (x.abs().max() / 448).float()


def test_scaled_mm_is_refused_before_ada_and_computed_after_as_on_gpus():
    """torch._scaled_mm: an A100 (sm_80) refuses it with CUDA's error, where the CPU kernel would compute it; an H100
    computes what the CPU does, and refuses the shapes and layouts cuBLASLt cannot take (a row-major first and a
    column-major second operand only)."""
    torch.manual_seed(0)
    (a, sa), (b, sb) = _float8((32, 64)), _float8((48, 64))
    on_cpu = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    with course.emulate(gpus=1, gpu="A100-80GB"):
        with pytest.raises(RuntimeError, match=r"compute capability >= 9.0 or 8.9"):
            torch._scaled_mm(a.cuda(), b.cuda().t(), scale_a=sa.cuda(), scale_b=sb.cuda(), out_dtype=torch.float32)
    with course.emulate(gpus=1, gpu="H100"):
        on_gpu = torch._scaled_mm(a.cuda(), b.cuda().t(), scale_a=sa.cuda(), scale_b=sb.cuda(), out_dtype=torch.float32)
        assert on_gpu.device.type == "cuda"
        torch.testing.assert_close(on_gpu.cpu(), on_cpu)
        (c, sc) = _float8((32, 24))
        with pytest.raises(RuntimeError, match=r"trailing dimension of mat1 to be divisible by 16"):
            torch._scaled_mm(c.cuda(), b.cuda()[:, :24].t(), scale_a=sc.cuda(), scale_b=sb.cuda())
        for first, second in ((a, b.t().contiguous()), (a.t().contiguous().t(), b.t())):  # not row x column-major
            with pytest.raises(RuntimeError, match="Only multiplication of row-major and column-major matrices"):
                torch._scaled_mm(first.cuda(), second.cuda(), scale_a=sa.cuda(), scale_b=sb.cuda())
    torch._scaled_mm(c, b[:, :24].t(), scale_a=sc, scale_b=sb)  # the CPU takes it
    torch._scaled_mm(a, b.t().contiguous(), scale_a=sa, scale_b=sb)


def test_int_mm_takes_the_shapes_cublaslt_takes(emu):
    """torch._int_mm on a GPU: int32 results equal the CPU's, and the small shapes only the CPU kernel takes are
    refused with `_int_mm_out_cuda`'s words."""
    a = torch.randint(-128, 128, (32, 64), dtype=torch.int8)
    b = torch.randint(-128, 128, (64, 16), dtype=torch.int8)
    assert torch.equal(torch._int_mm(a.cuda(), b.cuda()).cpu(), torch._int_mm(a, b))
    with pytest.raises(RuntimeError, match=r"self.size\(0\) needs to be greater than 16, but got 8"):
        torch._int_mm(a[:8].cuda(), b.cuda())
    assert torch._int_mm(a[:8], b).shape == (8, 16)  # the CPU kernel takes it


def test_scaled_mm_refuses_the_outputs_and_biases_cuda_refuses():
    """What the CPU's _scaled_mm computes and CUDA's refuses (ScaledBlas.cpp): a bias with a float32 output, a bias
    whose dtype is not the output's, row-wise scales with a float32 output (CUTLASS's kernel before cuBLAS 12.9)."""
    torch.manual_seed(0)
    (a, sa), (b, sb) = _float8((16, 32)), _float8((48, 32))
    bias = torch.randn(48, dtype=torch.bfloat16)
    rows_a, rows_b = torch.ones(16, 1), torch.ones(1, 48)
    on_cpu = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)
    torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float32)  # the CPU takes these
    torch._scaled_mm(a, b.t(), scale_a=rows_a, scale_b=rows_b, out_dtype=torch.float32)
    with course.emulate(gpus=1, gpu="H100"):
        a, b, sa, sb, bias = a.cuda(), b.cuda(), sa.cuda(), sb.cuda(), bias.cuda()
        on_gpu = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)
        assert torch.equal(on_gpu.cpu(), on_cpu)
        with pytest.raises(RuntimeError, match="Bias is not supported when out_dtype is set to Float32"):
            torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float32)
        with pytest.raises(RuntimeError, match="Bias must be Float16 to compute Half output, but got BFloat16"):
            torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float16)
        with pytest.raises(ValueError, match="Only bf16 and fp16 high precision output types"):
            torch._scaled_mm(a, b.t(), scale_a=rows_a.cuda(), scale_b=rows_b.cuda(), out_dtype=torch.float32)


def test_matmuls_with_out_dtype_run_cublas_kernels(emu):
    """torch.mm/bmm/addmm/baddbmm(..., out_dtype=torch.float32) have only CUDA kernels: half inputs give float32
    results equal to the CPU's product of float32 copies, and count their FLOPs; other pairs are refused with
    Blas.cpp's words, as is float16 accumulation into a float32 output."""
    torch.manual_seed(0)
    a, b, c = (torch.randn(s, dtype=torch.bfloat16) for s in ((3, 8, 5), (3, 5, 4), (3, 8, 4)))
    checks = [
        (torch.mm(a[0].cuda(), b[0].cuda(), out_dtype=torch.float32), a[0].float() @ b[0].float()),
        (torch.bmm(a.cuda(), b.cuda(), out_dtype=torch.float32), torch.bmm(a.float(), b.float())),
        (torch.addmm(c[0].cuda(), a[0].cuda(), b[0].cuda(), out_dtype=torch.float32, beta=0.5, alpha=2),
         torch.addmm(c[0].float(), a[0].float(), b[0].float(), beta=0.5, alpha=2)),
        (torch.baddbmm(c.cuda(), a.cuda(), b.cuda(), out_dtype=torch.bfloat16), torch.baddbmm(c, a, b)),
    ]
    for got, want in checks:
        assert got.device.type == "cuda" and got.dtype == want.dtype
        assert torch.equal(got.cpu(), want)
    assert [e.flops for e in emu.trace if "baddbmm" in e.name] == [2 * 3 * 8 * 5 * 4]
    with pytest.raises(RuntimeError, match="out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs"):
        torch.mm(a[0].float().cuda(), b[0].float().cuda(), out_dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(8x5 and 8x4\)"):
        torch.mm(a[0].cuda(), c[0].cuda(), out_dtype=torch.float32)
    half = torch.ones(32, 32, dtype=torch.float16).cuda()
    torch.backends.cuda.matmul.allow_fp16_accumulation = True
    try:
        with pytest.raises(RuntimeError, match="allow_fp16_accumulation"):
            torch.mm(half, half, out_dtype=torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_fp16_accumulation = False


def test_weight_int8pack_mm_takes_what_cudas_kernel_takes(emu):
    """torch._weight_int8pack_mm on a GPU computes in float32 from contiguous copies and returns the activations'
    dtype (int8mm.cu): a transposed bf16 or a float64 activation, which the CPU kernel refuses, gives the
    dequantized product; a float weight is refused."""
    torch.manual_seed(0)
    x, w, scales = torch.randn(16, 8).t(), torch.randint(-128, 128, (5, 16), dtype=torch.int8), torch.rand(5)
    with pytest.raises(RuntimeError, match="A must be contiguous"):
        torch._weight_int8pack_mm(x.bfloat16(), w, scales)
    for dtype in (torch.bfloat16, torch.float64):
        got = torch._weight_int8pack_mm(x.to("cuda", dtype), w.cuda(), scales.cuda())
        assert got.dtype == dtype and got.device.type == "cuda"
        want = ((x.to(dtype).float().contiguous() @ w.float().t()) * scales).to(dtype)
        torch.testing.assert_close(got.cpu(), want)
    with pytest.raises(RuntimeError, match="expected scalar type Char but found Float"):
        torch._weight_int8pack_mm(x.cuda(), w.float().cuda(), scales.cuda())


def test_cudnn_convolutions_compute_and_cost_as_the_convolutions_they_are(emu):
    """torch.cudnn_convolution(_transpose) (on CUDA autocast's lower-precision list, called directly by some programs)
    has no CPU kernel: on emulated GPUs it gives conv2d's values and gradients, autocasts to float16, and is timed as
    the same convolution, where it was refused as an op the emulator does not model."""
    x, w, wt = torch.randn(2, 4, 9, 9, dtype=torch.double), torch.randn(6, 2, 3, 3, dtype=torch.double), \
        torch.randn(4, 3, 3, 3, dtype=torch.double)
    xg, wg = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    out = torch.cudnn_convolution(xg, wg, (1, 1), (2, 2), (1, 1), 2, False, True, True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.conv2d(xr, wr, None, (2, 2), (1, 1), (1, 1), 2)
    torch.testing.assert_close(out.cpu(), ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close((xg.grad.cpu(), wg.grad.cpu()), (xr.grad, wr.grad))
    up = torch.cudnn_convolution_transpose(x.cuda(), wt.cuda(), (1, 1), (1, 1), (2, 2), (1, 1), 1, False, True, True)
    torch.testing.assert_close(up.cpu(), torch.nn.functional.conv_transpose2d(x, wt, None, (2, 2), (1, 1), (1, 1), 1))
    with torch.autocast("cuda"):
        assert torch.cudnn_convolution(x.float().cuda(), w.float().cuda(), (0, 0), (1, 1), (1, 1), 2, False, True,
                                       True).dtype == torch.float16
    for direct, conv in [(lambda: torch.cudnn_convolution(x.cuda(), w.cuda(), (1, 1), (1, 1), (1, 1), 2, True, True,
                                                          True),
                          lambda: torch.nn.functional.conv2d(x.cuda(), w.cuda(), None, 1, 1, 1, 2)),
                         (lambda: torch.cudnn_convolution_transpose(x.cuda(), wt.cuda(), (1, 1), (1, 1), (2, 2), (1, 1),
                                                                    1, False, True, True),
                          lambda: torch.nn.functional.conv_transpose2d(x.cuda(), wt.cuda(), None, 2, 1, 1, 1))]:
        durations = []
        for run in (direct, conv):
            torch.cuda.synchronize()
            before = len(emu.trace)
            run()
            durations.append([e.duration_ns for e in emu.trace[before:] if e.kind == "kernel"][-1])
        assert durations[0] == durations[1] > 0


def test_a_cuda_kernel_the_program_registers_is_the_one_a_gpu_runs(emu):
    """torch.library: a GPU runs the op's CUDA kernel; with CPU and CUDA kernels that differ, the CPU one must not
    stand in silently, and an op with a CUDA kernel only must run. Its ops run (and are timed) on the GPU."""
    lib = torch.library.Library("course_test_kernels", "DEF")
    lib.define("scaled(Tensor x) -> Tensor")
    lib.define("gpu_only(Tensor x) -> Tensor")
    lib.impl("scaled", lambda x: x * 2, "CPU")
    lib.impl("scaled", lambda x: x * 3, "CUDA")
    lib.impl("gpu_only", lambda x: x + 1, "CUDA")

    @torch.library.custom_op("course_test_kernels::shifted", mutates_args=())
    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x - 1

    @shifted.register_kernel("cuda")
    def _(x):
        return x - 5

    x = torch.arange(3.0)
    assert torch.ops.course_test_kernels.scaled(x).tolist() == [0.0, 2.0, 4.0]
    on_gpu = torch.ops.course_test_kernels.scaled(x.to("cuda:1"))
    assert on_gpu.device == torch.device("cuda", 1) and on_gpu.cpu().tolist() == [0.0, 3.0, 6.0]
    assert torch.ops.course_test_kernels.gpu_only(x.to("cuda")).cpu().tolist() == [1.0, 2.0, 3.0]
    assert shifted(x).tolist() == [-1.0, 0.0, 1.0]
    before = len(emu.trace)
    assert shifted(x.to("cuda")).cpu().tolist() == [-5.0, -4.0, -3.0]
    assert any(e.device == "cuda:0" and e.kind == "kernel" for e in emu.trace[before:])

    @torch.library.custom_op("course_test_kernels::halved", mutates_args=())
    def halved(x: torch.Tensor) -> torch.Tensor:  # one body for every device: a GPU runs it on its CUDA tensors
        return (x / 2).exp()

    before = len(emu.trace)
    torch.testing.assert_close(halved(x.to("cuda:1")).cpu(), halved(x))
    assert [e.name for e in emu.trace[before:] if e.device == "cuda:1" and e.kind == "kernel"][-2:] == \
        ["aten::div", "aten::exp"]


def test_flex_attention_runs_eagerly_on_a_gpu_with_the_cpus_numbers():
    """flex_attention without torch.compile runs PyTorch's dense implementation on a GPU; on emulated GPUs it found
    no rule for the tensor subclass. Its backward, which traces on fake CUDA tensors, is refused by name rather
    than aborting the process."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def relative(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) * 0.1

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = flex_attention(q, k, v, score_mod=relative, block_mask=create_block_mask(causal, 1, 1, 8, 8, "cpu"))
        with course.emulate(gpus=1) as emu:
            mask = create_block_mask(causal, 1, 1, 8, 8, device="cuda")
            with torch.no_grad():
                out = flex_attention(q.cuda(), k.cuda(), v.cuda(), score_mod=relative, block_mask=mask)
            kernels = sum(e.kind == "kernel" for e in emu.trace)
            on_device = out.device
            out = out.cpu()
            with pytest.raises(RuntimeError, match="FlexAttention's backward on emulated GPUs is not modelled"):
                flex_attention(q.cuda().requires_grad_(), k.cuda(), v.cuda())
    assert on_device == torch.device("cuda", 0) and kernels > 0
    torch.testing.assert_close(out, plain)


def test_sdpa_broadcasts_a_three_dimensional_mask_as_on_a_gpu(emu):
    """An ALiBi bias per head, (heads, L, S), broadcasts over the batch in SDPA on every backend; the fused CPU
    kernel the emulator runs in a GPU's place wants a 2-D or 4-D mask and refused it."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    for mask in (torch.randn(4, 6, 6), torch.randn(1, 6, 6), torch.rand(4, 6, 6) > 0.3):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = torch.nn.functional.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), attn_mask=mask.cuda())
        torch.testing.assert_close(got.cpu(), want)


def test_selective_checkpointing_sees_and_saves_the_fused_attention_op_a_gpu_runs(emu):
    """A policy naming CUDA's fused SDPA ops (torchtitan's save list) saw the CPU's fused op on emulated GPUs and
    recomputed attention. Under a program's dispatch mode SDPA calls the op a GPU picks (memory-efficient for
    float32, flash for bf16 on an A100), with the CPU kernel's values, so checkpointed and plain runs agree exactly,
    and FlopCounterMode counts attention's FLOPs as on a GPU."""
    from functools import partial
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    fused = {aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default}
    saved = []

    def policy(ctx, op, *args, **kwargs):
        if op in fused and not ctx.is_recompute:
            saved.append(op)
        return CheckpointPolicy.MUST_SAVE if op in fused else CheckpointPolicy.PREFER_RECOMPUTE

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sin()

    torch.manual_seed(0)
    host = [torch.randn(2, 3, 8, 4) for _ in range(3)]
    leaves = [t.clone().requires_grad_() for t in host]
    attend(*leaves).sum().backward()
    plain = [t.grad for t in leaves]
    for dtype, op in ((torch.float32, aten._scaled_dot_product_efficient_attention.default),
                      (torch.bfloat16, aten._scaled_dot_product_flash_attention.default)):
        runs = []
        for context_fn in (None, partial(create_selective_checkpoint_contexts, policy)):
            leaves = [t.cuda().requires_grad_() for t in host]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = checkpoint(attend, *leaves, use_reentrant=False, context_fn=context_fn) if context_fn else \
                    attend(*leaves)
            out.float().sum().backward()
            runs.append([out.cpu()] + [t.grad.cpu() for t in leaves])
        assert saved == [op] and all(torch.equal(a, b) for a, b in zip(*runs))
        saved.clear()
        if dtype == torch.float32:
            assert all(torch.equal(a, b) for a, b in zip(runs[1][1:], plain))
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v = host
    with FlopCounterMode(display=False) as on_gpu:  # the CPU's fused op has no FLOP formula: it counted 0
        torch.nn.functional.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda())
    with FlopCounterMode(display=False) as matmuls:
        q @ k.transpose(-2, -1) @ v
    assert on_gpu.get_total_flops() == matmuls.get_total_flops() > 0


def test_checkpoint_restores_the_rng_of_its_inputs_gpus_only(emu):
    """A checkpointed region whose input is on cuda:0 and whose dropout runs on cuda:1 recomputes with a new mask on
    a GPU box (checkpoint stashes its inputs' devices' states; torch.cuda._initialized says CUDA is in use): the
    gradient is the one for the mask drawn next, here computed on plain CPU torch. With the dropout on cuda:0 the
    recomputation is exact."""
    from torch.utils.checkpoint import checkpoint

    def region(x, device):
        return nn.functional.dropout(x.to(device) * 2, 0.5)

    def run(device, ckpt, manual=False):
        torch.manual_seed(0)
        x = torch.randn(6, 5, device=device and "cuda:0", requires_grad=True)
        if manual:  # the forward's mask drawn and dropped, the next one used for the gradient
            nn.functional.dropout(torch.ones(6, 5), 0.5)
        y = checkpoint(region, x, device, use_reentrant=False) if ckpt else region(x, device)
        y.backward(torch.arange(30.0, device=y.device).view(6, 5))
        return y.detach().cpu(), x.grad.cpu(), torch.rand(2, device=y.device).cpu()

    emu.stop()
    plain, next_mask = run(None, False), run(None, False, manual=True)
    emu.start()
    same, crossing = run("cuda:0", True), run("cuda:1", True)
    assert all(torch.equal(a, b) for a, b in zip(same, plain))
    assert torch.equal(crossing[0], plain[0]) and torch.equal(crossing[1], next_mask[1])
    assert torch.equal(crossing[2], next_mask[2]) and not torch.equal(crossing[1], plain[1])


def test_dropout_runs_cudas_fused_kernel_keeping_a_bool_mask(emu):
    """ATen's dropout takes `native_dropout` for a CUDA input: autograd keeps a 1-byte mask, not the CPU path's noise
    in the input's dtype, and half-precision gradients scale in float. Seeded float32 values equal the CPU's."""
    torch.manual_seed(0)
    host = torch.randn(64, 96)
    grad = torch.randn(64, 96)
    for dtype in (torch.float32, torch.bfloat16):
        x, g = host.to(dtype), grad.to(dtype)
        gpu = x.cuda().requires_grad_()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(1)
        out = torch.nn.functional.dropout(gpu, 0.37)
        assert torch.cuda.memory_allocated() - before == x.numel() * (x.element_size() + 1)
        out.backward(g.cuda())
        ref = x.clone().requires_grad_()
        torch.manual_seed(1)
        fused = torch.native_dropout(ref, 0.37, True)[0]
        fused.backward(g)
        assert torch.equal(out.cpu(), fused) and torch.equal(gpu.grad.cpu(), ref.grad)
        if dtype == torch.float32:
            torch.manual_seed(1)
            assert torch.equal(out.cpu(), torch.nn.functional.dropout(x, 0.37))
        del out


def test_sdpa_with_math_off_stops_where_no_fused_cuda_kernel_takes_the_inputs():
    """`sdpa_kernel(SDPBackend.FLASH_ATTENTION)` with float32 inputs or a mask, or on a V100, stops a GPU with "No
    available kernel" after warning why each backend refused (sdp_utils.cpp); the emulator's CPU kernels took them.
    What a fused kernel takes still runs, with the CPU's values; autocast's cast comes before the choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    flash, efficient = SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION
    torch.manual_seed(0)
    q32 = torch.randn(2, 4, 16, 64)
    with course.emulate(gpus=1):
        q, q16 = q32.cuda(), q32.half().cuda()
        refused = [([flash], q, {}, "Expected query, key and value to all be of dtype: {Half, BFloat16}"),
                   ([flash], q16, {"attn_mask": torch.ones(16, 16, dtype=torch.bool, device="cuda")},
                    "Flash Attention does not support non-null attn_mask."),
                   ([efficient], q[..., :6].contiguous(), {}, "divisible by 4"),
                   ([SDPBackend.CUDNN_ATTENTION], q, {}, "Expected query, key and value")]
        for backends, query, kwargs, reason in refused:
            with sdpa_kernel(backends), warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                with pytest.raises(RuntimeError, match="No available kernel. Aborting execution."):
                    torch.nn.functional.scaled_dot_product_attention(query, query, query, **kwargs)
            assert any(reason in str(w.message) for w in said), [str(w.message) for w in said]
        want = torch.nn.functional.scaled_dot_product_attention(q32, q32, q32, is_causal=True)
        for backends, query in (([flash], q16), ([efficient], q), ([flash, efficient], q)):
            with sdpa_kernel(backends):
                got = torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)
            torch.testing.assert_close(got.float().cpu(), want, atol=1e-2, rtol=1e-2)
        with sdpa_kernel([flash]), torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.nn.functional.scaled_dot_product_attention(q, q, q).dtype == torch.bfloat16
    with course.emulate(gpus=1, gpu="V100"), sdpa_kernel([flash]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="No available kernel"):
            torch.nn.functional.scaled_dot_product_attention(*(q32.half().cuda(),) * 3)


def test_sdpa_checks_heads_and_dtypes_before_its_fused_kernel_as_cuda_does(emu):
    """Grouped key/value heads without `enable_gqa`, and mixed dtypes, ran through the emulator's fused CPU op; a GPU
    stops in `validate_sdpa_input` (mixed dtypes) or, its fused kernels refusing unequal heads
    (`check_batch_size_and_num_heads_dense`, sdp_utils_cpp.h), in the math fallback: plain CPU torch's errors. A
    single key/value head broadcasts there as on the CPU. With `enable_gqa`, flash takes the groups; the
    memory-efficient kernel never does, so with only it enabled a GPU finds no kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.manual_seed(0)
    q, kv, kv1 = torch.randn(2, 8, 16, 64), torch.randn(2, 2, 16, 64), torch.randn(2, 1, 16, 64)
    for args in ((q, kv, kv), (q.half(), q, q), (q, kv, kv.repeat(1, 2, 1, 1))):
        with pytest.raises(RuntimeError) as on_cpu:
            sdpa(*args)
        with pytest.raises(RuntimeError, match=re.escape(str(on_cpu.value))):
            sdpa(*(t.cuda() for t in args))
    torch.testing.assert_close(sdpa(q.cuda(), kv1.cuda(), kv1.cuda()).cpu(), sdpa(q, kv1, kv1))
    grouped = sdpa(q, kv, kv, enable_gqa=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        got = sdpa(q.half().cuda(), kv.half().cuda(), kv.half().cuda(), enable_gqa=True)
    torch.testing.assert_close(got.float().cpu(), grouped, atol=1e-2, rtol=1e-2)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="No available kernel. Aborting execution."):
            sdpa(q.cuda(), kv.cuda(), kv.cuda(), enable_gqa=True)
    assert any("both fused kernels require query, key and value to have the same num_heads" in str(w.message)
               for w in said)


def test_sdpa_takes_empty_sequences_and_broadcast_batches_to_math_as_a_gpu_does(emu):
    """A zero-length sequence killed the process with SIGFPE (the CPU's fused kernel divides by it) and a broadcast
    batch failed in the FLOP count: a GPU's fused kernels refuse both (sdp_utils_cpp.h) and math attention computes
    them, as plain CPU torch does; with math off they stop with the fused kernels' own warnings, as do 3-D inputs, and
    what cuDNN alone takes (head sizes that differ) is computed, where the CPU's SDPA found no backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    empty, full, one = torch.rand(2, 2, 0, 8), torch.rand(2, 2, 3, 8), torch.rand(1, 2, 3, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert sdpa(empty.cuda(), empty.cuda(), empty.cuda()).shape == (2, 2, 0, 8)
    torch.testing.assert_close(sdpa(one.cuda(), full.cuda(), full.cuda()).cpu(), sdpa(one, full, full))
    for inputs, reason in (((empty,) * 3, "All fused kernels do not support zero seq_len_q or seq_len_kv."),
                           ((one, full, full), "require query, key and value to have the same batch_size"),
                           ((full[0],) * 3, "All fused kernels requires query, key and value to be 4 dimensional")):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match="No available kernel"):
                sdpa(*(t.half().cuda() for t in inputs))
        assert any(reason in str(w.message) for w in said), [str(w.message) for w in said]
    q, v = torch.rand(1, 2, 8, 16, dtype=torch.bfloat16), torch.rand(1, 2, 8, 8, dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # cuDNN takes key and value head sizes that differ; the CPU not
        got = sdpa(q.cuda(), q.cuda(), v.cuda())
    assert torch.equal(got.cpu(), sdpa(q, q, v))


def test_sync_debug_mode_flags_the_operations_that_wait_for_the_gpu(emu):
    """torch.cuda.set_sync_debug_mode: 'warn' warns with PyTorch's words at blocking copies, .item(), a stream's
    synchronize, nonzero, boolean-mask indexing and assignment, repeat_interleave without output_size (sized by
    the GPU's data) and host index tensors (copied over from pageable memory), not at non-blocking copies, plain
    kernels, GPU index tensors, a mask filled with a number (ATen's masked_fill_) or an output_size given; 'error'
    raises;
    'default' is silent, and get_sync_debug_mode gives the mode back as PyTorch's integer."""
    x = torch.randn(64, 64).cuda()
    rows, repeats = torch.tensor([0, 2], device="cuda"), torch.tensor([2, 1], device="cuda")
    host_rows = rows.cpu()
    torch.cuda.set_sync_debug_mode("warn")
    assert torch.cuda.get_sync_debug_mode() == 1
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        y = x @ x
        x.to("cuda:1", non_blocking=True)
        torch.randn(8).to("cuda", non_blocking=True)
        y[rows], y[rows], y[y > 5] = y[rows] * 2, 0.0, 5.0
        torch.repeat_interleave(y[:2], repeats, dim=0, output_size=3)
    assert not [w for w in quiet if "synchronizing" in str(w.message)]
    for syncing in (lambda: y.sum().item(), lambda: torch.nonzero(y > 0), lambda: y[y > 0], lambda: y.cpu(),
                    lambda: torch.cuda.current_stream().synchronize(), lambda: y[host_rows],
                    lambda: y.index_put_((y > 0,), y[0, 0]), lambda: torch.repeat_interleave(y[:2], repeats, dim=0)):
        with pytest.warns(UserWarning, match="called a synchronizing CUDA operation"):
            syncing()
    torch.cuda.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
        torch.nonzero(y > 0)
    torch.cuda.set_sync_debug_mode(0)
    assert torch.nonzero(y > 0).shape[0] == int((y.cpu() > 0).sum())


def test_torchscript_of_gpu_modules_runs_and_saves_their_values(emu, tmp_path):
    """torch.jit.script and trace of a GPU module give eager's numbers; saving one (which crashed the process with a
    segmentation fault, or wrote zeros once its parameters moved back to the host) writes the values, which load
    on the CPU, or onto a GPU with map_location (which PyTorch's C++ refused: "not linked with support for cuda")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.ReLU()).cuda().eval()
    x = torch.randn(3, 6).cuda()
    want = model(x).cpu()
    scripted, traced = torch.jit.script(model), torch.jit.trace(model, x)
    torch.testing.assert_close(scripted(x).cpu(), want)
    torch.testing.assert_close(traced(x).cpu(), want)
    torch.jit.save(traced, tmp_path / "traced.pt")
    scripted.save(str(tmp_path / "scripted.pt"))
    assert all(p.is_cuda for p in scripted.parameters()) and all(p.is_cuda for p in traced.parameters())
    for name in ("traced.pt", "scripted.pt"):
        torch.testing.assert_close(torch.jit.load(tmp_path / name, map_location="cpu")(x.cpu()), want)
    model.cpu()  # the scripted module holds the parameters: they move by `.data =` and stay emulated tensors
    torch.jit.save(torch.jit.script(model), tmp_path / "moved.pt")
    torch.testing.assert_close(torch.jit.load(tmp_path / "moved.pt")(x.cpu()), want)
    on_gpu = torch.jit.load(tmp_path / "traced.pt", map_location="cuda:1")
    assert {p.device for p in list(on_gpu.parameters()) + list(on_gpu.buffers())} == {torch.device("cuda:1")}
    torch.testing.assert_close(on_gpu(x.to("cuda:1")).cpu(), want)

def test_torchscript_loads_back_onto_the_gpus_it_was_saved_from(emu, tmp_path):
    """A GPU box's TorchScript file records each tensor's device, and `torch.jit.load(path)` puts it back there. The
    emulator's files hold host tensors, so such a load gave a CPU module (then "Expected all tensors to be on the same
    device", or CPU work where GPU work was meant); the file now names the GPUs. A program's own extra files still
    save and load, and tracing no longer warns that the emulator's bookkeeping "might not generalize"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.ReLU()).to("cuda:1").eval()
    x = torch.randn(3, 6, device="cuda:1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, x)
    torch.jit.save(traced, tmp_path / "m.pt", _extra_files={"meta.txt": "v1"})
    extra = {"meta.txt": ""}
    loaded = torch.jit.load(tmp_path / "m.pt", _extra_files=extra)
    assert extra == {"meta.txt": b"v1"}
    assert {p.device for p in list(loaded.parameters()) + list(loaded.buffers())} == {torch.device("cuda:1")}
    torch.testing.assert_close(loaded(x).cpu(), model(x).cpu())


def test_jit_trace_of_a_gpu_convolution_records_it(emu, tmp_path):
    """PyTorch's tracer records a convolution as `aten::_convolution`, never `convolution`: traced on emulated
    GPUs, a conv net failed ("data is not allocated yet") as its output was missing from the trace. Now the trace
    holds the convolution, runs on new inputs with eager's numbers and gradients, and saves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 2, 1, stride=2)).cuda().eval()
    traced = torch.jit.trace(model, torch.randn(2, 3, 8, 8).cuda())
    assert [n.kind() for n in traced.inlined_graph.nodes()].count("aten::_convolution") == 2
    x = torch.randn(1, 3, 6, 6).cuda().requires_grad_()
    out = traced(x)
    torch.testing.assert_close(out.cpu(), model(x).cpu())
    out.sum().backward()
    cpu_x = x.detach().cpu().requires_grad_()
    model.cpu()(cpu_x).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), cpu_x.grad)
    torch.jit.save(traced, tmp_path / "conv.pt")
    torch.testing.assert_close(torch.jit.load(tmp_path / "conv.pt", map_location="cpu")(cpu_x.detach()),
                               out.detach().cpu())


def test_torch_gc_helper_of_chat_demos_runs(emu):
    """`torch_gc()` as chat-model web demos write it: empty_cache then ipc_collect (which raised "not modelled")
    inside `torch.cuda.device`; the memory of live tensors stays counted, that of freed ones is gone."""
    keep = torch.ones(1024, device="cuda:1")
    drop = torch.ones(2048, device="cuda:1")
    del drop
    with torch.cuda.device("cuda:1"):
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated(1) == keep.numel() * 4 and torch.cuda.memory_reserved(1) == 4096


def test_sparse_embedding_trains_with_sparse_adam_as_on_the_host(emu):
    """SparseAdam makes its update with the legacy `grad.new(indices, values, size)`, which checks nothing and says
    nothing; the emulator's version warned that sparse invariant checks were off. The steps give the host's values."""
    def train(device):
        torch.manual_seed(0)
        emb = nn.Embedding(20, 4, sparse=True).to(device)
        opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            emb(torch.tensor([1, 3, 3, 7], device=device)).square().sum().backward()
            opt.step()
        assert emb.weight.grad.is_sparse
        return emb.weight.detach().cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on_gpu = train("cuda:1")
    torch.testing.assert_close(on_gpu, train("cpu"))


def test_a_parameters_class_rebuilds_it_as_accelerate_does(emu):
    """accelerate's set_module_tensor_to_device: `type(param)(value, requires_grad=..., **param.__dict__)`."""
    layer, host = nn.Linear(3, 2).to("cuda:1"), nn.Linear(3, 2)
    param = layer.weight
    rebuilt = type(param)(torch.ones(2, 3, device="cuda:1"), requires_grad=False, **param.__dict__)
    assert isinstance(rebuilt, nn.Parameter) and rebuilt.device == torch.device("cuda:1")
    assert not rebuilt.requires_grad and rebuilt.is_leaf and rebuilt.cpu().sum().item() == 6.0
    layer._parameters["weight"] = rebuilt
    expected = nn.functional.linear(torch.ones(1, 3), torch.ones(2, 3), host.bias.data.copy_(layer.bias.cpu()))
    torch.testing.assert_close(layer(torch.ones(1, 3, device="cuda:1")).cpu(), expected.detach())
    from_host = type(param)(torch.ones(2))
    assert type(from_host) is nn.Parameter and from_host.requires_grad  # a host tensor makes a host Parameter
    param.tag = "mine"
    with pytest.raises(TypeError, match="unexpected keyword argument 'tag'"):  # as Parameter.__new__ refuses it
        type(param)(torch.ones(2, device="cuda:1"), **param.__dict__)


def test_copying_a_parameters_attributes_copies_only_the_programs(emu):
    """`moved.__dict__.update(param.__dict__)` (loaders carrying `weight_loader` over): a GPU box's parameter has no
    other attributes, so the moved one keeps its own device and values."""
    param = nn.Parameter(torch.ones(3, device="cuda:1"))
    param.weight_loader = "load"
    moved = nn.Parameter(param.detach().to("cuda:0") * 2)
    moved.__dict__.update(param.__dict__)
    assert moved.device == torch.device("cuda:0") and moved.cpu().tolist() == [2.0, 2.0, 2.0]
    assert vars(moved) == {"weight_loader": "load"} == vars(param)
    assert isinstance(moved, nn.Parameter) and isinstance(copy.deepcopy(moved), nn.Parameter)
    del moved.__dict__["weight_loader"]
    assert not hasattr(moved, "weight_loader") and moved.device == torch.device("cuda:0")


def test_module_moves_keep_a_parameters_attributes(emu):
    """`param.data = ...` (Module.to on a GPU box) keeps what a program set on a parameter; the emulator's swap too."""
    layer = nn.Linear(2, 2)
    layer.weight.weight_loader = "load"
    reference = nn.Linear(2, 2).half()  # plain CPU torch's conversion, for the values
    reference.load_state_dict(layer.state_dict())
    layer.to("cuda:1").half()
    assert layer.weight.weight_loader == "load" and vars(layer.weight) == {"weight_loader": "load"}
    assert layer.weight.device == torch.device("cuda:1") and layer.weight.dtype == torch.float16
    torch.testing.assert_close(layer.weight.cpu(), reference.weight.detach())
