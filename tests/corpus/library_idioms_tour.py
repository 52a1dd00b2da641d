"""Code from libraries and tutorials beyond the training loop, on one GPU:

- memory-saving tools: activation checkpointing (non-reentrant, reentrant with dropout, checkpoint_sequential),
  saved activations offloaded to pinned host memory with `save_on_cpu`, and the allocator's memory history
  (`_record_memory_history`, `_snapshot`, `_dump_snapshot`); every variant must give the plain forward's loss and
  gradients exactly (checkpointing restores the RNG state), and the memory tools run only on GPUs;
- serving-style generation: a KV cache written slice by slice under `inference_mode`, prompts copied from pinned
  memory on a side stream, timed with CUDA events, then temperature, top-k, top-p, a repetition penalty and
  `torch.multinomial` from a seeded `torch.Generator` on the device;
- fused-kernel and research code: autograd.Functions with custom_fwd/custom_bwd under autocast, a backward that
  makes its buffers on the gradient's device, torch.func per-sample gradients (vmap of grad of a vector-matrix
  product), and in-place view ops (`t_`, `transpose_`, `squeeze_`, `as_strided_`) and out= tensors of another shape.
"""
import json
import os
import pickle
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.amp import custom_bwd, custom_fwd
from torch.func import functional_call, grad, jacrev, vmap
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dev = device.type
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.drop = nn.LayerNorm(d), nn.Dropout(0.1)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.ln(x)))))


