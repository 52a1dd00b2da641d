"""New GPU tensors asked for below the torch API: kernels for the CUDA dispatch key of PyTorch's two allocating ops.

The emulator sees `torch.zeros(..., device="cuda")` in its torch-function mode (interception.py). Code that runs with
that mode off still asks for GPU tensors: a program's `__torch_dispatch__` handler or dispatch mode (`torch.zeros(n,
device=x.device)` in a torchao-style handler; a mode passing on `aten.zeros` or `aten._to_copy` with a CUDA device),
and C++ kernels that allocate on their input's device (`_to_copy` of a host tensor to "cuda" allocates with
`empty_strided` and then copies). On a CPU build those reached no kernel ("Could not run 'aten::empty_strided' with
arguments from the 'CUDA' backend"). Every ATen factory allocates through `empty.memory_format` or `empty_strided`
(aten/src/ATen/native/TensorFactories.cpp), so these two kernels, registered for the CUDA key while an emulator runs,
make each of them give an emulated GPU tensor; what the factory does next (fill, draw, copy) reaches the emulator
through that tensor, and is timed.
"""
from __future__ import annotations

import torch

from course.cuda.devices import current_emulator, parse_device, wrap


def _allocate(make, device):
    """An uninitialised tensor on the emulated GPU `device` names: memory counted, nothing launched (as torch.empty)."""
    emu = current_emulator("a new tensor on a GPU")
    index = parse_device(device, emu)
    inner = make("cpu" if emu.materialize else "meta")
    return wrap(inner, index, emu.memory.allocate(index, inner.untyped_storage().nbytes()))


def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _allocate(lambda host: torch.empty(size, dtype=dtype, layout=layout, device=host,
                                              memory_format=memory_format), device)


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _allocate(lambda host: torch.empty_strided(size, stride, dtype=dtype, layout=layout, device=host), device)


class _Installation:
    """The registration and how many emulators use it (nested emulators share one)."""

    def __init__(self):
        self.library: torch.library.Library | None = None
        self.users = 0


_installed = _Installation()


def install() -> None:
    _installed.users += 1
    if _installed.users == 1:
        _installed.library = torch.library.Library("aten", "IMPL")
        _installed.library.impl("empty.memory_format", empty, "CUDA")
        _installed.library.impl("empty_strided", empty_strided, "CUDA")


def uninstall() -> None:
    if _installed.users == 0:
        return
    _installed.users -= 1
    if _installed.users == 0:
        _installed.library._destroy()
        _installed.library = None
