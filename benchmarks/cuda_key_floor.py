"""How fast could emulated GPUs be below Python dispatch? A spike for issue 14's overhead targets.

benchmarks/overhead.py shows that a do-nothing Python tensor subclass alone costs more than the targets allow. This
benchmark builds the alternative, cuda_key_floor.cpp: C++ kernels for the CUDA dispatch key of this CPU-only torch
build, so tensors really are `cuda:i` to C++ (autograd, autocast) while their memory is host memory, and every op is
aliased to the CPU kernel in C++. It times the same workloads as overhead.py, the same way (A B A B, medians), for
  (a) the C++ backend doing nothing but alias and redispatch,
  (b) (a) plus what an emulator must keep per op, in C++: bytes allocated per device (and the peak), and a record
      of (op, device, stream, input shapes) appended to a C++ vector,
  (c) (a) plus a Python function called per op with the op's name, device and input shapes (a ledger in Python),
next to the Python-dispatch floor overhead.py measures.
The extension's CUDA hooks must be registered before `import torch` asks for them (at::getAccelerator, which the
autograd engine needs for a cuda gradient, is decided then), so this script compiles the extension in a child
process and loads the library before importing torch. It builds into /tmp/cppfloor-build (CUDA_KEY_FLOOR_BUILD), never
into the venv; the first run compiles for about 30 s.
Run: PYTHONPATH=. python benchmarks/cuda_key_floor.py
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_key_floor.cpp")
BUILD = os.environ.get("CUDA_KEY_FLOOR_BUILD", "/tmp/cppfloor-build")
GPUS = 1  # as overhead.py's emulator runs


def build() -> str:
    """Compile (or find up to date) the extension in a child process, which may import torch; return the library."""
    os.makedirs(BUILD, exist_ok=True)
    code = ("import torch.utils.cpp_extension as ce; "
            f"print(ce.load('cuda_key_floor', [{SOURCE!r}], build_directory={BUILD!r}, extra_cflags=['-O2']).__file__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def load(library: str):
    """Load torch's libraries and then the extension's, so its CUDA hooks are registered before torch asks."""
    torch_lib = os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0], "lib")
    for name in ("libc10.so", "libtorch_cpu.so", "libtorch.so", "libtorch_python.so", library):
        ctypes.CDLL(os.path.join(torch_lib, name), mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    import torch
    spec = importlib.util.spec_from_file_location("cuda_key_floor", library)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    if ext.accelerator() != "CUDA":
        raise RuntimeError("torch decided its accelerator before the extension's CUDA hooks were registered")
    ext.set_device_count(GPUS)
    ext.take_cpu_kernels()
    # Backward of cuda tensors on the calling thread, as for CPU ones. With autograd's per-device worker threads the
    # process aborts at exit (a worker drops its last graph task after the interpreter is finalized). Per thread:
    # rank threads must set it too.
    torch._C._set_multithreading_enabled(False)
    # What the emulator patches in Python too (course/cuda/cuda_api.py): the CPU build's torch.cuda asks bindings
    # it does not have.
    torch.cuda._lazy_init = lambda: None
    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: True
    torch.cuda.device_count = lambda: GPUS
    torch.cuda.current_device = ext.current_device
    torch.cuda.is_bf16_supported = lambda including_emulation=True: True
    return ext


def check() -> None:
    """What the timed backend computes: three AdamW steps of the nanoGPT-sized model on cuda against the CPU (losses,
    gradients and parameters bit for bit), and the dtype of a matmul under autocast on cuda."""
    import torch

    from benchmarks.overhead import TinyGPT

    def train(device):
        torch.manual_seed(0)
        model = TinyGPT().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        idx, targets = (torch.randint(0, 65, (16, 32)).to(device) for _ in range(2))
        losses = []
        for _ in range(3):
            loss = model(idx, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses, [t.cpu() for p in model.parameters() for t in (p.detach(), p.grad)]

    (cpu_losses, cpu_tensors), (cuda_losses, cuda_tensors) = train("cpu"), train("cuda")
    same = cpu_losses == cuda_losses and all(torch.equal(a, b) for a, b in zip(cpu_tensors, cuda_tensors))
    x = torch.randn(8, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        dtype = (x @ x).dtype
    print(f"nanoGPT-sized, 3 AdamW steps on cuda: losses, grads and parameters equal plain CPU's: {same}; "
          f"x @ x under autocast('cuda', bfloat16): {dtype}")


def main() -> None:
    ext = load(build())
    import torch

    from benchmarks.overhead import (REPEATS, Passthrough, gpt_loop, load_average, ratios, report, tiny_op,
                                     with_mode)

    def mode(number, work, callback=None):
        def run():
            ext.set_mode(number, callback)
            try:
                return work()
            finally:
                ext.set_mode(0, None)
                ext.clear_records()
        return run

    ledger = []

    def in_python(name, device, shapes):  # what a ledger kept in Python is handed per op
        ledger.append((name, device, shapes))
        if len(ledger) > 100_000:
            ledger.clear()

    torch.set_num_threads(1)
    check()
    print(f"{load_average()} (1, 5, 15 min) before")
    ext.set_mode(1, None)
    gpt_loop("cuda")
    print(f"nanoGPT-sized: {len(ext.records()) // 10} ops per training step reach the CUDA kernels (C++ record)")
    ext.set_mode(0, None)
    ext.clear_records()
    plain_gpt = lambda: gpt_loop("cpu")  # noqa: E731
    cuda_gpt = lambda: gpt_loop("cuda")  # noqa: E731
    report("nanoGPT-sized, (a) C++ alias+redispatch", ratios(plain_gpt, mode(0, cuda_gpt)), "target <= 1.5x")
    report("nanoGPT-sized, (b) (a) + C++ record", ratios(plain_gpt, mode(1, cuda_gpt)), "target <= 1.5x")
    report("nanoGPT-sized, (c) (a) + Python callback", ratios(plain_gpt, mode(2, cuda_gpt, in_python)),
           "target <= 1.5x")
    floor_gpt = lambda: gpt_loop("cpu", Passthrough)  # noqa: E731
    report("nanoGPT-sized, do-nothing subclass + mode", ratios(plain_gpt, with_mode(floor_gpt)),
           "Python-dispatch floor")
    plain_add = lambda: tiny_op("cpu")  # noqa: E731
    cuda_add = lambda: tiny_op("cuda")  # noqa: E731
    report("x + 1, (a) C++ alias+redispatch", ratios(plain_add, mode(0, cuda_add)), "target <= 5x")
    report("x + 1, (b) (a) + C++ record", ratios(plain_add, mode(1, cuda_add)), "target <= 5x")
    report("x + 1, (c) (a) + Python callback", ratios(plain_add, mode(2, cuda_add, in_python)), "target <= 5x")
    floor_add = lambda: tiny_op("cpu", Passthrough)  # noqa: E731
    report("x + 1, do-nothing subclass + mode", ratios(plain_add, with_mode(floor_add)), "Python-dispatch floor")
    # Per-op cost in microseconds, the fastest of several runs (least disturbed by other jobs on a shared machine).
    per_op = {name: min(work() for _ in range(REPEATS)) / 2000 * 1e6 for name, work in [
        ("plain", plain_add), ("(a)", mode(0, cuda_add)), ("(b)", mode(1, cuda_add)),
        ("(c)", mode(2, cuda_add, in_python)), ("floor", with_mode(floor_add))]}
    print("x + 1, microseconds per op (fastest run): " + ", ".join(f"{k} {v:.2f}" for k, v in per_op.items()))
    print(f"{load_average()} after")


if __name__ == "__main__":
    main()
