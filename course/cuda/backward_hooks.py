"""Python hooks the autograd engine calls during `backward()` run inside the emulator.

`loss.backward()` on an emulated tensor reaches PyTorch through the emulator's torch-function mode, and a
mode is off while it handles a call, so Python code the engine calls back (FSDP2's pre-backward all-gather,
`register_hook` functions) would run without it: a hook's `torch.empty(..., device="cuda")` would meet
CPU-only torch ("not modelled by the GPU emulator"). Wrapping the engine's entry point puts the mode back
on the stack for the length of the backward pass.
"""
from __future__ import annotations

import torch
import torch.autograd.graph
from torch.overrides import _get_current_function_mode_stack

from course.cuda.interception import EmulatorMode

_engine_run_backward = torch.autograd.graph._engine_run_backward


def engine_run_backward(*args, **kwargs):
    if any(isinstance(mode, EmulatorMode) for mode in _get_current_function_mode_stack()):
        return _engine_run_backward(*args, **kwargs)
    with EmulatorMode():
        return _engine_run_backward(*args, **kwargs)


# torch.autograd.backward and torch.autograd.grad call the engine by this name in torch.autograd.
PATCHES = [(torch.autograd, {"_engine_run_backward": engine_run_backward})]
