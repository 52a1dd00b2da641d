"""A small ViT-style classifier under nn.DataParallel with CPU batches, as quick multi-GPU scripts train one: its
block in torch.utils.checkpoint (non-reentrant, and reentrant with dropout), nn.MultiheadAttention, label smoothing, OneCycleLR; eval under
inference_mode. Dropout runs only in the reproducibility check (two seeded trainings must give the same losses),
since DataParallel's replicas each draw from their own GPU's generator."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

device = "cuda" if torch.cuda.is_available() else "cpu"


class Block(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p), nn.Linear(2 * d, d))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class ViT(nn.Module):
    def __init__(self, p, reentrant):
        super().__init__()
        self.patch = nn.Conv2d(1, 8, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, 8))
        self.block = Block(8, p)
        self.head = nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1)
        x = checkpoint(self.block, x, use_reentrant=self.reentrant) if self.training else self.block(x)
        return self.head(x[:, 0])


def train(reentrant, p=0.0, steps=2):
    torch.manual_seed(0)
    model = nn.DataParallel(ViT(p, reentrant).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=steps + 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    losses = []
    for _ in range(steps):
        model.train()
        out = model(x)
        loss = F.cross_entropy(out, y.to(out.device), label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    with torch.inference_mode():
        acc = (model(x).argmax(1).cpu() == y).float().mean().item()
    return {"losses": losses, "acc": acc, "checksum": sum(p.double().sum().item() for p in model.parameters())}


result = {"no_dropout": train(False)}
result["dropout_reproducible"] = train(True, p=0.3, steps=1)["losses"] == train(True, p=0.3, steps=1)["losses"]
print("RESULT " + json.dumps(result))