class Net(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.blocks, self.mode = nn.ModuleList(Block(32) for _ in range(4)), mode

    def forward(self, x):
        if self.mode == "sequential":
            return checkpoint_sequential(nn.Sequential(*self.blocks), 2, x, use_reentrant=False).pow(2).mean()
        for b in self.blocks:
            if self.mode == "nonreentrant":
                x = checkpoint(b, x, use_reentrant=False)
            elif self.mode == "reentrant":
                x = checkpoint(b, x, use_reentrant=True, preserve_rng_state=True)
            else:
                x = b(x)
        return x.pow(2).mean()


def memory_saving_tools():
    result, base = {}, None
    if dev == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100000)
    for mode in ["plain", "nonreentrant", "reentrant", "sequential", "save_on_cpu"]:
        torch.manual_seed(0)
        net = Net(mode).to(device)
        x = torch.randn(8, 16, 32, device=device, requires_grad=True)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(5)
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = net(x)
        else:
            loss = net(x)
        loss.backward()
        grads = torch.cat([x.grad.flatten()] + [p.grad.flatten() for p in net.parameters()])
        base = grads if base is None else base
        result[mode] = {"loss": loss.item(), "grad_norm": grads.norm().item(),
                        "grad_on_input_device": x.grad.device == x.device,
                        "max_diff_vs_plain": (grads - base).abs().max().item()}
    if dev == "cuda":
        snapshot = torch.cuda.memory._snapshot()
        path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(path, "rb") as f:
            dumped = pickle.load(f)
        actions = {e["action"] for e in snapshot["device_traces"][0]}
        mine = any(f["filename"] == __file__ for e in snapshot["device_traces"][0] for f in e["frames"])
        result["memory_tools"] = [{"alloc", "free_requested"} <= actions, mine, len(dumped["device_traces"]) > 0,
                                  torch.cuda.max_memory_allocated() > 0]
    else:
        result["memory_tools"] = [True, True, True, True]
    return result


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, cache, pos):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        cache[0][:, :, pos:pos + T] = k
        cache[1][:, :, pos:pos + T] = v
        y = F.scaled_dot_product_attention(q, cache[0][:, :, :pos + T], cache[1][:, :, :pos + T], is_causal=T > 1)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class LM(nn.Module):
    def __init__(self, vocab=40, d=32, heads=4, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.layers = nn.ModuleList(Attention(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, caches, pos):
        x = self.tok(idx) + self.pos(torch.arange(pos, pos + idx.shape[1], device=idx.device))
        for layer, cache in zip(self.layers, caches):
            x = x + layer(x, cache, pos)
        return self.head(self.norm(x))


def filter_top_k_top_p(logits, k=8, p=0.9):
    kth = torch.topk(logits, k).values[..., -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = torch.sort(logits, descending=True)
    remove = sorted_logits.softmax(-1).cumsum(-1) > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def kv_cache_serving():
    torch.manual_seed(0)
    model = LM().to(device).eval()
    prompts = torch.randint(0, 40, (3, 5))
    if device.type == "cuda":
        copy_stream = torch.cuda.Stream()
        with torch.cuda.stream(copy_stream):
            idx = prompts.pin_memory().to(device, non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy_stream)
        idx.record_stream(torch.cuda.current_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        idx = prompts
    caches = [torch.zeros(2, 3, 4, 64, 8, device=device) for _ in model.layers]
    generator = torch.Generator(device=device).manual_seed(123)
    tokens, top_probs = [idx], []
    with torch.inference_mode():
        logits = model(idx, caches, 0)[:, -1]
        pos = idx.shape[1]
        for _ in range(10):
            seen = torch.cat(tokens, 1)
            score = torch.gather(logits, 1, seen)
            logits = logits.scatter(1, seen, torch.where(score < 0, score * 1.2, score / 1.2))
            probs = filter_top_k_top_p(logits / 0.8).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            top_probs.append(probs.max(-1).values.tolist())
            tokens.append(nxt)
            logits = model(nxt, caches, pos)[:, -1]
            pos += 1
    out = torch.cat(tokens, 1)
    if device.type == "cuda":
        end.record()
        end.synchronize()
        timed = start.elapsed_time(end) > 0
    else:
        timed = True
    return {"tokens": out.cpu().tolist(), "top_probs": top_probs, "timed": timed,
                                  "cache_norm": caches[0].norm().item(), "inference": out.is_inference(),
                                  "cache_is_inference": caches[0].is_inference()}


class MatmulInherit(torch.autograd.Function):
    @staticmethod
    @custom_fwd(device_type=dev)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @custom_bwd(device_type=dev)
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b.T, a.T @ g


class FP32Softmax(torch.autograd.Function):
    @staticmethod
    @custom_fwd(device_type=dev, cast_inputs=torch.float32)
    def forward(ctx, x):
        y = torch.softmax(x, -1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @custom_bwd(device_type=dev)
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        buffer = torch.empty(g.shape, device=g.device, dtype=g.dtype)
        torch.mul(g * y, 1.0, out=buffer)
        return buffer - y * (g * y).sum(-1, keepdim=True)


def autocast_functions():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 8, generator=g).to(dev).requires_grad_()
    b = torch.randn(8, 8, generator=g).to(dev).requires_grad_()
    with torch.autocast(dev, dtype=torch.bfloat16):
        h = MatmulInherit.apply(a, b)
        s = FP32Softmax.apply(h)
        with torch.autocast(dev, enabled=False):
            plain = h.float() @ b
        mixed = s @ b
        loss = mixed.float().sum() + plain.sum()
    loss.backward()
    return {"dtypes": [str(t.dtype) for t in (h, s, plain, mixed)], "loss": loss.item(),
            "a_grad": a.grad.sum().item(), "b_grad": b.grad.sum().item(), "b_grad_abs": b.grad.abs().sum().item()}


def per_sample_gradients():
    g = torch.Generator().manual_seed(1)
    w, xs = torch.randn(3, 2, generator=g).to(dev), torch.randn(6, 3, generator=g).to(dev)
    vector_matrix = vmap(grad(lambda w, x: (x @ w).tanh().sum()), in_dims=(None, 0))(w, xs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).to(dev)
    params = {n: p.detach() for n, p in model.named_parameters()}
    per_sample = vmap(grad(lambda p, x: functional_call(model, p, (x.unsqueeze(0),)).squeeze()), in_dims=(None, 0))
    grads = per_sample(params, xs)
    jac = jacrev(lambda x: torch.sin(x) * x.sum())(xs[0])
    return {"vector_matrix": vector_matrix.flatten().tolist(),
            "per_sample": {n: t.sum().item() for n, t in grads.items()},
            "jac": jac.flatten().tolist()}


def in_place_views():
    x = torch.arange(12.0, device=dev).view(3, 4)
    t = x.clone().t_()
    tr = x.clone().unsqueeze_(0).transpose_(1, 2)
    sq = x.clone()[:, :1].squeeze_(1)
    st = x.clone().as_strided_((2, 2), (1, 4), 1)
    product = torch.matmul(x, x.T, out=torch.empty(0, device=dev))
    total = torch.sum(x, 0, out=torch.empty(5, device=dev))
    return {"t_": [list(t.shape), t.stride(), t[1].tolist()],
            "transpose_": [list(tr.shape), tr.sum(1).flatten().tolist()],
            "squeeze_": [list(sq.shape), sq.tolist()], "as_strided_": st.tolist(),
            "matmul_out": [list(product.shape), product.tolist()], "sum_out": [list(total.shape), total.tolist()]}


if __name__ == "__main__":
    print("RESULT " + json.dumps({"memory_saving_tools": memory_saving_tools(), "kv_cache_serving": kv_cache_serving(),
                                  "autocast_functions": autocast_functions(), "per_sample": per_sample_gradients(),
                                  "in_place_views": in_place_views(), "_tolerance": [1e-3, 1e-3]}))
