"""LU without pivoting (`linalg.lu_factor(_ex)`, `linalg.lu`, `torch.lu` with `pivot=False`), which only CUDA runs.

A CPU build refuses it ("LU without pivoting is not implemented on the CPU", `apply_lu_factor` in
aten/src/ATen/native/BatchLinearAlgebraKernel.cpp); CUDA runs cuSOLVER's or MAGMA's getrf with no pivot array.
Without row exchanges the factorisation A = LU (L unit lower triangular) is unique where it exists, so it is computed
here by right-looking Doolittle elimination, as getrf's unblocked step does, with what PyTorch's CUDA path returns
around it (`lu_factor_looped_cusolver`, aten/src/ATen/native/cuda/linalg/BatchLinearAlgebraLib.cpp, and
`linalg_lu_factor_ex_out`): pivots 1..min(m, n) (test_linalg.py's test_linalg_lu_family checks those), `info` the
first step whose pivot is exactly zero (LAPACK getrf's convention), the NaNs that dividing by that zero pivot leaves
set to 0 (cuSOLVER writes NaN where MAGMA writes 0: pytorch/pytorch#53879), and LU in column-major strides.
Gradients come from PyTorch's own formulas (`lu_factor_ex_backward`, `linalg_lu_backward`), above this kernel.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _factor(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LU, pivots and info of a batch of m x n matrices, no row exchanged."""
    lu = a.clone()
    m, n = a.shape[-2:]
    k = min(m, n)
    info = torch.zeros(a.shape[:-2], dtype=torch.int32, device=a.device)
    for j in range(k):
        pivot = lu[..., j, j]
        info = torch.where((info == 0) & (pivot == 0), j + 1, info)
        lu[..., j + 1:, j] /= pivot.unsqueeze(-1)
        lu[..., j + 1:, j + 1:] -= lu[..., j + 1:, j:j + 1] * lu[..., j:j + 1, j + 1:]
    if lu.is_complex():  # nan_to_num has no complex kernel: PyTorch's CUDA path uses where(self == self, self, 0)
        lu = torch.where(lu == lu, lu, 0)
    else:
        lu = torch.nan_to_num(lu, 0, float("inf"), float("-inf"))
    pivots = torch.arange(1, k + 1, dtype=torch.int32, device=a.device).expand(a.shape[:-2] + (k,)).contiguous()
    return lu.mT.contiguous().mT, pivots, info


def linalg_lu_factor_ex(a, pivot=True, check_errors=False):
    if pivot:
        return aten.linalg_lu_factor_ex.default(a, pivot=pivot, check_errors=check_errors)
    lu, pivots, info = _factor(a)
    if check_errors:
        aten._linalg_check_errors.default(info, "torch.linalg.lu_factor_ex", is_matrix=a.dim() == 2)
    return lu, pivots, info


def linalg_lu(a, pivot=True):
    """P, L and U; P is empty without pivoting, as `linalg_lu_out` unpacks no pivots then."""
    if pivot:
        return aten.linalg_lu.default(a, pivot=pivot)
    lu, pivots, _info = _factor(a)
    return aten.lu_unpack.default(lu, pivots, True, False)


KERNELS = {aten.linalg_lu_factor_ex.default: linalg_lu_factor_ex, aten.linalg_lu.default: linalg_lu}
