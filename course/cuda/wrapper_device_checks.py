"""The device check PyTorch's code generator writes into the wrapper of every CUDA kernel, in its words.

TensorIterator's kernels (`add`, `mul`, `where`, ... marked `device_check: NoCheck` in native_functions.yaml) let a
0-dim CPU tensor join a GPU op as a scalar. Every other op with a CUDA kernel gets a wrapper that compares the devices
of its out= and positional tensor arguments, one by one, and refuses any difference, a 0-dim CPU tensor included
(`c10::impl::check_and_update_common_device`, aten/src/ATen/core/op_registration/adaption.h; the wrapper is written by
`gen_device_check` in torchgen/dest/register_dispatch_key.py): `x.clamp(max=shape[1] - 1)` with a CPU `shape` runs on a
CPU but stops on a GPU. The yaml ships with torch, in torchgen's package; it is read once, the first time a tensor on
the host meets a GPU tensor in an op.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from course.cuda.devices import CPU, EmulatedTensor, device_name


@functools.cache
def _wrappers() -> dict[str, bool]:
    """Op name ("clamp.Tensor") -> whether its CUDA wrapper is a structured kernel's, for the ops whose CUDA wrapper
    checks devices: not `device_check: NoCheck`, with a CUDA kernel of their own or through a structured delegate."""
    spec = importlib.util.find_spec("torchgen")
    path = spec and spec.submodule_search_locations and os.path.join(
        spec.submodule_search_locations[0], "packaged", "ATen", "native", "native_functions.yaml")
    if not path or not os.path.exists(path):
        return {}
    with open(path) as yaml:
        entries = yaml.read().split("\n- func: ")[1:]
    cuda_kernels, checked, structured, delegates = set(), set(), set(), {}
    for entry in entries:
        name = entry[:entry.index("(")]
        if "\n  device_check: NoCheck" not in entry:
            checked.add(name)
        if "\n  structured: True" in entry:
            structured.add(name)
        if "\n  structured_delegate: " in entry:
            delegates[name] = entry.split("\n  structured_delegate: ", 1)[1].split(None, 1)[0]
        if "\n  dispatch:" in entry and _names_cuda(entry.split("\n  dispatch:", 1)[1]):
            cuda_kernels.add(name)
    wrappers = {name: name in structured for name in checked & cuda_kernels}
    wrappers.update({name: True for name in checked - cuda_kernels if delegates.get(name) in cuda_kernels})
    return wrappers


def _names_cuda(dispatch: str) -> bool:
    """Whether a `dispatch:` block (its lines indented four spaces, "CPU, CUDA: kernel") has a CUDA kernel."""
    for line in dispatch.split("\n")[1:]:
        if not line.startswith("    "):
            return False
        if "CUDA" in (key.strip() for key in line.split(":", 1)[0].split(",")):
            return True
    return False


# Ops whose kernel on a GPU is a composite one (CompositeExplicitAutograd) that calls a checked op on the same tensors:
# `embedding` is `weight.index_select(0, indices)`, `stack` a `cat` of its tensors unsqueezed.
_COMPOSITES = {
    torch.ops.aten.embedding.default: (torch.ops.aten.index_select.default,
                                       lambda weight, indices, *_args, **_kwargs: (weight, 0, indices)),
    torch.ops.aten.stack.default: (torch.ops.aten.cat.default, lambda tensors, dim=0: (tensors, dim)),
}
_checks: dict = {}


def checks_devices(func) -> bool:
    """Whether `func`'s CUDA kernel sits behind a generated wrapper that compares its arguments' devices."""
    answer = _checks.get(func)
    if answer is None:
        answer = _checks[func] = func in _COMPOSITES or _op_name(func) in _wrappers()
    return answer


def _op_name(func) -> str:
    name = func._schema.name
    if not name.startswith("aten::"):
        return ""
    overload = func._overloadname
    return name[6:] if overload == "default" else f"{name[6:]}.{overload}"


def _wrapper_name(func) -> str:
    """torchgen's name for the wrapper: a structured kernel's is named after the op, an unstructured one's after its
    overload first (`wrapper_CUDA_clamp_Tensor`, `wrapper_CUDA__index_select`)."""
    base = func._schema.name[6:] + ("_out" if any(a.is_out for a in func._schema.arguments) else "")
    overload = "" if func._overloadname == "default" else func._overloadname
    if _wrappers()[_op_name(func)]:
        return f"wrapper_CUDA_{base}_{overload}" if overload else f"wrapper_CUDA_{base}"
    return f"wrapper_CUDA_{overload}_{base}"


def _device(tensor: torch.Tensor) -> int:
    return tensor._device_index if isinstance(tensor, EmulatedTensor) else CPU


def check(func, args, kwargs) -> None:
    """Raise the wrapper's error if `func`'s arguments are not all on one device: out= arguments first, then the
    positional ones in the schema's order (keyword-only ones are not checked), each tensor of a list in turn."""
    if not checks_devices(func):
        return
    if func in _COMPOSITES:
        func, arguments = _COMPOSITES[func]
        args, kwargs = arguments(*args, **kwargs), {}
    schema = func._schema.arguments
    named = {}
    for position, argument in enumerate(schema):
        if position < len(args) and not argument.kwarg_only:
            named[argument.name] = args[position]
        else:
            named[argument.name] = kwargs.get(argument.name)
    checked = [a.name for a in schema if a.is_out] + [a.name for a in schema if not a.kwarg_only]
    common = None
    for name in checked:
        value = named[name]
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if not isinstance(tensor, torch.Tensor):
                continue
            if common is None:
                common = _device(tensor)
            elif _device(tensor) != common:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but got {name} is on {device_name(_device(tensor))}"
                    f", different from other tensors on {device_name(common)} (when checking argument in method "
                    f"{_wrapper_name(func)})")
