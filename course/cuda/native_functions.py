"""PyTorch's table of ATen ops, native_functions.yaml, read to learn how each op's CUDA kernel is generated.

Whether the generated wrapper compares devices (`device_check`), whether the op runs through TensorIterator
(`structured_inherits: TensorIteratorBase`, directly or through its `structured_delegate`), and which backends have
a kernel (`dispatch`) decide the errors a GPU box raises for a mix of devices (device_checks.py, out_devices.py).
The yaml ships with torch, in torchgen's package. It is read the first time a program mixes devices, and each op's
entry is searched in it when first asked about, which costs less than parsing 15,000 lines most programs never need.
"""
from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def _text() -> str:
    """The yaml's text ("" where torchgen's copy is missing)."""
    spec = importlib.util.find_spec("torchgen")
    path = spec and spec.submodule_search_locations and os.path.join(
        spec.submodule_search_locations[0], "packaged", "ATen", "native", "native_functions.yaml")
    if not path or not os.path.exists(path):
        return ""
    with open(path) as yaml:
        return yaml.read()


def op_name(func) -> str:
    """The yaml's name of an ATen OpOverload ("clamp.Tensor", "sum" for a default overload); "" for other ops."""
    name = func._schema.name
    if not name.startswith("aten::"):
        return ""
    overload = func._overloadname
    return name[6:] if overload == "default" else f"{name[6:]}.{overload}"


@functools.cache
def _entry(name: str) -> str:
    text = _text()
    start = text.find(f"\n- func: {name}(") if name else -1
    if start < 0:
        return ""
    end = text.find("\n- func: ", start + 1)
    return text[start:end] if end > 0 else text[start:]


@functools.cache
def fields(name: str) -> dict[str, str]:
    """The top-level fields of an op's entry, comments dropped ({} for an op the yaml does not list)."""
    lines = _entry(name).splitlines()[2:]  # the entry starts with "\n- func: ..."
    return {key.strip(): value.split("#")[0].strip() for key, value in
            (line.split(":", 1) for line in lines if line.startswith("  ") and not line.startswith("   ") and ":" in line)}


@functools.cache
def has_cuda_kernel(name: str) -> bool:
    """Whether the entry's `dispatch:` block (lines indented four spaces, "CPU, CUDA: kernel") names a CUDA kernel."""
    entry = _entry(name)
    if "\n  dispatch:" not in entry:
        return False
    for line in entry.split("\n  dispatch:", 1)[1].split("\n")[1:]:
        if not line.startswith("    "):
            return False
        if "CUDA" in (key.strip() for key in line.split(":", 1)[0].split(",")):
            return True
    return False


@functools.cache
def runs_on_tensor_iterator(name: str) -> bool:
    """Whether the op's kernel is a TensorIterator one (add, mul, pow, clamp... and their in-place and functional
    forms, which delegate to the out= one)."""
    entry = fields(name)
    return (entry.get("structured_inherits") == "TensorIteratorBase"
            or fields(entry.get("structured_delegate", "")).get("structured_inherits") == "TensorIteratorBase")
