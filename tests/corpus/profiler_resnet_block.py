"""Profiling a few training steps of a small residual CNN with torch.profiler, as the tutorials do."""
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

# Ops and ranges worth reading in the table; a CPU run and a GPU run both show these.
WATCHED = {
    "ProfilerStep*", "forward", "backward", "optimizer", "aten::conv2d", "aten::convolution",
    "aten::batch_norm", "aten::relu", "aten::add", "aten::adaptive_avg_pool2d", "aten::linear",
    "aten::cross_entropy_loss", "aten::addmm", "Optimizer.step#SGD.step",
    "Optimizer.zero_grad#SGD.zero_grad",
}


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class TinyResNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.block = ResidualBlock(16)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.block(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyResNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images = torch.randn(8, 3, 16, 16)
    labels = torch.randint(0, 10, (8,))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    log_dir = tempfile.mkdtemp(prefix="profiler_resnet_")
    losses = []
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(log_dir), record_shapes=True) as prof:
        for step in range(5):
            x, y = images.to(device), labels.to(device)
            with record_function("forward"):
                loss = F.cross_entropy(model(x), y)
            with record_function("backward"):
                optimizer.zero_grad()
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
            losses.append(loss.item())
            prof.step()

    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    averages = prof.key_averages()
    print(averages.table(sort_by=sort_by, row_limit=10))
    traces = os.listdir(log_dir)
    with open(os.path.join(log_dir, traces[0])) as f:
        trace_events = json.load(f)["traceEvents"]
    result = {
        "losses": losses,
        "fc_weight_sum": model.fc.weight.sum().item(),
        "stem_grad_norm": model.stem.weight.grad.norm().item(),
        "ops": sorted({e.key for e in averages} & WATCHED),
        "traces_written": len(traces),
        "forward_ranges_in_trace": sum(e.get("name") == "forward" for e in trace_events),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
