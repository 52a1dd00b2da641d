"""Single-GPU tutorial and training-script idioms: a spatial transformer (affine_grid, grid_sample, interpolate), a DQN
step (replay memory, gather, max(1).values, smooth L1, clip_grad_value_, soft target update through state dicts),
a timm/HF-style loop written from scratch (no-decay param groups, warmup-cosine LambdaLR, gradient accumulation,
TF32 flags, channels_last, EMA with _foreach_lerp_, GradScaler, save and resume), inference_mode, torch.compile
(the eager backend: inductor compiling C++ would double the plain run) and jit.trace of a GPU model, the
data-dependent ops scripts sprinkle around, and a gradient that backward makes from sizes alone."""
import copy
import io
import json
import math
import random
from collections import deque, namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
torch.set_float32_matmul_precision("high")
torch.manual_seed(0)
random.seed(0)
out = {}

# spatial transformer: the localisation net starts at the identity transform, gradients flow through the sampler
loc = nn.Sequential(nn.Conv2d(1, 4, 5), nn.MaxPool2d(2), nn.ReLU(True), nn.Flatten(), nn.Linear(144, 6)).to(device)
loc[-1].weight.data.zero_()
loc[-1].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))
head = nn.Linear(16 * 16, 3).to(device)
opt = torch.optim.SGD(list(loc.parameters()) + list(head.parameters()), lr=0.05)
images, classes = torch.randn(4, 1, 16, 16).to(device), torch.tensor([0, 1, 2, 1]).to(device)
out["stn"] = []
for _ in range(2):
    opt.zero_grad()
    grid = F.affine_grid(loc(images).view(-1, 2, 3), images.size(), align_corners=False)
    warped = F.grid_sample(images, grid, align_corners=False)
    loss = F.cross_entropy(head(warped.flatten(1)), classes)
    loss.backward()
    opt.step()
    out["stn"].append([loss.item(), loc[-1].weight.grad.abs().sum().item()])
ramp = torch.arange(16.0, device=device).view(1, 1, 4, 4).requires_grad_()
for mode, corners in [("nearest", None), ("bilinear", False), ("bicubic", True), ("area", None)]:
    resized = F.interpolate(ramp, scale_factor=2, mode=mode, align_corners=corners)
    resized.sum().backward()
    out[f"interpolate_{mode}"] = [resized.sum().item(), ramp.grad.sum().item()]
    ramp.grad = None

# DQN: transitions in a deque, a terminal state masked out, the target net following by a soft update
Transition = namedtuple("Transition", ("state", "action", "next_state", "reward"))
policy = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
target = copy.deepcopy(policy)
target.load_state_dict(policy.state_dict())
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, amsgrad=True)
memory, g = deque([], maxlen=50), torch.Generator().manual_seed(1)
for t in range(12):
    state = torch.randn(1, 4, generator=g).to(device)
    with torch.no_grad():
        action = policy(state).max(1).indices.view(1, 1)
    next_state = None if t % 5 == 4 else torch.tensor(torch.randn(4, generator=g).tolist(), device=device).unsqueeze(0)
    memory.append(Transition(state, action, next_state, torch.tensor([1.0 if action.item() else 0.5], device=device)))
out["dqn"] = []
for _ in range(3):
    batch = Transition(*zip(*random.sample(memory, 6)))
    non_final = torch.tensor(tuple(s is not None for s in batch.next_state), device=device, dtype=torch.bool)
    values = policy(torch.cat(batch.state)).gather(1, torch.cat(batch.action))
    next_values = torch.zeros(6, device=device)
    with torch.no_grad():
        next_values[non_final] = target(torch.cat([s for s in batch.next_state if s is not None])).max(1).values
    loss = nn.SmoothL1Loss()(values, (next_values * 0.99 + torch.cat(batch.reward)).unsqueeze(1))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_value_(policy.parameters(), 100)
    opt.step()
    target_state, policy_state = target.state_dict(), policy.state_dict()
    for key in policy_state:
        target_state[key] = policy_state[key] * 0.005 + target_state[key] * (1 - 0.005)
    target.load_state_dict(target_state)
    out["dqn"].append([loss.item(), target[2].weight.sum().item()])


