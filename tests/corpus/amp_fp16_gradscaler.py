"""fp16 mixed precision with a GradScaler, the recipe from the AMP docs: scale the loss, unscale before clipping,
let the scaler skip the step whose gradients overflowed and back the scale off.

Batch 3 is scaled up so much that its scaled fp16 gradients overflow: that step must be skipped on every device.
"""
import json

import torch
import torch.nn as nn

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=3)
loss_fn = nn.CrossEntropyLoss()

inputs, targets = torch.randn(10, 32, 16), torch.randint(0, 4, (10, 32))
inputs[3] *= 1e4  # fp16 tops out at 65504: this batch's loss times the scale overflows in backward

losses, scales, skipped = [], [], []
for step in range(10):
    x, y = inputs[step].to(device), targets[step].to(device)
    optimizer.zero_grad()
    with torch.autocast(device_type=device, dtype=torch.float16):
        hidden = model[:2](x)
        logits = model[2:](hidden)
        loss = loss_fn(logits, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    skipped.append(int(scaler.get_scale() < scale_before))
    scales.append(scaler.get_scale())
    losses.append(loss.item())
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")

result = {
    "losses": losses,
    "scales": scales,
    "skipped_steps": skipped,
    "weight_sum": sum(p.sum().item() for p in model.parameters()),
    "hidden_dtype": str(hidden.dtype),
    "logits_dtype": str(logits.dtype),
    "loss_dtype": str(loss.dtype),
    # fp16 rounding, and CPU vs CUDA autocast lists differ for cross_entropy (see the report).
    "_tolerance": [1e-2, 1e-2],
}
print("RESULT " + json.dumps(result))
