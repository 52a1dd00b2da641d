"""A small GPT fine-tuning script in the style of popular single-file trainers: decoupled weight decay groups,
warmup + cosine LambdaLR, bf16 autocast, gradient accumulation, activation checkpointing, clipping, a
checkpoint, then sampling with a KV cache under inference_mode and a seeded generator."""
import json
import math
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1337)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.heads = heads

    def attend(self, x, cache=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None or t > 1)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))

    def forward(self, x, cache=None):
        x = x + self.attend(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2, ctx=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.grad_ckpt = True

    def forward(self, idx, caches=None, start=0):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(start, start + t, device=idx.device))
        for i, block in enumerate(self.blocks):
            if caches is not None:
                x = block(x, caches[i])
            elif self.grad_ckpt and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln(x))


model = GPT().to(device)
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=3e-3, betas=(0.9, 0.95), fused=device == "cuda")
warmup, total = 2, 8
sched = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
data = torch.randint(0, 64, (4096,), generator=torch.Generator().manual_seed(0))
accum, losses = 2, []
for step in range(total):
    for micro in range(accum):
        ix = torch.randint(0, len(data) - 17, (8,), generator=torch.Generator().manual_seed(step * 10 + micro))
        x = torch.stack([data[i:i + 16] for i in ix]).to(device, non_blocking=True)
        y = torch.stack([data[i + 1:i + 17] for i in ix]).to(device, non_blocking=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / accum
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    losses.append(round(loss.item() * accum, 4))

path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": total}, path)
fresh = GPT().to(device)
state = torch.load(path, map_location=device)
fresh.load_state_dict(state["model"])

fresh.eval()
gen = torch.Generator(device=device).manual_seed(42)
idx = torch.zeros((1, 1), dtype=torch.long, device=device)
caches = [{} for _ in fresh.blocks]
out = []
with torch.inference_mode():
    logits = fresh(idx, caches, 0)
    for pos in range(1, 12):
        probs = F.softmax(logits[:, -1, :].float() / 0.8, dim=-1)
        top = torch.topk(probs, 10)
        nxt = top.indices.gather(-1, torch.multinomial(top.values, 1, generator=gen))
        out.append(int(nxt))
        logits = fresh(nxt, caches, pos)
    full = fresh(torch.cat([idx, torch.tensor([out], device=device)], dim=1))
print("RESULT", json.dumps({"losses": losses, "lr": sched.get_last_lr()[0], "grad_norm": float(norm),
                            "tokens": out, "kv_cache_matches_full": bool(torch.allclose(
                                full[0, -1].float(), logits[0, -1].float(), atol=2e-2)),
                            "tied": fresh.head.weight.data_ptr() == fresh.tok.weight.data_ptr(),
                            "_tolerance": [2e-2, 2e-2]}))
