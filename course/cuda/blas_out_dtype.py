"""Matrix products with an `out_dtype` (`torch.mm(a, b, out_dtype=torch.float32)`): kernels only CUDA has.

Their `.dtype` overloads (`mm`, `bmm`, `addmm`, `baddbmm`) are registered for CUDA alone (aten/src/ATen/native/cuda/
Blas.cpp, `_mm_dtype_cuda` and its siblings): cuBLAS reads float16/bfloat16 operands, accumulates in float32 and
writes a float32 result. The CPU computes the same from float32 copies of the operands (each half value is exact in
float32). The checks and their words are Blas.cpp's; float16 accumulation
(`torch.backends.cuda.matmul.allow_fp16_accumulation`) cannot write a float32 result, and cuBLAS refuses it.
"""
from __future__ import annotations

import torch

from course.cuda.kernel_dtypes import c10_name

aten = torch.ops.aten

_DTYPE_ERROR = "out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs"


def _check_out_dtype(operand: torch.Tensor, out_dtype: torch.dtype) -> None:
    if not (out_dtype == operand.dtype
            or (out_dtype == torch.float32 and operand.dtype in (torch.float16, torch.bfloat16))):
        raise RuntimeError(_DTYPE_ERROR)
    if out_dtype == torch.float32 and operand.dtype == torch.float16 \
            and torch.backends.cuda.matmul.allow_fp16_accumulation:
        raise RuntimeError("cuBLAS has no float16-accumulating GEMM with a float32 output "
                           "(torch.backends.cuda.matmul.allow_fp16_accumulation is True)")


def _check_matrices(self, mat2, first="self") -> None:
    for name, m in ((first, self), ("mat2", mat2)):
        if m.dim() != 2:
            raise RuntimeError(f"{name} must be a matrix, got {m.dim()}-D tensor")
    if self.size(1) != mat2.size(0):
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({self.size(0)}x{self.size(1)} and "
                           f"{mat2.size(0)}x{mat2.size(1)})")


def _check_batches(batch1, batch2, out_dtype, self=None) -> None:
    """`baddbmm_bmm_out_dtype_checks` (Blas.cpp)."""
    if batch1.dim() != 3:
        raise RuntimeError("batch1 must be a 3D tensor")
    if batch2.dim() != 3:
        raise RuntimeError("batch2 must be a 3D tensor")
    bs, rows, contraction = batch1.shape
    if batch2.size(0) != bs or batch2.size(1) != contraction:
        raise RuntimeError(f"Expected size for first two dimensions of batch2 tensor to be: [{bs}, {contraction}] "
                           f"but got: [{batch2.size(0)}, {batch2.size(1)}].")
    if batch1.dtype != batch2.dtype:
        raise RuntimeError("batch1 and batch2 must have the same dtype")
    _check_out_dtype(batch1, out_dtype)
    if self is not None:
        if self.dim() != 3:
            raise RuntimeError("self must be a 3D tensor")
        if tuple(self.shape) != (bs, rows, batch2.size(2)):
            raise RuntimeError("self must have the same shape as the output")


def _in(out_dtype, *tensors):
    return [t.to(out_dtype) for t in tensors]


def mm_dtype(self, mat2, out_dtype):
    _check_matrices(self, mat2)
    if self.dtype != mat2.dtype:
        raise RuntimeError("input dtypes must be the same")
    _check_out_dtype(self, out_dtype)
    return aten.mm.default(*_in(out_dtype, self, mat2))


def bmm_dtype(self, mat2, out_dtype):
    _check_batches(self, mat2, out_dtype)
    return aten.bmm.default(*_in(out_dtype, self, mat2))


def addmm_dtype(self, mat1, mat2, out_dtype, *, beta=1, alpha=1):
    if self.dtype != mat2.dtype:
        raise RuntimeError(f"self and mat2 must have the same dtype, but got {c10_name(self.dtype)} and "
                           f"{c10_name(mat2.dtype)}")
    if mat1.dtype != mat2.dtype:
        raise RuntimeError(f"mat1 and mat2 must have the same dtype, but got {c10_name(mat1.dtype)} and "
                           f"{c10_name(mat2.dtype)}")
    _check_matrices(mat1, mat2, "mat1")
    _check_out_dtype(self, out_dtype)
    return aten.addmm.default(*_in(out_dtype, self, mat1, mat2), beta=beta, alpha=alpha)


def baddbmm_dtype(self, batch1, batch2, out_dtype, *, beta=1, alpha=1):
    _check_batches(batch1, batch2, out_dtype, self)
    return aten.baddbmm.default(*_in(out_dtype, self, batch1, batch2), beta=beta, alpha=alpha)


KERNELS = {
    aten.mm.dtype: mm_dtype,
    aten.bmm.dtype: bmm_dtype,
    aten.addmm.dtype: addmm_dtype,
    aten.baddbmm.dtype: baddbmm_dtype,
}
