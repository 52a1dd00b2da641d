"""Ops that CUDA builds of PyTorch have no CUDA kernel for, which the emulator's CPU kernels would run anyway.

torch.histogram and torch.histogramdd are CPU-only (pytorch/pytorch#69519; torch.histc is the GPU's histogram).
Eager quantization's ops (`quantized::linear_dynamic` from torch.ao.quantization.quantize_dynamic, and the rest of
the quantized:: namespace) are registered for the CPU (fbgemm, qnnpack, oneDNN) only: on a GPU box a quantized model
fed a cuda input fails in the dispatcher. The few quantized:: ops with CUDA kernels (the embedding-bag lookups in
aten/src/ATen/native/quantized/cuda/EmbeddingBag.cu) are left to run. The error is the dispatcher's own.
"""
from __future__ import annotations

import torch

_HOST_ONLY_ATEN = {"aten::histogram", "aten::_histogramdd_bin_edges", "aten::_histogramdd_from_bin_cts",
                   "aten::_histogramdd_from_bin_tensors"}
_CUDA_KERNELS = {"quantized::embedding_bag_byte_unpack", "quantized::embedding_bag_byte_rowwise_offsets",
                 "quantized::embedding_bag_4bit_unpack", "quantized::embedding_bag_4bit_rowwise_offsets"}


def refusal(func):
    """For an op without a CUDA kernel in CUDA builds, what raises the dispatcher's error; None for the others."""
    name = func._schema.name
    if name not in _HOST_ONLY_ATEN and (func.namespace != "quantized" or name in _CUDA_KERNELS):
        return None
    backends = [line.split(":")[0] for line in torch._C._dispatch_dump(func.name()).splitlines()
                if ": registered at" in line and not line.startswith("debug")]  # its kernels (the error lists more)

    def refuse(_args) -> None:
        raise NotImplementedError(
            f"Could not run '{func.name()}' with arguments from the 'CUDA' backend. This could be because the "
            "operator doesn't exist for this backend, or was omitted during the selective/custom build process (if "
            f"using custom build). '{func.name()}' is only available for these backends: [{', '.join(backends)}].")
    return refuse