# a timm-style loop: weight decay off for norms and biases, warmup then cosine, two micro-batches per step
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.norm, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.LayerNorm(8), nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.norm(F.gelu(self.stem(x)).mean((2, 3))))


model = Net().to(device).to(memory_format=torch.channels_last)
ema = copy.deepcopy(model).eval()
decay = [p for n, p in model.named_parameters() if p.ndim > 1]
no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
warmup, total = 2, 6
schedule = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
g = torch.Generator().manual_seed(2)
batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(2 * total)]


def train(start, stop):
    history = []
    for step in range(start, stop):
        for micro in range(2):
            x, y = batches[2 * step + micro]
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(model(x), y.to(device, non_blocking=True), label_smoothing=0.1) / 2
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
        history.append([2 * loss.item(), norm.item(), schedule.get_last_lr()[0]])
    return history


out["timm_first"] = train(0, 3)
buffer = io.BytesIO()
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "schedule": schedule.state_dict(),
            "scaler": scaler.state_dict(), "ema": ema.state_dict(), "step": 3}, buffer)
buffer.seek(0)
checkpoint = torch.load(buffer, map_location=device)
model.load_state_dict(checkpoint["model"])
opt.load_state_dict(checkpoint["opt"])
schedule.load_state_dict(checkpoint["schedule"])
scaler.load_state_dict(checkpoint["scaler"])
ema.load_state_dict(checkpoint["ema"])
out["timm_resumed"] = train(checkpoint["step"], total)
out["ema"] = torch.lerp(ema.head.weight, model.head.weight, 0.5).sum().item()
out["channels_last"] = model.stem.weight.is_contiguous(memory_format=torch.channels_last)
out["optimizer_state_on_device"] = next(iter(opt.state.values()))["exp_avg"].device.type == device
with torch.inference_mode():
    probs = F.softmax(model(torch.randn(2, 3, 8, 8, generator=g).to(device)), 1)
out["inference"] = [probs.sum(1).tolist(), probs.is_inference()]
mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
x = torch.randn(3, 4, generator=g).to(device)
out["compiled_and_traced"] = [torch.compile(mlp, backend="eager")(x).sum().item(),
                              torch.jit.trace(mlp, x)(x).sum().item()]

values = torch.randn(6, 8, generator=g).to(device)
index = torch.randint(0, 5, (20,), generator=g).to(device)
unique, inverse, counts = torch.unique(index, return_inverse=True, return_counts=True)
out["data_dependent"] = {
    "topk": values.topk(3, dim=1).indices.tolist(), "sort": values.sort(dim=0, stable=True).indices[0].tolist(),
    "unique": [unique.tolist(), inverse.tolist(), counts.tolist()],
    "bincount": torch.bincount(index, minlength=7).tolist(),
    "index_add": torch.zeros(5, 8, device=device).index_add_(0, index[:6], values).sum(1).tolist(),
    "scatter_amax": torch.zeros(5, device=device).scatter_reduce(0, index[:8], values[0], "amax",
                                                                 include_self=False).tolist(),
    "nonzero": torch.nonzero(values > 1).tolist(), "masked_select": values.masked_select(values < -1).tolist(),
    "where": torch.where(values > 0, values, -1.0).sum().item(),
    "multinomial_shape": list(torch.multinomial(torch.softmax(values, 1), 3).shape),
    "normal_log_prob": torch.distributions.Normal(values[0], values[1].exp()).log_prob(values[2]).sum().item(),
}
sign_source, sign = (torch.randn(3, generator=g).to(device).requires_grad_() for _ in range(2))
torch.copysign(sign_source, sign).sum().backward()  # the sign's gradient is zeros made from its sizes alone
out["copysign_grads"] = [sign.grad.device.type == device, sign.grad.tolist(), sign_source.grad.tolist()]
print("RESULT", json.dumps(out))
