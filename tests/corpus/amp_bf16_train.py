"""Mixed-precision training of a tiny GPT-style model with bf16 autocast (no GradScaler needed for bf16).

The usual idiom: the forward pass and the loss inside `torch.autocast(device_type=device, dtype=torch.bfloat16)`,
backward and the optimizer step outside it; parameters and their gradients stay float32.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"

VOCAB, CONTEXT, WIDTH, HEADS = 32, 16, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


# A toy corpus: the next token is the current one plus one (mod VOCAB), so the loss can fall.
data = (torch.arange(2048) * 7 % VOCAB + torch.arange(2048) // 64) % VOCAB
model = TinyGPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
losses = []
for step in range(8):
    starts = torch.randint(0, len(data) - CONTEXT - 1, (8,))
    x = torch.stack([data[s:s + CONTEXT] for s in starts]).to(device)
    y = torch.stack([data[s + 1:s + CONTEXT + 1] for s in starts]).to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    losses.append(loss.item())
    print(f"step {step} loss {loss.item():.4f} grad norm {grad_norm.item():.4f}")

result = {
    "losses": losses,
    "last_grad_norm": grad_norm.item(),
    "head_weight_sum": model.head.weight.sum().item(),
    "logits_dtype": str(logits.dtype),
    "loss_dtype": str(loss.dtype),
    "param_dtype": str(model.head.weight.dtype),
    "grad_dtype": str(model.head.weight.grad.dtype),
    # bf16 keeps 8 bits of mantissa, and CPU and CUDA autocast lists differ (see the report): loose tolerances.
    "_tolerance": [1e-2, 1e-2],
}
print("RESULT " + json.dumps(result))
