"""Everyday single-GPU idioms: RNNs under inference_mode, AdamW in its three implementations with gradient
clipping, half and bf16 modules, and the small ops scripts sprinkle around (sort, where, nonzero, unique, masks)."""
import torch, torch.nn as nn, torch.nn.functional as F, json
def run(dev):
    out = {}
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True).to(dev)
    x = torch.randn(3, 5, 8).to(dev)
    with torch.inference_mode():
        y, (h, c) = lstm(x)
    out["lstm"] = y.sum().item()
    with torch.no_grad():
        out["gru"] = nn.GRU(8, 4).to(dev)(x)[0].sum().item()
    torch.manual_seed(1)
    m = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 4, 10)).to(dev)
    for fused, foreach in [(False, False), (False, True), (True, False)]:
        torch.manual_seed(1)
        m = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 4, 10)).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused, foreach=foreach)
        for s in range(3):
            idx = torch.randint(0, 50, (6, 4), generator=torch.Generator().manual_seed(s)).to(dev)
            loss = F.cross_entropy(m(idx), (idx[:, 0] % 10))
            loss.backward()
            n = nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step(); opt.zero_grad()
        out[f"adamw_fused{fused}_foreach{foreach}"] = [loss.item(), n.item()]
    mh = nn.Linear(4, 4).to(dev).half() if dev != "cpu" else nn.Linear(4, 4).half()
    out["half_dtype"] = str(mh.weight.dtype)
    mb = nn.Linear(4, 4).to(dev).bfloat16()
    out["bf16"] = mb(torch.ones(2, 4, device=dev, dtype=torch.bfloat16)).float().sum().item() is not None
    t = torch.arange(10.0, device=dev)
    out["cumsum"] = t.cumsum(0)[-1].item(); out["sort"] = t.flip(0).sort().values[:3].tolist()
    out["where"] = torch.where(t > 4, t, torch.zeros_like(t)).sum().item()
    out["einsum"] = torch.einsum("i,i->", t, t).item()
    out["nonzero"] = (t > 7).nonzero().flatten().tolist()
    out["unique"] = torch.unique(torch.tensor([3, 1, 3, 2], device=dev)).tolist()
    out["bool_index"] = t[t > 6].tolist()

    out["argmax"] = int(t.argmax())
    return out

print("RESULT", json.dumps(run("cuda" if torch.cuda.is_available() else "cpu")))
