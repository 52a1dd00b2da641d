"""PyTorch functions written in Python that make a tensor on their input's device partway through.

Such a function first checks for torch-function handling (the protocol that lets the emulator see the call at
all) and hands itself over; the emulator's handler then runs with its own mode switched off, as PyTorch's
protocol has it, so a `torch.zeros(..., device=k.device)` in the body would reach a CPU build's C++ and be
refused (`nn.MultiheadAttention(add_zero_attn=True)`, `F.fractional_max_pool2d` without samples,
`torch.svd_lowrank`, `F.embedding_bag` with a 2-D input, `torch.unravel_index`).

For those functions the handler runs a copy of PyTorch's own function whose check answers "nothing to hand
over", with the emulator's mode back on: the body runs op by op as if the learner had written it, so its tensors
are made on the emulated GPU. Which functions need it is read from their code at import: those that read a
`.device` in their body or in a module-level helper they call, and those that ask
`torch.are_deterministic_algorithms_enabled()`: on CUDA tensors in deterministic mode they run one of
torch._decomp's decompositions instead (`F.interpolate` in the linear modes, `F.pad(mode="replicate")`,
`F.max_pool3d`), which makes its index tensors on the input's device.
"""
from __future__ import annotations

import types

import torch
import torch._lowrank
import torch.functional
import torch.nn.functional

_MODULES = (torch.nn.functional, torch.functional, torch._lowrank)
_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code (nested functions included) refers to."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names(constant)
    return names


def _reads_a_device(function, module, seen: set) -> bool:
    """Whether `function` or a function of its module it calls (transitively) reads a `.device`."""
    seen.add(function)
    names = _names(function.__code__)
    if "device" in names:
        return True
    helpers = (vars(module).get(name) for name in names)
    return any(_reads_a_device(helper, module, seen) for helper in helpers
               if isinstance(helper, types.FunctionType) and helper.__globals__ is vars(module) and helper not in seen)


def _no_torch_function(*_args) -> bool:
    return False


def _closed_over(function) -> list:
    """The functions `function` holds in its closure (`F.fractional_max_pool2d` is a `boolean_dispatch` of two)."""
    cells = function.__closure__ or ()
    return [cell.cell_contents for cell in cells if isinstance(cell.cell_contents, types.FunctionType)]


def _unchecked(function):
    """A copy of `function` (and of the functions in its closure) whose torch-function checks answer no."""
    globals_ = function.__globals__
    if _CHECKS[0] in globals_:
        globals_ = dict(globals_, **{name: _no_torch_function for name in _CHECKS})
    closure = function.__closure__ and tuple(
        types.CellType(_unchecked(cell.cell_contents) if isinstance(cell.cell_contents, types.FunctionType)
                       else cell.cell_contents) for cell in function.__closure__)
    body = types.FunctionType(function.__code__, globals_, function.__name__, function.__defaults__, closure)
    body.__kwdefaults__ = function.__kwdefaults__
    return body


def _inlined(function, mode_type):
    """`function` run with the emulator's mode on and its own torch-function checks answering no."""
    body = _unchecked(function)

    def run(*args, **kwargs):
        with mode_type():
            return body(*args, **kwargs)
    return run


def _needs_inlining(function, module) -> bool:
    """A function of `module` that hands itself over to torch-function handling and reads a device midway, or
    a wrapper holding such functions."""
    if function.__globals__ is not vars(module):
        return any(_needs_inlining(inner, module) for inner in _closed_over(function))
    names = _names(function.__code__)
    return "handle_torch_function" in names and (
        "are_deterministic_algorithms_enabled" in names or _reads_a_device(function, module, set()))


def handlers(mode_type) -> dict:
    """Handlers for the torch-function-dispatching Python functions of PyTorch that read a device midway."""
    return {function: _inlined(function, mode_type)
            for module in _MODULES for function in vars(module).values()
            if isinstance(function, types.FunctionType) and _needs_inlining(function, module)}
