"""ATen ops that only CUDA implements, or implements its own way, written with CPU torch ops so emulated GPUs run them.

`nn.SyncBatchNorm` is the common case: its forward and backward call the batch_norm_* ops below, which
a CPU build registers for no device at all. Each follows the CUDA kernel's math (aten/src/ATen/native/
cuda/Normalization.cuh): biased variance for normalising, unbiased for the running estimate,
statistics in float32 for half-precision inputs.
"""
from __future__ import annotations

import torch
import torch._prims_common

from course.cuda import blas_out_dtype, fused_attention_ops, half_accumulation, half_fft, sparse_add, unpivoted_lu
from course.cuda.devices import current_emulator
from course.cuda.kernel_dtypes import c10_name

aten = torch.ops.aten


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def batch_norm_stats(x, eps):
    xf = x.to(_stat_dtype(x))
    mean = xf.mean(_reduce_dims(x))
    var = (xf - _per_channel(mean, x)).square().mean(_reduce_dims(x))
    return mean, (var + eps).rsqrt()


def batch_norm_gather_stats_with_counts(x, means, invstds, running_mean, running_var, momentum, eps, counts):
    counts = counts.to(means.dtype).reshape(-1, 1)
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    variances = invstds.reciprocal().square() - eps
    var = (counts * (variances + (means - mean).square())).sum(0) / total
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * total / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return mean, (var + eps).rsqrt()


def batch_norm_gather_stats(x, means, invstds, running_mean, running_var, momentum, eps, count):
    counts = torch.full((means.shape[0],), count, dtype=means.dtype)
    return batch_norm_gather_stats_with_counts(x, means, invstds, running_mean, running_var, momentum, eps, counts)


def batch_norm_elemt(x, weight, bias, mean, invstd, eps):
    out = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight.to(mean.dtype), x)
    if bias is not None:
        out = out + _per_channel(bias.to(mean.dtype), x)
    return out.to(x.dtype)


