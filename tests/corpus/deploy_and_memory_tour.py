"""Deployment and memory habits on a GPU box: torch.jit.trace of a conv net already on cuda (run on new inputs,
backpropagated, saved and loaded back with map_location), the raw allocator (caching_allocator_alloc / _delete
with memory_allocated around them), untyped_storage().resize_(0) freeing a buffer as ZeRO-3 does, peer access,
a pinned prefetch on a side stream with record_stream and events, activation offload with
save_on_cpu(pin_memory=True) and saved_tensors_hooks parking activations on a second GPU,
register_multi_grad_hook, and TF32 switches read back after set_float32_matmul_precision."""
import io
import json

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook, save_on_cpu, saved_tensors_hooks

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda:0" if CUDA else "cpu")
PARK = torch.device("cuda:1" if CUDA and torch.cuda.device_count() > 1 else "cpu")


def traced():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(6, 4)).to(DEV).eval()
    t = torch.jit.trace(net, torch.randn(2, 3, 8, 8, device=DEV))
    x = torch.randn(3, 3, 10, 10, device=DEV, requires_grad=True)
    out = t(x)
    out.pow(2).sum().backward()
    buf = io.BytesIO()
    torch.jit.save(t, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf, map_location=DEV)
    return {"out": out.detach().cpu().flatten().tolist(), "x_grad": x.grad.sum().item(),
            "eager_equal": torch.allclose(net(x), out, atol=1e-6),
            "loaded_equal": torch.allclose(loaded(x), out, atol=1e-6)}


def memory_and_streams():
    torch.manual_seed(0)
    batches = [torch.randn(32, 16) for _ in range(3)]
    w = torch.randn(16, 8, device=DEV)
    if not CUDA:
        return {"sums": [(b @ w).relu().sum().item() for b in batches], "raw": [True, True, True, True, 8.0],
                "elapsed": True, "peer": True}
    before = torch.cuda.memory_allocated()
    ptr = torch.cuda.caching_allocator_alloc(1 << 20)
    raw = [torch.cuda.memory_allocated() - before >= 1 << 20]
    torch.cuda.caching_allocator_delete(ptr)
    raw.append(torch.cuda.memory_allocated() == before)
    flat = torch.zeros(1 << 14, device=DEV)  # ZeRO-3 / FSDP1 free a parameter's memory and keep the tensor
    storage, nbytes = flat.untyped_storage(), flat.untyped_storage().nbytes()
    storage.resize_(0)
    raw.append(torch.cuda.memory_allocated() == before)
    storage.resize_(nbytes)
    raw.append(torch.cuda.memory_allocated() == before + nbytes)
    raw.append(flat[:4].fill_(2.0).sum().item())
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    sums = []
    for b in batches:
        with torch.cuda.stream(side):
            staged = b.pin_memory().to(DEV, non_blocking=True)
        compute.wait_stream(side)
        staged.record_stream(compute)
        sums.append((staged @ w).relu().sum().item())
    end.record()
    end.synchronize()
    peer = torch.cuda.device_count() < 2 or torch.cuda.can_device_access_peer(0, 1)
    return {"sums": sums, "raw": raw, "elapsed": start.elapsed_time(end) > 0, "peer": peer}


def offload():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)).to(DEV)

    x = torch.randn(16, 8, device=DEV)
    grads = []
    parked = []
    pack = lambda t: (parked.append(t.device == DEV), t.device, t.to(PARK, non_blocking=True))[1:]
    for mode in ("plain", "save_on_cpu", "park"):
        net = build()
        if mode == "save_on_cpu":
            with save_on_cpu(pin_memory=CUDA):
                loss = net(x).pow(2).mean()
        elif mode == "park":
            with saved_tensors_hooks(pack, lambda p: p[1].to(p[0])):
                loss = net(x).pow(2).mean()
        else:
            loss = net(x).pow(2).mean()
        loss.backward()
        grads.append([p.grad.sum().item() for p in net.parameters()])
    a = torch.randn(3, device=DEV, requires_grad=True)
    b = torch.randn(3, device=DEV, requires_grad=True)
    seen = []
    handle = register_multi_grad_hook((a, b), lambda gs: seen.append([g.sum().item() for g in gs]))
    (a * b).sum().backward()
    handle.remove()
    return {"grads": grads, "parked_all_from_device": all(parked), "parked": len(parked), "multi_grad": seen}


def tf32():
    flags = []
    for precision in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(precision)
        flags.append([torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32])
    torch.set_float32_matmul_precision("highest")
    return flags


def main():
    print("RESULT " + json.dumps({"traced": traced(), "memory": memory_and_streams(), "offload": offload(),
                                  "tf32": tf32()}))


if __name__ == "__main__":
    main()
