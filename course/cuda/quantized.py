"""Quantized tensors (torch.quint8, qint8, qint32) on emulated GPUs: the ops a GPU runs on them give CPU torch's values.

A CUDA build registers a few dozen aten ops for the QuantizedCUDA backend: dequantize, int_repr, q_scale and the
other accessors, views, clone, fill_, relu, gelu, max/min over a dim, index_select, masked_fill_... The ways in take
float tensors and have CUDA kernels (quantize_per_tensor, quantize_per_channel, _make_per_tensor_quantized_tensor).
A CPU build has QuantizedCPU kernels for more (cat, mean, sigmoid, comparisons, pooling, upsampling), which the
emulator's CPU kernels would run on a GPU's quantized tensor: those raise the dispatcher's error, naming
QuantizedCUDA, as on a GPU. Which ops a CUDA build has is read from the same PyTorch's native_functions.yaml, which
the wheel ships (torchgen/packaged/ATen/native/native_functions.yaml).
"""
from __future__ import annotations

import functools
import pathlib

import torch
import torchgen

_NATIVE_FUNCTIONS = pathlib.Path(torchgen.__file__).parent / "packaged/ATen/native/native_functions.yaml"


@functools.cache
def _quantized_cuda_ops() -> frozenset[str]:
    """The `aten::name.overload` of every op whose dispatch table names QuantizedCUDA."""
    found, name = set(), None
    for line in _NATIVE_FUNCTIONS.read_text().splitlines():
        if line.startswith("- func:"):
            name = "aten::" + line[len("- func:"):].strip().split("(")[0]
        elif name and line.startswith("    ") and ":" in line and "QuantizedCUDA" in line.split(":")[0]:
            found.add(name)
    return frozenset(found)


def _quantized(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_quantized(v) for v in value)
    return isinstance(value, torch.Tensor) and value.is_quantized


def refusal(func):
    """For an aten op with a QuantizedCPU kernel and no QuantizedCUDA one, what refuses a quantized GPU tensor with
    the dispatcher's error; None for the others."""
    name = func.name()
    if func.namespace != "aten" or name.removesuffix(".default") in _quantized_cuda_ops() or \
            not torch._C._dispatch_has_kernel_for_dispatch_key(name, "QuantizedCPU"):
        return None

    def refuse(args) -> None:
        if _quantized(args):
            raise NotImplementedError(
                f"Could not run '{name}' with arguments from the 'QuantizedCUDA' backend. This could be because the "
                "operator doesn't exist for this backend, or was omitted during the selective/custom build process (if "
                "using custom build). A CUDA build of PyTorch has no QuantizedCUDA kernel for it "
                "(aten/src/ATen/native/native_functions.yaml); quantized tensors on GPUs run dequantize, int_repr, "
                "views and a few ops only.")
    return refuse