def batch_norm_backward_reduce(grad_out, x, mean, invstd, weight, input_g, weight_g, bias_g):
    dims = _reduce_dims(x)
    dy = grad_out.to(mean.dtype)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x.to(mean.dtype) - _per_channel(mean, x))).sum(dims)
    nothing = mean.new_empty(0)
    grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and weight_g else nothing
    grad_bias = sum_dy.to(weight.dtype if weight is not None else mean.dtype) if bias_g else nothing
    if not input_g:
        sum_dy, sum_dy_xmu = nothing, nothing
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def batch_norm_backward_elemt(grad_out, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    norm = 1.0 / count.sum().to(mean.dtype)
    grad_mean = _per_channel(sum_dy * norm, x)
    proj_scale = _per_channel(sum_dy_xmu * norm * invstd * invstd, x)
    grad_scale = _per_channel(invstd if weight is None else invstd * weight.to(mean.dtype), x)
    xmu = x.to(mean.dtype) - _per_channel(mean, x)
    return ((grad_out.to(mean.dtype) - grad_mean - xmu * proj_scale) * grad_scale).to(x.dtype)


def linalg_lstsq(a, b, rcond=None, *, driver=None):
    """CUDA's least squares: only the QR-based `gels`, which is its default too (the CPU's is `gelsy`), so
    `residuals` is filled in for tall full-rank systems and `rank` comes back empty
    (aten/src/ATen/native/BatchLinearAlgebra.cpp, linalg_lstsq)."""
    if driver not in (None, "gels"):
        raise RuntimeError("torch.linalg.lstsq: `driver` other than `gels` is not supported on CUDA")
    return aten.linalg_lstsq.default(a, b, rcond, driver="gels")


def linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    """cuSOLVER's SVD takes `driver=` gesvd, gesvdj or gesvda (torch/linalg/__init__.py, linalg.svd), which the CPU's
    LAPACK kernel refuses outright: it is checked as svd_cusolver checks it (BatchLinearAlgebraLib.cpp), then the
    CPU computes the same factorisation (no driver fixes the singular vectors' signs)."""
    if driver not in (None, "gesvd", "gesvdj", "gesvda"):
        raise RuntimeError(f"torch.linalg.svd: unknown svd driver {driver} in svd_cusolver computation. "
                           "Available drivers are gesvd, gesvdj, and gesvda.")
    return aten._linalg_svd.default(a, full_matrices, compute_uv)


def scaled_mm(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """CUDA's float8 GEMM refuses GPUs before Ada (sm_89) and shapes cuBLASLt cannot take, with the checks and words of
    `_scaled_mm_out_cuda` (aten/src/ATen/native/cuda/Blas.cpp); the CPU kernel would compute them all."""
    major, minor = current_emulator("torch._scaled_mm").gpu.compute_capability
    if not (major >= 9 or (major, minor) == (8, 9)):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or "
                           "8.9, or ROCm MI300+")
    if mat1.dim() == 2 and mat2.dim() == 2:
        if mat1.size(1) % 16:
            raise RuntimeError("Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: "
                               f"({mat1.size(0)}x{mat1.size(1)}).")
        if mat2.size(0) % 16 or mat2.size(1) % 16:
            raise RuntimeError(f"mat2 shape ({mat2.size(0)}x{mat2.size(1)}) must be divisible by 16")
        if mat1.dtype == mat2.dtype == torch.float8_e5m2:
            raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
        if _cublas_transposed(mat2) or not _cublas_transposed(mat1):
            raise RuntimeError("Only multiplication of row-major and column-major matrices is supported by cuBLASLt")
        _check_scaled_mm_output(mat1, mat2, scale_a, scale_b, bias, out_dtype or mat1.dtype)
    return aten._scaled_mm.default(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)


def _check_scaled_mm_output(mat1, mat2, scale_a, scale_b, bias, out_dtype):
    """The output and bias dtypes cuBLASLt's float8 GEMM and CUTLASS's row-wise one write, which the CPU kernel does
    not check (`_scaled_mm_out_cuda`, aten/src/ATen/native/cuda/ScaledBlas.cpp). Row-wise scaling goes to CUTLASS's
    kernel, bf16 or fp16 out only, wherever cuBLAS is older than 12.9, as in the CUDA 12.6 build emulated here."""
    if bias is not None:
        if out_dtype == torch.float32:
            raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
        if bias.dtype not in (torch.bfloat16, torch.float16):
            raise RuntimeError(f"Bias must be BFloat16 or Half, but got {c10_name(bias.dtype)}")
        if out_dtype == torch.bfloat16 and bias.dtype != torch.bfloat16:
            raise RuntimeError(f"Bias must be BFloat16 to compute {c10_name(out_dtype)} output, but got "
                               f"{c10_name(bias.dtype)}")
        if out_dtype == torch.float16 and bias.dtype != torch.float16:
            raise RuntimeError(f"Bias must be Float16 to compute {c10_name(out_dtype)} output, but got "
                               f"{c10_name(bias.dtype)}")
    rowwise = (tuple(scale_a.shape) == (mat1.size(0), 1) and tuple(scale_b.shape) == (1, mat2.size(1))
               and scale_a.numel() + scale_b.numel() > 2)
    if rowwise and out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError("Only bf16 and fp16 high precision output types are supported for row-wise scaling.")


def _cublas_transposed(matrix) -> bool:
    """`prepare_matrix_for_cublas`'s transpose flag (aten/src/ATen/native/cuda/Blas.cpp): True for a row-major matrix
    (or one copied to be); float8 GEMMs take only a row-major first and a column-major second operand (the "TN"
    layout `cublasCommonArgs` asks cuBLASLt for when it computes the row-major result as its transpose)."""
    if torch._prims_common.is_non_overlapping_and_dense_or_false(matrix):
        return matrix.is_contiguous()
    rows_stride, cols_stride = matrix.stride()
    return not (rows_stride == 1 and cols_stride >= max(1, matrix.size(0)))


def int_mm(mat1, mat2):
    """cuBLASLt's int8 GEMM takes fewer shapes than the CPU's: the checks of `_int_mm_out_cuda` (Blas.cpp)."""
    if mat1.dim() == 2 and mat2.dim() == 2:
        if mat1.size(0) <= 16:
            raise RuntimeError(f"self.size(0) needs to be greater than 16, but got {mat1.size(0)}")
        if mat1.size(1) <= 0 or mat1.size(1) % 8:
            raise RuntimeError(f"self.size(1) needs to be greater than 0 and a multiple of 8, but got {mat1.size(1)}")
        if mat1.size(1) == mat2.size(0) and (mat2.size(1) <= 0 or mat2.size(1) % 8):
            raise RuntimeError(f"mat2.size(1) needs to be greater than 0 and a multiple of 8, but got {mat2.size(1)}")
    return aten._int_mm.default(mat1, mat2)


def weight_int8pack_mm(x, weight, scales):
    """CUDA's int8 weight-only GEMM (`_weight_int8pack_mm_cuda`, aten/src/ATen/native/cuda/int8mm.cu) makes float32
    contiguous copies of its inputs, whatever their layout and float dtype, accumulates in float32 and returns the
    activations' dtype; the CPU kernel refuses non-contiguous or float64 activations, a transposed weight and scales of
    another dtype than the activations'."""
    for tensor, name, dims in ((x, "x", 2), (weight, "w", 2), (scales, "scale", 1)):
        if tensor.dim() != dims:
            raise RuntimeError(f"{name} must be {dims}D")
    if x.size(1) != weight.size(1):
        raise RuntimeError("K dimension mismatch: x.size(1) != w.size(1)")
    if weight.size(0) != scales.size(0):
        raise RuntimeError("Output dim mismatch: w.size(0) != scale.size(0)")
    if weight.dtype != torch.int8:
        raise RuntimeError(f"expected scalar type Char but found {torch.empty(0, dtype=weight.dtype).type()[6:-6]}")
    out = aten.mm(x.float().contiguous(), weight.float().t()) * scales.float()
    return out.to(x.dtype)


def cudnn_convolution(x, weight, padding, stride, dilation, groups, benchmark, deterministic, allow_tf32):
    """cuDNN's convolution without bias, which PyTorch's CUDA autocast lists and some programs call directly: the
    convolution every backend computes (aten/src/ATen/native/cudnn/ConvShared.cpp); TF32 is timed, not applied."""
    return aten.convolution.default(x, weight, None, stride, padding, dilation, False, [0] * len(padding), groups)


def cudnn_convolution_transpose(x, weight, padding, output_padding, stride, dilation, groups, benchmark, deterministic,
                                allow_tf32):
    """cuDNN's transposed convolution without bias, the same way."""
    return aten.convolution.default(x, weight, None, stride, padding, dilation, True, output_padding, groups)


def _softmax_kernel(op):
    """CUDA's softmax and log-softmax take `half_to_float`: a float result from a half input, computed in float as
    autocast's softmax asks (SoftMax.cu, softmax_cuda_out: 'conversion is supported for Half type only'); the CPU
    kernel refuses the flag."""
    def kernel(x, dim, half_to_float):
        if not half_to_float:
            return op(x, dim, False)
        if x.dtype != torch.float16:
            raise RuntimeError("conversion is supported for Half type only")
        return op(x.float(), dim, False)
    return kernel


def _softmax_backward_kernel(op):
    """Their backward takes a float gradient for a half input and returns the half one, computed in float
    (SoftMax.cu, softmax_backward_cuda_out); the CPU kernel refuses the mix."""
    def kernel(grad, output, dim, input_dtype):
        if grad.dtype == input_dtype:
            return op(grad, output, dim, input_dtype)
        if not (grad.dtype == torch.float32 and input_dtype == torch.float16):
            raise RuntimeError("expected input and grad types to match, or input to be at::Half and grad to be "
                               "at::Float")
        return op(grad, output.to(grad.dtype), dim, grad.dtype).to(input_dtype)
    return kernel


def nansum(x, dim=None, keepdim=False, *, dtype=None):
    """CUDA's nansum takes complex inputs, skipping an element whose real or imaginary part is NaN (`_isnan` of a
    complex, ReduceSumProdKernel.cu); the CPU kernel refuses complex ones."""
    if not x.is_complex():
        return aten.nansum.default(x, dim, keepdim, dtype=dtype)
    return aten.sum.dim_IntList(torch.where(torch.isnan(x), 0, x), dim, keepdim, dtype=dtype)


def _in_float(op):
    """A CUDA kernel for half and bfloat16 that the CPU lacks, or runs in half precision, which computes in float and
    rounds its result (AveragePool3d.cu, MultiMarginCriterion.cu, MultilabelMarginCriterion.cu, UpSampleBilinear2d.cu's
    antialiased kernels, bilinear and bicubic, all accumulate in `acc_type<scalar_t, true>`, float; Distributions.cu's
    gamma, Dirichlet and binomial samplers draw in it and its gamma gradient (a half Gamma's rsample) computes in it;
    GridSampler.cu interpolates in `opmath_type<scalar_t>`, float): the same in float on the CPU, rounded back."""
    def kernel(*args, **kwargs):
        halves = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16)]
        if not halves:
            return op(*args, **kwargs)
        up = [a.float() if isinstance(a, torch.Tensor) and a.dtype == halves[0] else a for a in args]
        out = op(*up, **kwargs)
        down = lambda t: t.to(halves[0]) if t.dtype == torch.float32 else t
        return tuple(down(t) for t in out) if isinstance(out, tuple) else down(out)
    return kernel


