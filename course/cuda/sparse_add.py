"""Sparse + sparse addition as CUDA does it: the two tensors' indices and values concatenated, not merged.

`add_out_sparse_cuda` (aten/src/ATen/native/sparse/cuda/SparseCUDATensorMath.cu) avoids reading nnz back to the
host by leaving the sum uncoalesced (`is_coalesced()` False, `_nnz()` the two counts added) unless it would hold more
entries than the tensor has elements; the CPU's kernel merges them into a coalesced sum, and refuses half precision,
which CUDA takes since nothing is summed. Dense + sparse, other layouts and the errors stay the CPU's.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _both_coo(x, other) -> bool:
    return isinstance(other, torch.Tensor) and x.layout == torch.sparse_coo and other.layout == torch.sparse_coo


def _concatenated(t, src, alpha, out_dtype):
    """The sum CUDA's kernel makes, in out_dtype; None where it would raise (the CPU op then raises the same)."""
    common = torch.result_type(t, src)
    if not torch.can_cast(common, out_dtype) or t.shape != src.shape:
        return None
    if src._nnz() == 0:
        return t.to(out_dtype)
    if t._nnz() == 0:
        return (src * alpha).to(out_dtype)
    if t.sparse_dim() != src.sparse_dim():
        return None
    s_values = src._values().to(common)
    if alpha != 1:
        s_values = s_values * alpha
    indices = torch.cat([t._indices(), src._indices()], 1)
    values = torch.cat([t._values().to(common), s_values], 0)
    out = torch.sparse_coo_tensor(indices, values, src.shape, is_coalesced=False, check_invariants=False)
    if out_dtype != common:
        out = out.coalesce().to(out_dtype)
    return out.coalesce() if out._nnz() > out.numel() else out


def _kernel(op, sign: int, inplace: bool):
    def kernel(x, other, *, alpha=1):
        if _both_coo(x, other) and not (sign < 0 and x.dtype == other.dtype == torch.bool):
            out = _concatenated(x, other, sign * alpha, x.dtype if inplace else torch.result_type(x, other))
            if out is not None:
                return x.copy_(out) if inplace else out
        return op(x, other, alpha=alpha)
    return kernel


KERNELS = {
    aten.add.Tensor: _kernel(aten.add.Tensor, 1, False),
    aten.add_.Tensor: _kernel(aten.add_.Tensor, 1, True),
    aten.sub.Tensor: _kernel(aten.sub.Tensor, -1, False),
    aten.sub_.Tensor: _kernel(aten.sub_.Tensor, -1, True),
}
