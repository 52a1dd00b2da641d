"""Python hooks the autograd engine calls during `backward()` run inside the emulator.

`loss.backward()` on an emulated tensor reaches PyTorch through the emulator's torch-function mode, and a
mode is off while it handles a call, so Python code the engine calls back (FSDP2's pre-backward all-gather,
`register_hook` functions, a custom `autograd.Function`'s backward) would run without it: a hook's
`torch.empty(..., device="cuda")` would meet CPU-only torch ("not modelled by the GPU emulator"). Wrapping the engine's entry point puts the mode back
on the stack for the length of the backward pass. Saved-tensor hooks are the forward's counterpart: autograd
packs a tensor while the mode handles the op that saved it, so `save_on_cpu(pin_memory=True)`'s pinned
`torch.empty` (or an offloading hook's) met CPU-only torch; their pack and unpack functions get the mode back too.
"""
from __future__ import annotations

import torch
import torch.autograd.graph
from torch.overrides import _get_current_function_mode_stack

from course.cuda.interception import EmulatorMode

_engine_run_backward = torch.autograd.graph._engine_run_backward
_saved_tensors_hooks_init = torch.autograd.graph.saved_tensors_hooks.__init__


def _emulator_on() -> bool:
    return any(isinstance(mode, EmulatorMode) for mode in _get_current_function_mode_stack())


def engine_run_backward(*args, **kwargs):
    if _emulator_on():
        return _engine_run_backward(*args, **kwargs)
    with EmulatorMode():
        return _engine_run_backward(*args, **kwargs)


def _under_emulator(hook):
    def run(value):
        if _emulator_on():
            return hook(value)
        with EmulatorMode():
            return hook(value)
    return run


def saved_tensors_hooks_init(self, pack_hook, unpack_hook):
    _saved_tensors_hooks_init(self, _under_emulator(pack_hook), _under_emulator(unpack_hook))


# torch.autograd.backward and torch.autograd.grad call the engine by this name in torch.autograd; save_on_cpu and
# checkpoint(use_reentrant=False) hand their hooks to saved_tensors_hooks.__init__. In place for every program: a
# custom autograd.Function's backward (torch.distributed.nn's all_to_all_single makes its gradient buffer with
# `torch.empty(..., device=grad.device)`) needs the mode as much as FSDP2's hooks do.
PATCHES = [(torch.autograd, {"_engine_run_backward": engine_run_backward}),
           (torch.autograd.graph.saved_tensors_hooks, {"__init__": saved_tensors_hooks_init})]
