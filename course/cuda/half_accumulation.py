"""Kernels whose sums CUDA keeps in float for half and bfloat16 tensors, where the CPU's keep the tensor's dtype.

A LayerNorm's bias gradient over 8192 rows of half is 8192 on a GPU and 2048 on the CPU, whose running sum in half stops
growing there; an embedding row looked up 5000 times gets 5000 on a GPU and 2048 on the CPU. CUDA's kernels accumulate
in `acc_type<scalar_t, true>` (float) and round once: layer_norm_kernel.cu (GammaBetaBackward, T_ACC; LayerNorm and
BatchNorm also save their mean and inverse deviation in float), group_norm_kernel.cu, cuDNN's batch norm, Embedding.cu
and EmbeddingBackwardKernel.cu (the sorted segment sums; `mode="max"` bags add with atomics, in the tensor's dtype, as
the CPU does), ReduceSumProdKernel.cu's `prod`, and Indexing.cu's `index_put_(accumulate=True)` (the backward of
`x[idx]`) when the rows it adds are at most a warp (32 elements) wide; wider rows take a kernel that rounds after every
addition, as the CPU does. The emulator runs the CPU's float kernels on the inputs widened to float and rounds each
result to the dtype of the tensor it belongs to.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten
_HALVES = (torch.float16, torch.bfloat16)
_EMBEDDING_BAG_MAX = 2  # EmbeddingBagMode::MAX
_WARP_SIZE = 32


def _in_float(op, sources, writes=(), skip=None):
    """`op` run in float for half or bfloat16 inputs. Its i-th result is rounded to the dtype of argument sources[i],
    or stays float where sources[i] is None (CUDA's saved statistics are float); the arguments in `writes`, which the
    op updates in place (running statistics), get the float values back, rounded."""
    def kernel(*args, **kwargs):
        if not any(isinstance(a, torch.Tensor) and a.dtype in _HALVES for a in args) or (skip and skip(args)):
            return op(*args, **kwargs)
        wide = [a.float() if isinstance(a, torch.Tensor) and a.dtype in _HALVES else a for a in args]
        out = op(*wide, **kwargs)
        for i in writes:
            if wide[i] is not args[i] and wide[i] is not None:
                args[i].copy_(wide[i])
        if isinstance(out, torch.Tensor):
            return out.to(args[sources[0]].dtype)
        return tuple(o if s is None or o is None or not o.is_floating_point() else o.to(args[s].dtype)
                     for o, s in zip(out, sources))
    return kernel


def _product_in_float(op):
    """`prod`, whose CUDA kernel (ReduceSumProdKernel.cu's `reduce_dispatch`) multiplies half and bfloat16 in float and
    rounds once; the CPU's multiplies in the tensor's dtype (0.5% off for 100 factors near 1 in bfloat16). A `dtype=`
    other than the input's already computes in that dtype on both."""
    def kernel(x, *args, **kwargs):
        if x.dtype not in _HALVES or kwargs.get("dtype") not in (None, x.dtype):
            return op(x, *args, **kwargs)
        return op(x.float(), *args, **{**kwargs, "dtype": None}).to(x.dtype)
    return kernel


def _slice_size(x: torch.Tensor, indices) -> int:
    """The elements index_put_ adds per index on CUDA (makeLinearIndex's sliceSize): those of the dimensions after the
    indexed ones, or of every dimension not indexed when the indexed ones are not adjacent (they move to the front)."""
    indexed, d = [], 0
    for ix in indices:
        width = 1 if ix is None or ix.dtype not in (torch.bool, torch.uint8) else ix.dim()
        if ix is not None:
            indexed.extend(range(d, d + width))
        d += width
    if not indexed:
        return x.numel()
    if indexed == list(range(indexed[0], indexed[-1] + 1)):
        return math.prod(x.shape[indexed[-1] + 1:])
    return math.prod(s for i, s in enumerate(x.shape) if i not in indexed)


def _sums_in_float(x, indices, accumulate) -> bool:
    return accumulate and x.dtype in _HALVES and _slice_size(x, indices) <= _WARP_SIZE


def index_put(x, indices, values, accumulate=False):
    if not _sums_in_float(x, indices, accumulate):
        return aten.index_put.default(x, indices, values, accumulate)
    return aten.index_put.default(x.float(), indices, values.float(), True).to(x.dtype)


def index_put_(x, indices, values, accumulate=False):
    if not _sums_in_float(x, indices, accumulate):
        return aten.index_put_.default(x, indices, values, accumulate)
    return x.copy_(aten.index_put.default(x.float(), indices, values.float(), True))


KERNELS = {
    aten.index_put.default: index_put,
    aten.index_put_.default: index_put_,
    # (input, normalized_shape, weight, bias, eps) -> out, mean, rstd
    aten.native_layer_norm.default: _in_float(aten.native_layer_norm.default, (0, None, None)),
    # (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask) -> d input, d weight, d bias
    aten.native_layer_norm_backward.default: _in_float(aten.native_layer_norm_backward.default, (1, 5, 6)),
    # (input, weight, bias, running_mean, running_var, training, momentum, eps) -> out, save_mean, save_invstd
    aten.native_batch_norm.default: _in_float(aten.native_batch_norm.default, (0, None, None), writes=(3, 4)),
    # (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask)
    aten.native_batch_norm_backward.default: _in_float(aten.native_batch_norm_backward.default, (1, 2, 2)),
    # (grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask); CUDA saves group norm's statistics in
    # the input's dtype (group_norm.cpp), as the CPU does, so only its backward's sums differ
    aten.native_group_norm_backward.default: _in_float(aten.native_group_norm_backward.default, (1, 4, 4)),
    aten.prod.default: _product_in_float(aten.prod.default),
    aten.prod.dim_int: _product_in_float(aten.prod.dim_int),
    aten.embedding_dense_backward.default: _in_float(aten.embedding_dense_backward.default, (0,)),
    # (grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode, sparse,
    # per_sample_weights, padding_idx): dense sum and mean bags
    aten._embedding_bag_backward.default: _in_float(
        aten._embedding_bag_backward.default, (0,), skip=lambda args: args[8] == _EMBEDDING_BAG_MAX or args[9]),
}