def abs_(x):
    """CUDA's abs takes bool (the identity; AbsKernel.cu dispatches Bool), which the CPU kernel refuses."""
    return x.clone() if x.dtype == torch.bool else aten.abs.default(x)


def trace(x):
    """CUDA's trace is the diagonal's sum (trace_cuda, TriangularOps.cu), so bool gives int64 as sum does; the CPU
    kernel refuses bool."""
    return aten.sum.default(x.diagonal()) if x.dtype == torch.bool else aten.trace.default(x)


_C_TYPES = {torch.uint8: "uint8_t", torch.int8: "int8_t", torch.int16: "int16_t", torch.int32: "int",
            torch.int64: "int64_t"}  # the names c10's AT_FORALL_SCALAR_TYPES gives them


def histc(x, bins=100, min=0, max=0):
    """CUDA's histc of an integer tensor (`_histc_cuda` dispatches integers; the CPU's kernel refuses them): bounds
    cast to the input's type, the data's own range when they are equal, widened by one each way if still equal, and
    each element's bin `(x - min) * bins / (max - min)` in integer arithmetic, the last bin closed (`getBin`,
    aten/src/ATen/native/cuda/SummaryOps.cu); counts in the input's dtype."""
    if x.is_floating_point() or x.is_complex():
        return aten.histc.default(x, bins, min, max)
    if bins <= 0:
        raise RuntimeError("bins must be > 0")
    if x.is_meta:  # shape-only: the counts' shape needs no data
        return x.new_empty(bins)
    limits = torch.iinfo(x.dtype)
    for bound in (min, max):  # Scalar::to<scalar_t>'s checked_convert (c10/core/Scalar.h)
        if not limits.min <= bound <= limits.max:
            raise RuntimeError(f"value cannot be converted to type {_C_TYPES[x.dtype]} without overflow")
    low, high = int(min), int(max)
    if low == high and x.numel() > 0:
        low, high = int(x.min()), int(x.max())
    if low == high:
        low, high = low - 1, high + 1
    if low >= high:
        raise RuntimeError("max must be larger than min")
    values = x.reshape(-1).long()
    values = values[(values >= low) & (values <= high)]
    index = ((values - low) * bins).div((high - low), rounding_mode="floor").clamp_(max=bins - 1)
    return torch.bincount(index, minlength=bins).to(x.dtype)


