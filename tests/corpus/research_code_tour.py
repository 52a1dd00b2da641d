"""Research and library code beyond the training loop, on GPUs:

- torch.func as its tutorials write it: an ensemble by stack_module_state with the base model moved to 'meta',
  per-sample gradients, and forward-mode jacfwd / hessian of functions that capture GPU tensors;
- the custom-operator tutorial: custom_op with CPU and CUDA kernels, register_fake and register_autograd, an
  old-style Library.impl for "CPU" and "CUDA", gradcheck on the device, opcheck on CPU tensors;
- nn.TransformerEncoder in eval with a padding mask (PyTorch's nested fast path, zeros at padded positions) and
  torch.linalg.lstsq (CUDA's gels driver: residuals filled in, rank empty);
- flex_attention in inference (eager, as without torch.compile) with a causal block mask and an ALiBi score_mod,
  checked against SDPA given the same bias as a (heads, L, S) mask;
- a BiLSTM-CRF tagger in nn.DataParallel whose CRF transitions are read from model.module outside the parallel
  forward, profiled for Nsight with torch.cuda.profiler.profile() and emit_nvtx.
"""
import copy
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, stack_module_state, vmap

use_cuda = torch.cuda.is_available()
device = torch.device("cuda" if use_cuda else "cpu")


def func_transforms():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).to(device) for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(4, 6, device=device)
    ensemble = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)
    per_sample = vmap(grad(lambda p, xi: functional_call(models[0], p, (xi[None],)).square().sum()),
                      in_dims=(None, 0))({k: v.detach() for k, v in models[0].named_parameters()}, x)
    w = torch.randn(5, 5, device=device)

    def f(v):
        return torch.tanh(w @ v).sin()

    v = torch.randn(5, device=device)
    return {"ensemble": ensemble.sum(-1).tolist(), "base_is_meta": base[0].weight.is_meta,
            "per_sample_norms": per_sample["0.weight"].flatten(1).norm(dim=1).tolist(),
            "jacfwd": jacfwd(f)(v).flatten().tolist(),
            "fwd_rev_agree": (jacfwd(f)(v) - jacrev(f)(v)).abs().max().item() < 1e-5,
            "hessian_trace": hessian(lambda v: f(v).sum())(v).trace().item()}


@torch.library.custom_op("corpus_tour::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.sin(x) * scale


@scaled_sin.register_kernel("cuda")
def _(x, scale):
    return torch.sin(x) * scale


scaled_sin.register_fake(lambda x, scale: torch.empty_like(x))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


scaled_sin.register_autograd(lambda ctx, g: (g * torch.cos(ctx.saved_tensors[0]) * ctx.scale, None),
                             setup_context=_setup)
_lib = torch.library.Library("corpus_tour_old", "DEF")
_lib.define("axpy(Tensor x, Tensor y, float a) -> Tensor")
for _key in ("CPU", "CUDA"):
    _lib.impl("axpy", lambda x, y, a: a * x + y, _key)


def custom_ops():
    torch.manual_seed(1)
    x = torch.randn(6, dtype=torch.float64, device=device, requires_grad=True)
    y = scaled_sin(x, 2.0)
    y.sum().backward()
    checks = torch.library.opcheck(scaled_sin, (torch.randn(3, requires_grad=True), 1.5))
    return {"y": y.tolist(), "grad": x.grad.tolist(), "on_device": y.device.type == device.type,
            "gradcheck": torch.autograd.gradcheck(lambda t: scaled_sin(t, 0.5), (x.detach().requires_grad_(),)),
            "axpy": torch.ops.corpus_tour_old.axpy(torch.ones(3, device=device),
                                                   torch.arange(3.0, device=device), 2.5).tolist(),
            "opcheck_cpu": all(v == "SUCCESS" for v in checks.values())}


def encoder_and_lstsq():
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16)).to(device).eval()
    x = torch.randn(3, 6, 16, device=device)
    pad = torch.zeros(3, 6, dtype=torch.bool, device=device)
    pad[0, 4:], pad[2, 2:] = True, True
    with torch.no_grad():
        out = encoder(x, src_key_padding_mask=pad)
    a, b = torch.randn(7, 3, device=device), torch.randn(7, 2, device=device)
    solved = torch.linalg.lstsq(a, b, driver="gels" if not use_cuda else None)
    return {"encoder_sum": out.sum().item(), "pad_rows_equal": bool((out[0, 5] == out[2, 3]).all()),
            "lstsq": solved.solution.flatten().tolist(), "residuals": solved.residuals.tolist(),
            "rank_empty": solved.rank.numel() == 0}


def flex_and_alibi():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 4, 8, 8, device=device) for _ in range(3))
    slopes = torch.exp2(-torch.arange(1, 5, device=device, dtype=torch.float32))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    i = torch.arange(8, device=device)
    bias = (slopes[:, None, None] * (i[None, :] - i[:, None])).masked_fill(i[:, None] < i[None], float("-inf"))
    with torch.inference_mode():
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 8, 8, device=device.type)
        out = flex_attention(q, k, v, score_mod=alibi, block_mask=mask)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return {"flex_sum": out.sum().item(), "flex_vs_sdpa": (out - ref).abs().max().item() < 1e-5}


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 8, bidirectional=True, batch_first=True)
        self.proj = nn.Linear(16, 4)
        self.transitions = nn.Parameter(torch.randn(4, 4) * 0.1)

    def forward(self, tokens):
        self.lstm.flatten_parameters()
        return self.proj(self.lstm(self.embed(tokens))[0])


def crf_tagger():
    torch.manual_seed(3)
    model = Tagger().to(device)
    parallel = nn.DataParallel(model) if use_cuda else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    tokens, tags = torch.randint(1, 20, (6, 5), generator=g), torch.randint(0, 4, (6, 5), generator=g)
    losses = []
    for _ in range(3):
        with torch.cuda.profiler.profile() if use_cuda else torch.autograd.profiler.record_function("step"):
            with torch.autograd.profiler.emit_nvtx(enabled=use_cuda):
                emissions = parallel(tokens)
                score = emissions[:, 0]
                for t in range(1, 5):
                    score = torch.logsumexp(score.unsqueeze(2) + model.transitions + emissions[:, t].unsqueeze(1), 1)
                gold = torch.gather(emissions, 2, tags.to(device).unsqueeze(2)).sum((1, 2))
                loss = (torch.logsumexp(score, 1) - gold).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        losses.append(loss.item())
    return {"losses": losses, "transitions_grad": model.transitions.grad.flatten().tolist()}


print("RESULT " + json.dumps({"func": func_transforms(), "custom_ops": custom_ops(), "encoder": encoder_and_lstsq(),
                              "flex": flex_and_alibi(), "crf": crf_tagger()}))
