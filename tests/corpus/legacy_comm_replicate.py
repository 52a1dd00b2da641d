"""The legacy multi-GPU primitives as apex, old Megatron and custom data-parallel wrappers call them:
torch.cuda.comm (broadcast_coalesced of mixed dtypes with a small buffer, reduce_add_coalesced, scatter with
uneven chunk_sizes and streams, gather to the host and along dim 1, broadcast into out=), torch.cuda.nccl called
directly (all_reduce, reduce, broadcast, all_gather, reduce_scatter in fp32 and fp16), and replicate /
scatter_kwargs / parallel_apply / gather over a module with BatchNorm and a buffer, where replica 0 shares the
module's buffers so its running-stat update is the one kept. The plain run computes each result by hand."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= 3
if CUDA:
    import torch.cuda.comm as comm
    import torch.cuda.nccl as nccl
    from torch.nn.parallel import gather, parallel_apply, replicate
    from torch.nn.parallel.scatter_gather import scatter_kwargs


def comm_checks():
    torch.manual_seed(0)
    params = [torch.randn(3, 4), torch.arange(7, dtype=torch.int64), torch.randn(5).half(), torch.randn(2, 2)]
    x = torch.arange(30.).reshape(10, 3)
    r = {}
    if CUDA:
        copies = comm.broadcast_coalesced([p.cuda(0) for p in params], [0, 1, 2], buffer_size=32)
        r["bcast"] = [[t.device.index for t in c] for c in copies] + [[float(t.double().sum()) for t in copies[2]]]
        grads = [[(t.double() * (i + 1)).to(t.dtype) for t in c] for i, c in enumerate(copies)]
        reduced = comm.reduce_add_coalesced(grads, destination=1, buffer_size=40)
        r["reduce"] = [[t.device.index for t in reduced], [float(t.double().sum()) for t in reduced]]
        streams = [torch.cuda.Stream(device=d) for d in range(3)]
        parts = comm.scatter(x.cuda(1), [0, 1, 2], chunk_sizes=[5, 2, 3], dim=0, streams=streams)
        torch.cuda.synchronize()
        r["scatter"] = [[list(p.shape), p.device.index, p[0, 0].item()] for p in parts]
        back = comm.gather(parts, dim=0, destination=-1)
        cols = comm.gather([p[:2] for p in parts], dim=1, destination=0)
        r["gather"] = [back.device.type, float(back.sum()), list(cols.shape), cols.device.index, float(cols.sum())]
        outs = [torch.empty(2, device=f"cuda:{d}") for d in range(3)]
        comm.broadcast(torch.tensor([1., 2.], device="cuda:2"), out=outs)
        r["bcast_out"] = [o.tolist() for o in outs]
    else:
        r["bcast"] = [[d] * 4 for d in range(3)] + [[float(p.double().sum()) for p in params]]
        reduced = [sum((p.double() * (i + 1)).to(p.dtype).double() for i in range(3)).to(p.dtype) for p in params]
        r["reduce"] = [[1] * 4, [float(t.double().sum()) for t in reduced]]
        r["scatter"] = [[list(p.shape), d, p[0, 0].item()] for d, p in enumerate(torch.split(x, [5, 2, 3]))]
        cols = torch.cat([p[:2] for p in torch.split(x, [5, 2, 3])], dim=1)
        r["gather"] = ["cpu", float(x.sum()), list(cols.shape), 0, float(cols.sum())]
        r["bcast_out"] = [[1., 2.]] * 3
    return r


def nccl_checks():
    r = {}
    for dtype in (torch.float32, torch.float16):
        torch.manual_seed(1)
        xs = [torch.randn(6).to(dtype) * (i + 1) for i in range(3)]
        name = str(dtype).split(".")[1]
        if CUDA:
            ts = [x.cuda(i) for i, x in enumerate(xs)]
            nccl.all_reduce(ts)
            r[f"all_reduce_{name}"] = [t.double().sum().item() for t in ts]
            ts = [x.cuda(i) for i, x in enumerate(xs)]
            nccl.reduce(ts, root=1)
            r[f"reduce_{name}"] = [ts[1].double().tolist(), ts[0].double().tolist()]
            ts = [x.cuda(i) for i, x in enumerate(xs)]
            nccl.broadcast(ts, root=2)
            r[f"broadcast_{name}"] = [t.double().sum().item() for t in ts]
            outs = [torch.empty(18, dtype=dtype, device=f"cuda:{i}") for i in range(3)]
            nccl.all_gather([x.cuda(i) for i, x in enumerate(xs)], outs)
            r[f"all_gather_{name}"] = [o.double().sum().item() for o in outs]
            outs = [torch.empty(6, dtype=dtype, device=f"cuda:{i}") for i in range(3)]
            nccl.reduce_scatter([torch.cat([x] * 3).cuda(i) for i, x in enumerate(xs)], outs)
            r[f"reduce_scatter_{name}"] = [o.double().tolist() for o in outs] + [str(outs[0].dtype)]
        else:
            summed = sum(x.double() for x in xs).to(dtype).double()
            r[f"all_reduce_{name}"] = [summed.sum().item()] * 3
            r[f"reduce_{name}"] = [summed.tolist(), xs[0].double().tolist()]
            r[f"broadcast_{name}"] = [xs[2].double().sum().item()] * 3
            r[f"all_gather_{name}"] = [sum(x.double().sum().item() for x in xs)] * 3
            r[f"reduce_scatter_{name}"] = [summed.tolist()] * 3 + [str(dtype)]
    return r


class Seg(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 2, 1)
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0]))

    def forward(self, images, mask=None, scale=1.0):
        logits = self.head(F.relu(self.bn(self.conv(images))) * scale)
        return {"logits": logits, "masked": (logits * mask.unsqueeze(1)).sum((1, 2, 3))}


def replicate_checks():
    torch.manual_seed(0)
    net = Seg()
    images, mask = torch.randn(6, 3, 5, 5), (torch.rand(6, 5, 5) > 0.5).float()
    target = torch.randint(0, 2, (6, 5, 5))
    r = {}
    if CUDA:
        net = net.cuda(0)
        inputs, kwargs = scatter_kwargs((images,), {"mask": mask, "scale": 0.5}, [0, 1, 2])
        replicas = replicate(net, [0, 1, 2], detach=False)
        out = gather(parallel_apply(replicas, inputs, kwargs, [0, 1, 2]), 0)
        r["replicas"] = [[m.conv.weight.device.index, m.class_weight.device.index] for m in replicas]
    else:
        chunks = [(images[i:i + 2], mask[i:i + 2]) for i in range(0, 6, 2)]
        outs = [net(*chunks[0], scale=0.5)]
        kept = {k: b.clone() for k, b in net.bn.named_buffers()}  # only replica 0 shares the module's buffers
        outs += [net(x, m, scale=0.5) for x, m in chunks[1:]]
        out = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
        r["replicas"] = [[d, d] for d in range(3)]
    loss = F.cross_entropy(out["logits"], target.to(out["logits"].device), weight=net.class_weight)
    (loss + out["masked"].mean() * 0.01).backward()
    if not CUDA:
        for k, b in net.bn.named_buffers():
            b.copy_(kept[k])
    r["loss"] = loss.item()
    r["grads"] = net.conv.weight.grad.flatten()[:6].tolist() + net.bn.weight.grad.tolist()
    r["running_mean"] = net.bn.running_mean.tolist() + [int(net.bn.num_batches_tracked)]
    return r


def main():
    result = {"comm": comm_checks(), "nccl": nccl_checks(), "replicate": replicate_checks(),
              "_tolerance": [2e-3, 2e-3]}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