def _rrelu_in_float(op):
    """CUDA's rrelu for half (RreluWithNoise.cu dispatches Half; the CPU's kernel does not): the CPU's float kernel,
    which draws each negative element's slope from the generator as the float op does (the emulated GPU's draws are
    the host generator's, course/cuda/rng.py), its noise and result rounded to half."""
    def kernel(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
        if x.dtype != torch.float16:
            return op(x, noise, lower, upper, training, generator)
        wide_noise = noise.float()
        out = aten.rrelu_with_noise.default(x.float(), wide_noise, lower, upper, training, generator)
        noise.copy_(wide_noise)
        return x.copy_(out) if op is aten.rrelu_with_noise_.default else out.half()
    return kernel


_FLOAT_ACCUMULATING = [aten.avg_pool3d.default, aten.avg_pool3d_backward.default, aten.multi_margin_loss.default,
                       aten.multi_margin_loss_backward.default, aten.multilabel_margin_loss_forward.default,
                       aten.multilabel_margin_loss_backward.default, aten._upsample_bilinear2d_aa.default,
                       aten._upsample_bilinear2d_aa_backward.default, aten._upsample_bicubic2d_aa.default,
                       aten._upsample_bicubic2d_aa_backward.default, aten._standard_gamma.default,
                       aten._standard_gamma_grad.default,
                       aten._sample_dirichlet.default, aten.binomial.default, aten.grid_sampler_2d.default,
                       aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d.default,
                       aten.grid_sampler_3d_backward.default]

KERNELS = {
    **{op: _in_float(op) for op in _FLOAT_ACCUMULATING},
    **half_fft.KERNELS,
    **blas_out_dtype.KERNELS,
    **half_accumulation.KERNELS,
    **unpivoted_lu.KERNELS,
    **sparse_add.KERNELS,
    **fused_attention_ops.KERNELS,
    aten.abs.default: abs_,
    aten.histc.default: histc,
    aten.rrelu_with_noise.default: _rrelu_in_float(aten.rrelu_with_noise.default),
    aten.rrelu_with_noise_.default: _rrelu_in_float(aten.rrelu_with_noise_.default),
    aten.trace.default: trace,
    aten._softmax.default: _softmax_kernel(aten._softmax.default),
    aten._log_softmax.default: _softmax_kernel(aten._log_softmax.default),
    aten._softmax_backward_data.default: _softmax_backward_kernel(aten._softmax_backward_data.default),
    aten._log_softmax_backward_data.default: _softmax_backward_kernel(aten._log_softmax_backward_data.default),
    aten.nansum.default: nansum,
    aten.cudnn_convolution.default: cudnn_convolution,
    aten.cudnn_convolution_transpose.default: cudnn_convolution_transpose,
    aten.batch_norm_stats.default: batch_norm_stats,
    aten.batch_norm_gather_stats.default: batch_norm_gather_stats,
    aten.batch_norm_gather_stats_with_counts.default: batch_norm_gather_stats_with_counts,
    aten.batch_norm_elemt.default: batch_norm_elemt,
    aten.batch_norm_backward_reduce.default: batch_norm_backward_reduce,
    aten.batch_norm_backward_elemt.default: batch_norm_backward_elemt,
    aten.linalg_lstsq.default: linalg_lstsq,
    aten._linalg_svd.default: linalg_svd,
    aten._scaled_mm.default: scaled_mm,
    aten._int_mm.default: int_mm,
    aten._weight_int8pack_mm.default: weight_int8pack_mm,
}
