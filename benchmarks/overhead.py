"""Wall-time cost of the emulator against plain CPU PyTorch, on three workloads.

1. a 4-layer 1024-wide MLP training loop (big ops: the emulator's bookkeeping is hidden by the math);
2. a nanoGPT-sized training loop (2 blocks, 64 wide, AdamW): hundreds of small ops per step, so the
   per-op cost of emulation decides the ratio;
3. `x + 1` on 16 elements: the per-op cost alone.
For 2 and 3 it also measures the floor of the design: a tensor subclass that does nothing but unwrap, run
the op and wrap (PyTorch's Python dispatch, which every emulated op goes through), alone and with a
TorchFunctionMode that does nothing either (the emulator needs one to see `torch.ones(..., device="cuda")` and
plain tensors' `.to("cuda")`, and a mode sees every torch call). Each side runs alternately (A B A B ...) and
the medians of the ratios are printed, with the load average before and after, since this machine is shared
and noisy.
Both sides run on one CPU thread: the emulator's per-op cost is single-threaded Python, and plain torch's
OpenMP threads fighting other jobs for a shared machine's cores made its times swing threefold from run to run.
Run: PYTHONPATH=. python benchmarks/overhead.py
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import course

REPEATS = 5


def mlp_loop(device: str) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 1024, device=device), torch.randn(256, 1024, device=device)
    start = time.perf_counter()
    for _ in range(10):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    optimizer.param_groups[0]["params"][0].sum().item()
    return time.perf_counter() - start


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=65, context=32, width=64, layers=2, heads=4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def gpt_loop(device: str, wrap=None) -> float:
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    if wrap is not None:  # parameters and inputs inside a tensor subclass, for the floor
        for module in model.modules():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None:
                    module._parameters[name] = nn.Parameter(wrap(parameter.detach()))
    # On a GPU (and so on the emulator) AdamW takes its foreach path; the floor takes it too, to issue the same ops.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True if wrap is not None else None)
    idx = torch.randint(0, 65, (16, 32), device=device)
    targets = torch.randint(0, 65, (16, 32), device=device)
    if wrap is not None:
        idx, targets = wrap(idx), wrap(targets)
    start = time.perf_counter()
    for _ in range(10):
        loss = model(idx, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    loss.item()
    return time.perf_counter() - start


def tiny_op(device: str, wrap=lambda t: t) -> float:
    x = wrap(torch.ones(16, device=device))
    start = time.perf_counter()
    for _ in range(2000):
        x + 1
    return time.perf_counter() - start


class Passthrough(torch.Tensor):
    """The least a Python tensor subclass can do per op: the floor under any emulator built this way. It unwraps
    tensors in arguments and in lists of them (foreach ops, `cat`), as every op of a training step needs."""

    @staticmethod
    def __new__(cls, inner):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(), dtype=inner.dtype,
                                                device=inner.device, requires_grad=inner.requires_grad)
        t.inner = inner
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.inner if type(a) is Passthrough else a  # noqa: E731
        args = [[unwrap(b) for b in a] if type(a) in (list, tuple) else unwrap(a) for a in args]
        call = func._op  # the C++ operator, as the emulator calls it (OpOverload.__call__ only forwards to it)
        out = call(*args, **{k: unwrap(v) for k, v in kwargs.items()}) if kwargs else call(*args)
        if type(out) is torch.Tensor:
            return Passthrough(out)
        if isinstance(out, (tuple, list)):
            return type(out)(Passthrough(o) if type(o) is torch.Tensor else o for o in out)
        return out


class PassthroughMode(TorchFunctionMode):
    """A TorchFunctionMode that does nothing: what the emulator's mode costs before it looks at a call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})


def with_mode(work):
    def run():
        with PassthroughMode():
            return work()
    return run


def emulated(work):
    with course.emulate(gpus=1):
        return work("cuda")


def ratios(plain, other) -> list[float]:
    plain(), other()  # warm up
    pairs = [(plain(), other()) for _ in range(REPEATS)]
    return [b / a for a, b in pairs]


def report(name: str, values: list[float], target: str) -> None:
    print(f"{name:44} median {statistics.median(values):6.2f}x  (min {min(values):.2f}x, "
          f"max {max(values):.2f}x; {target})")


def load_average() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    torch.set_num_threads(1)
    print(f"{load_average()} (1, 5, 15 min) before")
    report("MLP 4x1024 training, emulator / plain", ratios(lambda: mlp_loop("cpu"), lambda: emulated(mlp_loop)),
           "target <= 1.25x")
    plain_gpt = lambda: gpt_loop("cpu")  # noqa: E731
    report("nanoGPT-sized training, emulator / plain", ratios(plain_gpt, lambda: emulated(gpt_loop)),
           "target <= 1.5x")
    floor_gpt = lambda: gpt_loop("cpu", Passthrough)  # noqa: E731
    report("nanoGPT-sized, do-nothing subclass / plain", ratios(plain_gpt, floor_gpt), "floor of the design")
    report("nanoGPT-sized, do-nothing subclass + mode", ratios(plain_gpt, with_mode(floor_gpt)),
           "floor with a TorchFunctionMode")
    plain_add = lambda: tiny_op("cpu")  # noqa: E731
    report("x + 1 on 16 elements, emulator / plain", ratios(plain_add, lambda: emulated(tiny_op)), "target <= 5x")
    floor_add = lambda: tiny_op("cpu", Passthrough)  # noqa: E731
    report("x + 1, do-nothing subclass / plain", ratios(plain_add, floor_add), "floor of the design")
    report("x + 1, do-nothing subclass + mode", ratios(plain_add, with_mode(floor_add)),
           "floor with a TorchFunctionMode")
    print(f"{load_average()} after")


if __name__ == "__main__":
    main()
