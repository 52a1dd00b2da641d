"""The dtypes CUDA's matrix and vector products have kernels for: floating and complex ones only.

CUDA PyTorch dispatches `mm`/`addmm`, `bmm`/`baddbmm`, `addmv` (which `mv` and a matrix-vector `matmul` run on) and
`dot` (which a real `vdot` and a vector-vector `matmul` run on) with AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES_AND2(Half,
BFloat16) (aten/src/ATen/native/cuda/Blas.cpp: `addmm_out_cuda_impl`, `baddbmm_out_cuda_impl`, `addmv_out_cuda`,
`dot_cuda`, `vdot_cuda`; cuBLAS has no integer GEMM or GEMV, pytorch/pytorch#44428), so an integer, bool or float8
product raises there, where the CPU, whose kernels the emulator runs, computes it. The emulator raises PyTorch's CUDA
error instead, so a program that works here works on a GPU.
"""
from __future__ import annotations

import torch

from course.cuda.kernel_dtypes import not_implemented

# The name each op's CUDA dispatch gives in its error.
DISPATCH_NAMES = {
    torch.ops.aten.mm: "addmm_cuda",
    torch.ops.aten.addmm: "addmm_cuda",
    torch.ops.aten.bmm: "baddbmm_cuda",
    torch.ops.aten.baddbmm: "baddbmm_cuda",
    torch.ops.aten.addmv: "addmv_impl_cuda",
    torch.ops.aten.mv: "addmv_impl_cuda",  # native_functions.yaml: mv is addmv_out(result, result, self, vec, 0, 1)
    torch.ops.aten.dot: "dot",
    torch.ops.aten.vdot: "dot",  # vdot_cuda calls dot_cuda for real dtypes; complex ones are supported
    torch.ops.aten.addbmm: "addmm_cuda",  # addbmm_out_cuda runs addmm_out_cuda on the batches
    torch.ops.aten._trilinear: "baddbmm_cuda",  # F.bilinear: its C++ reduces with bmm, below the emulator
}

_SUPPORTED = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
                        torch.complex128})

# c10's names for the scalar types (c10/core/ScalarType.h), as the dispatch error prints them.
def check(name: str, args) -> None:
    """Raise CUDA's error if the op's first tensor argument has a dtype its CUDA kernel does not dispatch.
    `addmv_out_cuda` returns before its dispatch for an empty matrix (zeros, or beta * self)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name == "addmv_impl_cuda" and next(t for t in tensors if t.dim() == 2).numel() == 0:
        return
    dtype = tensors[0].dtype
    if dtype not in _SUPPORTED:
        raise not_implemented(name, dtype)
