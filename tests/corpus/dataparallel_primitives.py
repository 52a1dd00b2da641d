"""nn.DataParallel and its primitives the way PyTorch's own multi-GPU tests exercise them."""
import json
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import data_parallel, gather, parallel_apply, replicate, scatter

Out = namedtuple("Out", ["logits", "hidden"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        hidden = F.relu(self.norm(self.fc(x)))
        return Out(self.head(hidden), hidden)


def main():
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    ids = list(range(min(torch.cuda.device_count(), 4))) if cuda else None
    torch.manual_seed(0)
    net = Net().to(device)
    x = torch.randn(16, 6, device=device)
    result = {}

    out = data_parallel(net, x, device_ids=ids, output_device=0) if cuda else net(x)
    result["data_parallel_logits_sum"] = out.logits.sum().item()

    if cuda:
        replicas = replicate(net, ids)
        inputs = scatter(x, ids)
        outputs = parallel_apply(replicas[:len(inputs)], [(i,) for i in inputs])
        gathered = gather(outputs, 0)
        result["primitives_match"] = torch.allclose(gathered.logits, out.logits, atol=1e-6)
    else:
        result["primitives_match"] = True

    model = nn.DataParallel(net) if cuda else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(4):
        torch.manual_seed(step)
        batch = torch.randn(12, 6)  # CPU batches: DataParallel scatters them
        target = torch.randint(0, 3, (12,))
        opt.zero_grad()
        loss = F.cross_entropy(model(batch.to(device) if not cuda else batch).logits, target.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    result["losses"] = losses
    result["norm_weight"] = net.norm.weight.detach().cpu().tolist()
    result["weights"] = net.fc.weight.detach().cpu().flatten().tolist()[:12]
    result["_tolerance"] = [1e-4, 1e-5]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
