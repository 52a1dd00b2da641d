"""The host's Python around eager PyTorch ops: every `nn.Module` call costs the host time before its ops run.

A module call goes through `Module.__call__` (its hook checks), the forward's Python frame and its attribute
lookups, on top of what each op inside it costs (course/machine/costs.py). Model code issues as many module calls as a
few ops per call, so eager small-batch work is host-bound on fast GPUs, as on real machines. The other
`nn.Module` patch, `module_apply`, makes conversions (`.to()`, `.cuda()`) keep the fake device.
"""
from __future__ import annotations

import threading
import types
import weakref

import torch
import torch.utils
from torch.utils.weak import WeakIdRef

from course.cuda import devices
from course.machine import costs

_MODULE_CALL = torch.nn.Module.__call__  # PyTorch's own, kept before the emulator puts `module_call` in its place
_MODULE_APPLY = torch.nn.Module._apply
_swapping = threading.Lock()
_applying = 0  # `module_apply` calls under way, in every thread (rank threads convert their models at once)
_flag_before = False


def module_call(self, *args, **kwargs):
    """`nn.Module.__call__` while the emulator runs: charge the host, then call the module as PyTorch does."""
    __tracebackhide__ = True
    emu = devices.active
    if emu is None:
        return _MODULE_CALL(self, *args, **kwargs)
    clock = emu.clock
    clock.enter_module(costs.HOST_MODULE_CALL_NS)
    try:
        return _MODULE_CALL(self, *args, **kwargs)
    finally:
        clock.exit_module()


def module_apply(self, fn, recurse=True):
    """`nn.Module._apply` (what `.to()`, `.cuda()` and `.half()` run) with parameters swapped for their converted
    copies: assigning `param.data` cannot move a tensor between the host and an emulated GPU. Only there:
    `load_state_dict` must copy into the parameters in place, as on a GPU, or the references that DDP's reducer and
    autograd hold would break. A swap is refused while autograd holds a parameter (a forward pass's output still
    alive, then `.half()`): the conversions left then go by `param.data = ...`, as on a GPU (course/cuda/interception.py
    `_set_data`); those already done come back unchanged, since converting twice changes nothing. The flag is
    global, so calls under way are counted: rank threads convert at once, and each restoring what it saw would
    leave the flag on after the last one."""
    global _applying, _flag_before
    with _swapping:
        if _applying == 0:
            _flag_before = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
        _applying += 1
    try:
        if recurse:
            for child in self.children():
                child._apply(fn)
        fn = _Remembered(fn)
        if not fn.converts_any(self):
            return self
        if _holds_lazy(self):  # a swap would make its uninitialized parameters empty initialized ones, as in PyTorch
            torch.__future__.set_swap_module_params_on_conversion(False)
            return _rehooked(_MODULE_APPLY(self, fn, recurse=False))
        if _holds_meta(self):
            torch.__future__.set_swap_module_params_on_conversion(_flag_before)
            try:
                return _rehooked(_MODULE_APPLY(self, fn, recurse=False))
            finally:
                torch.__future__.set_swap_module_params_on_conversion(True)
        return _rehooked(_keeping_attributes(self, lambda: _MODULE_APPLY(self, fn, recurse=False)))
    except RuntimeError as error:
        if not str(error).startswith("_apply(): Couldn't swap"):
            raise
        torch.__future__.set_swap_module_params_on_conversion(False)
        return _rehooked(_MODULE_APPLY(self, fn, recurse=False))
    finally:
        with _swapping:
            _applying -= 1
            if _applying == 0:
                torch.__future__.set_swap_module_params_on_conversion(_flag_before)


def _keeping_attributes(module, apply):
    """On a GPU `param.data = ...` converts a parameter and keeps the attributes a program set on it (a loader's
    `weight_loader`, a sharding flag); a swap gives it the converted copy's, so they are set again after, unless
    the program asked for swaps itself (`set_swap_module_params_on_conversion(True)`), which drop them in PyTorch."""
    kept = [(param, dict(vars(param))) for param in module._parameters.values()
            if type(param) in (torch.nn.Parameter, devices.EmulatedTensor) and vars(param)]  # not a DTensor's state
    result = apply()
    if not _flag_before:
        for param, attributes in kept:
            param.__dict__.update(attributes)
    return result


class _Remembered:
    """A conversion that remembers the first tensor it changed, so asking whether it changes any costs no copy."""

    def __init__(self, fn):
        self.fn, self.first = fn, None

    def __call__(self, tensor):
        if self.first is not None and self.first[0] is tensor:
            return self.first[1]
        return self.fn(tensor)

    def converts_any(self, module) -> bool:
        """Whether the conversion changes one of the module's own parameters, gradients or buffers, asked in the
        order `_apply` converts them. A module already where `.cuda()` sends it (`self.cuda()` in a forward) is
        left alone: a swap there would poison the gradients its forward's graph is to accumulate, where a GPU's
        `param.data = param` changes nothing."""
        own = [t for p in module._parameters.values() if p is not None for t in (p, p.grad) if t is not None]
        with torch.no_grad():
            for tensor in (*own, *(b for b in module._buffers.values() if b is not None)):
                converted = self.fn(tensor)
                if converted is not tensor:
                    self.first = (tensor, converted)
                    return True
        return False


def _rehooked(module):
    """A swap moves a parameter's C++ tensor, where autograd keeps what `register_hook` and
    `register_post_accumulate_grad_hook` registered; their dicts stay on the Parameter. Setting the dicts again
    registers them on the tensor it now holds, so they fire as on a GPU, where `param.data = ...` keeps them.
    (Each module's `_apply` runs this for its own parameters: children convert through their own `_apply`.)"""
    for param in module.parameters(recurse=False):
        if param._backward_hooks is not None:
            param._backward_hooks = param._backward_hooks
        if param._post_accumulate_grad_hooks is not None:
            param._post_accumulate_grad_hooks = param._post_accumulate_grad_hooks
    return module


def _holds_lazy(module) -> bool:
    """Whether a lazy module's own parameters or buffers are still uninitialized (nn/modules/lazy.py)."""
    own = (*module._parameters.values(), *module._buffers.values())
    return any(torch.nn.parameter.is_lazy(t) for t in own)


def _holds_meta(module) -> bool:
    """Whether the module has a parameter on the meta device (`to_empty` after meta-device init). A meta tensor and a
    GPU one are not shallow-copy compatible, so PyTorch gives each module a new Parameter rather than assigning
    `.data` (`compute_should_use_set_data` in `nn.Module._apply`): a weight two modules shared (tied embeddings) is
    no longer shared after `to_empty`, as on a GPU, where a swap would have kept it shared."""
    return any(p is not None and p.is_meta and not isinstance(p, devices.EmulatedTensor)
               for p in module._parameters.values())


def _weakrefs_by_value(tensor) -> list:
    """`torch.utils.swap_tensors` refuses a tensor anything holds a weak reference to. A `WeakIdRef` (the key of a
    `WeakIdKeyDictionary`: torch.export's fake-tensor memo keeps one to every parameter `pipeline()` traced) is kept
    by the object's identity, which a swap keeps, so it need not stop `.to("cuda")`; on a GPU `param.data = ...`
    makes the move and never asks."""
    return [ref for ref in weakref.getweakrefs(tensor) if not isinstance(ref, WeakIdRef)]


# swap_tensors (torch/utils/__init__.py) reads `weakref.getweakrefs` from its module's globals.
PATCHES = [(torch.utils, {"weakref": types.SimpleNamespace(getweakrefs=_weakrefs_by_value)})]
