"""Stand-ins for the `torch._C._cuda_*` bindings a CUDA build of PyTorch has, answered by the emulator.

Much of `torch.cuda` is Python that calls into these bindings (`memory_stats`, `memory_summary`,
`reset_accumulated_memory_stats`, `set_per_process_memory_fraction`, ...). Supplying the bindings, rather
than replacing those functions, lets PyTorch's own argument checks and formatting run unchanged.

A CPU build has none of them, so a call the emulator does not model would end in a bare
`AttributeError: module 'torch._C' has no attribute '_cuda_...'`. While the emulator runs, `torch._C`
gets a module `__getattr__` that names the `torch.cuda` function instead. Its error is a RuntimeError
and also an AttributeError, so `hasattr(torch._C, "_cuda_...")` probes keep answering False.
"""
from __future__ import annotations

import sys

import torch
import torch.cuda.memory

from course.cuda import memory_history
from course.cuda.devices import current_emulator, parse_device


class NotModelledError(RuntimeError, AttributeError):
    """A CUDA feature the GPU emulator does not model (an AttributeError too, for `hasattr` probes)."""


def not_modelled(what: str, advice: str = "run this part on a real GPU") -> NotModelledError:
    return NotModelledError(f"{what} is not modelled by the GPU emulator (course.emulate); {advice}.")


def caller_in_torch(depth: int = 1) -> str:
    """The outermost torch function on the stack above `depth`: the one the learner called, e.g.
    `torch.cuda.caching_allocator_alloc`."""
    frame, name = sys._getframe(depth + 1), "this torch.cuda call"
    while frame is not None and (frame.f_globals.get("__name__", "").startswith("torch.")
                                 or frame.f_globals.get("__name__") == RANK_KERNELS):
        if frame.f_globals["__name__"] != RANK_KERNELS:
            name = f"{frame.f_globals['__name__']}.{frame.f_code.co_qualname}"
        frame = frame.f_back
    return name


RANK_KERNELS = "course.cuda.rank_rng"  # its kernels run between torch's frames in rank threads; the walk passes them


def _torch_c_getattr(name: str):
    if name.startswith("_cuda"):
        raise not_modelled(f"{caller_in_torch()} (torch._C.{name})")
    raise AttributeError(f"module 'torch._C' has no attribute '{name}'")


def _memory(device: int):
    emu = current_emulator("torch.cuda memory statistics")
    return emu.memory, parse_device(device, emu)


def _memory_stats(device: int) -> dict:
    memory, index = _memory(device)
    return memory.stats(index)


def _reset_peak(device: int) -> None:
    memory, index = _memory(device)
    memory.reset_peak(index)


def _reset_accumulated(device: int) -> None:
    memory, index = _memory(device)
    memory.reset_accumulated(index)


def _set_memory_fraction(fraction: float, device: int) -> None:
    """Later allocations beyond fraction * capacity raise the emulator's out-of-memory error."""
    memory, index = _memory(device)
    memory.fraction[index] = fraction


def _get_memory_fraction(device: int) -> float:
    memory, index = _memory(device)
    return memory.fraction[index]


def _memory_snapshot(pool=None) -> dict:
    emu = current_emulator("torch.cuda.memory_snapshot")
    private_pool = pool is not None and tuple(pool[:2]) != (0, 0)  # a MemPool: none can exist here
    return {"segments": [] if private_pool else memory_history.annotate(emu, emu.memory.snapshot()),
            "device_traces": memory_history.device_traces(emu)}


BINDINGS = {
    "__getattr__": _torch_c_getattr,
    "_cuda_memoryStats": _memory_stats,
    "_cuda_resetPeakMemoryStats": _reset_peak,
    "_cuda_resetAccumulatedMemoryStats": _reset_accumulated,
    "_cuda_setMemoryFraction": _set_memory_fraction,
    "_cuda_getMemoryFraction": _get_memory_fraction,
    "_cuda_memorySnapshot": _memory_snapshot,
    "_cuda_record_memory_history": memory_history.record_memory_history,
    "_cuda_record_memory_history_legacy": memory_history.record_memory_history_legacy,
    "_cuda_getAllocatorBackend": lambda: "native",
    "_cuda_emptyCache": lambda: current_emulator("torch.cuda.empty_cache").memory.empty_cache(),
    "_host_emptyCache": lambda: None,  # nothing pinned is cached either (torch.cuda.graph's __enter__ calls it)
    # cuBLAS's workspaces are not modelled (they count no memory here), so there is nothing to free; PyTorch's test
    # harness calls it before every CUDA memory-leak check
    "_cuda_clearCublasWorkspaces": lambda: None,
    # the accelerator torch.distributed and FSDP2 default to (fully_shard's mesh, init_process_group's backend)
    "_get_accelerator": lambda check=False: torch.device("cuda"),
}

# torch/cuda/memory.py imported `_lazy_init` and `is_initialized` by name, so patching torch.cuda does not
# reach them: CUDA counts as initialized there, and what is not modelled fails at the binding, by name.
MEMORY_MODULE_PATCHES = {"_lazy_init": lambda: None, "is_initialized": lambda: True}

PATCHES = [(torch._C, BINDINGS), (torch.cuda.memory, MEMORY_MODULE_PATCHES)]
