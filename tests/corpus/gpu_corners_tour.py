"""Corners of GPU code that once went wrong on emulated GPUs, on one or two GPUs:

- low precision as 2026 code writes it: per-tensor float8 scaling, torch._scaled_mm gated on the compute capability
  as fp8 libraries gate it (the dequantise-then-matmul fallback older GPUs take), and what a direct _scaled_mm does
  on this GPU (an A100 refuses it: it computed silently); int8 W8A8 with torch._int_mm;
- debugging aids: torch.cuda.set_sync_debug_mode("warn") flags the synchronising nonzero (it raised "not
  modelled"), mem_get_info, the allocator's memory history;
- torch.fft with complex autograd and a sparse COO matmul with a gradient;
- activation checkpointing with dropout across two GPUs, reentrant and not: the recomputed masks equal the first.
"""
import json
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

use_cuda = torch.cuda.is_available()
device = torch.device("cuda" if use_cuda else "cpu")
two = use_cuda and torch.cuda.device_count() >= 2
dev1 = torch.device("cuda:1" if two else device)


def to_float8(x, dtype=torch.float8_e4m3fn):
    finfo = torch.finfo(dtype)
    scale = finfo.max / x.abs().amax().clamp(min=1e-12)
    return (x * scale).clamp(min=finfo.min, max=finfo.max).to(dtype), scale.float().reciprocal()


def low_precision(res):
    torch.manual_seed(0)
    a, w = torch.randn(32, 64, device=device), torch.randn(48, 64, device=device) * 0.1
    (a8, a_inv), (w8, w_inv) = to_float8(a), to_float8(w)
    res["fp8_bits_sum"] = a8.view(torch.uint8).int().sum().item()
    fp8_gemm = use_cuda and torch.cuda.get_device_capability() >= (8, 9)
    if fp8_gemm:
        out = torch._scaled_mm(a8, w8.t(), scale_a=a_inv, scale_b=w_inv, out_dtype=torch.bfloat16)
    else:
        out = ((a8.to(torch.bfloat16) @ w8.to(torch.bfloat16).t()).float() * (a_inv * w_inv)).to(torch.bfloat16)
    res["fp8_mm_sum"] = out.float().sum().item()
    try:
        torch._scaled_mm(a8, w8.t(), scale_a=a_inv, scale_b=w_inv, out_dtype=torch.float32)
        outcome = "computed"
    except RuntimeError as e:
        outcome = "refused" if "compute capability" in str(e) else str(e)
    res["direct_scaled_mm_as_hardware_does"] = outcome == ("refused" if use_cuda and not fp8_gemm else "computed")
    x = torch.randn(32, 64, device=device)
    wq_scale, xq_scale = w.abs().amax(1, keepdim=True) / 127, x.abs().amax(1, keepdim=True) / 127
    wq = (w / wq_scale).round().clamp(-128, 127).to(torch.int8)
    xq = (x / xq_scale).round().clamp(-128, 127).to(torch.int8)
    acc = torch._int_mm(xq, wq.t())
    # the reference on the host: CUDA has no int32 matmul ("addmm_cuda" not implemented for 'Int'), only _int_mm
    res["int_mm"] = [str(acc.dtype), acc.sum().item(), torch.equal(acc.cpu(), xq.cpu().int() @ wq.cpu().int().t())]


def debugging_fft_sparse(res):
    torch.manual_seed(1)
    y = torch.randn(64, 64, device=device)
    if use_cuda:
        free, total = torch.cuda.mem_get_info()
        torch.cuda.memory._record_memory_history(max_entries=100)
        y = y @ y
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            count = torch.nonzero(y > 0).shape[0]
        torch.cuda.set_sync_debug_mode("default")
        checks = [0 < free <= total, len(snapshot["segments"]) > 0,
                  any("synchronizing" in str(w.message) for w in caught)]
    else:
        y = y @ y
        count, checks = torch.nonzero(y > 0).shape[0], [True, True, True]
    res["nonzero"], res["debug_checks"] = count, checks
    signal = torch.randn(4, 32, device=device)
    filt = torch.randn(17, dtype=torch.cfloat, device=device, requires_grad=True)
    loss = torch.fft.irfft(torch.fft.rfft(signal) * filt, n=32).pow(2).mean() + filt.abs().pow(2).sum() * 1e-3
    loss.backward()
    res["fft"] = [loss.item()] + torch.view_as_real(filt.grad).cpu().flatten()[:6].tolist()
    coo = (torch.randn(6, 5) * (torch.rand(6, 5) > 0.6)).to(device).to_sparse()
    weight = torch.randn(5, 4, device=device, requires_grad=True)
    torch.sparse.mm(coo, weight).sum().backward()
    res["coo_grad"] = weight.grad.cpu().flatten().tolist()


class Split(nn.Module):
    """Two dropout blocks, one per GPU: a checkpoint must restore each device's RNG state for its recomputation."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.Linear(32, 16)).to(device)
        self.b = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.Linear(32, 16)).to(dev1)
        self.mode = mode

    def run(self, part, x):
        return part(x) if self.mode is None else checkpoint(part, x, use_reentrant=self.mode == "reentrant")

    def forward(self, x):
        return self.run(self.b, self.run(self.a, x.to(device)).to(dev1))


def checkpointing(res):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    grads = {}
    for mode in (None, "reentrant", "non_reentrant"):
        model = Split(mode)
        torch.manual_seed(7)
        model(x).square().mean().backward()
        grads[mode] = [p.grad.cpu() for p in model.parameters()]
    res["ckpt_grad_sums"] = [g.sum().item() for g in grads[None]]
    res["ckpt_equal"] = [all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[m], grads[None]))
                         for m in ("reentrant", "non_reentrant")]


res = {}
low_precision(res)
debugging_fft_sparse(res)
checkpointing(res)
print("RESULT " + json.dumps(res))
