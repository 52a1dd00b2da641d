"""CUDA kernels that dispatch fewer dtypes than the CPU kernels the emulator runs: a GPU raises where the CPU computes.

Each entry is the op, the name its CUDA kernel's AT_DISPATCH macro gives (the error prints it), and the dtypes it lacks
that the CPU kernel has, read from the CUDA sources in aten/src/ATen/native/cuda/: UnaryComplexKernels.cu (angle:
floating and complex only), IGammaKernel.cu (igamma, igammac: floating only), SummaryOps.cu (`_histc_cuda`: no Half, no
BFloat16), UpSampleBilinear2d.cu and UpSampleBicubic2d.cu (floating only), DilatedMaxPool2d.cu, DilatedMaxPool3d.cu,
AveragePool2d.cu, AveragePool3d.cu (floating only), Dropout.cu (`masked_scale`: floating only), ScatterGatherKernel.cu
(scatter_reduce's prod, amax, amin and mean: no Bool), LossCTC.cu and Distance.cu (ctc_loss, cdist and pdist: float
and double only; the CPU lacks half too, but its error would say a GPU runs them; cdist's matrix-product path for p=2
takes half, and is another op). Integer convolutions
run on the CPU's slow kernels; on CUDA the slow kernels `_select_conv_backend` (Convolution.cpp) falls back to dispatch
floating dtypes only (ConvolutionMM2d.cu, DilatedConvolution.cu, DepthwiseConv2d.cu, NaiveConvolutionTranspose2d.cu and
3d.cu), so the error names the one that backend choice reads as picked.
It is a list rather than a rule drawn from OpInfo's dtypesIfCUDA: OpInfo names Python functions, not the aten ops the
emulator sees, and lists a dtype only when every sample runs (torch.einsum on integers runs on a GPU for 'i->' but not
'ij,jk'), so it cannot say which kernel refuses what. tests/pytorch_harness/opinfo_dtype_sweep_tests.py checks the list
against op_db.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_INTEGERS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool})
_HALVES = frozenset({torch.float16, torch.bfloat16})

_UNSIGNED = frozenset({torch.uint16, torch.uint32, torch.uint64})
_FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})

# c10's names for the scalar types (c10/core/ScalarType.h), as a dispatch error prints them.
C10_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
             torch.bool: "Bool", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
             torch.float64: "Double", torch.complex32: "ComplexHalf", torch.complex64: "ComplexFloat",
             torch.complex128: "ComplexDouble", torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64"}


def c10_name(dtype: torch.dtype) -> str:
    """How ATen's messages print a dtype ("Half", "Float")."""
    return C10_NAMES.get(dtype) or str(dtype).removeprefix("torch.").capitalize()


def not_implemented(kernel: str, dtype: torch.dtype) -> NotImplementedError:
    """The error an AT_DISPATCH macro raises for a dtype it does not list (here and in blas_dtypes.py)."""
    return NotImplementedError(f'"{kernel}" not implemented for \'{c10_name(dtype)}\'')

# op: (the CUDA kernel's dispatch name, dtypes it lacks, whether the dtype is the inputs' common one or the first's)
_REFUSED = {
    aten.angle: ("angle_cuda", _HALVES, False),
    aten.igamma: ("igamma_cuda", _HALVES, True),
    aten.igamma_: ("igamma_cuda", _HALVES, True),
    aten.igammac: ("igammac_cuda", _HALVES, True),
    aten.igammac_: ("igammac_cuda", _HALVES, True),
    aten.histc: ("histc", _HALVES, False),
    aten.upsample_bilinear2d: ("upsample_bilinear2d_out_frame", _INTEGERS, False),
    aten._upsample_bilinear2d_aa: ("upsample_bilinear2d_out_frame", _INTEGERS, False),
    aten._upsample_bicubic2d_aa: ("upsample_bilinear2d_out_frame", _INTEGERS, False),  # one template for both
    aten.upsample_bicubic2d: ("upsample_bicubic2d_out_frame", _INTEGERS, False),
    aten.max_pool2d_with_indices: ("max_pool2d_with_indices_out_cuda_frame", _INTEGERS, False),
    aten.max_pool3d_with_indices: ("max_pool3d_with_indices_out_frame", _INTEGERS, False),
    aten.avg_pool2d: ("avg_pool2d_out_cuda_frame", _INTEGERS, False),
    aten.avg_pool3d: ("avg_pool3d_out_cuda", _INTEGERS, False),
    aten.native_dropout_backward: ("masked_scale", _INTEGERS, False),
    aten.scatter_reduce: ("cuda_scatter_gather_base_kernel_func", frozenset({torch.bool}), False),  # not for "sum"
    aten.scatter_reduce_: ("cuda_scatter_gather_base_kernel_func", frozenset({torch.bool}), False),
    aten._ctc_loss: ("ctc_loss_cuda", _HALVES, False),
    aten._cdist_forward: ("cdist_cuda", _HALVES, False),
    aten._pdist_forward: ("pdist_cuda", _HALVES, False),
    aten.convolution: (None, _INTEGERS, False),  # the name depends on the slow kernel chosen: _convolution_kernel
    # BinaryMulKernel.cu and BinaryBitwiseOpsKernels.cu list no unsigned type wider than a byte; the CPU's mul and
    # bitwise kernels add AT_BAREBONES_UNSIGNED_TYPES
    aten.mul: ("mul_cuda", _UNSIGNED, True),
    aten.mul_: ("mul_cuda", _UNSIGNED, True),
    aten.bitwise_and: ("bitwise_and_cuda", _UNSIGNED, True),
    aten.bitwise_and_: ("bitwise_and_cuda", _UNSIGNED, True),
    aten.bitwise_or: ("bitwise_or_cuda", _UNSIGNED, True),
    aten.bitwise_or_: ("bitwise_or_cuda", _UNSIGNED, True),
    aten.bitwise_xor: ("bitwise_xor_cuda", _UNSIGNED, True),
    aten.bitwise_xor_: ("bitwise_xor_cuda", _UNSIGNED, True),
    # AbsKernel.cu: no float8 (nor `torch.isfinite`, which takes abs); the CPU's abs has them
    aten.abs: ("abs_cuda", _FLOAT8, False),
    aten.abs_: ("abs_cuda", _FLOAT8, False),
}


def _convolution_kernel(args) -> str:
    """The CUDA kernel `_select_conv_backend` picks for a dtype cuDNN does not take (aten/src/ATen/native/
    Convolution.cpp): depthwise, transposed, dilated or plain, 2-D (1-D is run as 2-D) or 3-D."""
    x, weight, _bias, _stride, _padding, dilation, transposed, _output_padding, groups = args[:9]
    three_d = x.dim() == 5
    if transposed:
        return "slow_conv_transpose3d_out_cuda" if three_d else "slow_conv_transpose2d_out_cuda"
    if not three_d and groups > 1 and x.size(1) == groups and weight.size(0) % x.size(1) == 0:
        return "conv_depthwise2d_forward_cuda"
    return "slow_conv_dilated<>" if three_d or any(d != 1 for d in dilation) else "slow_conv2d_cuda"


def _layer_norm_dtypes(args) -> None:
    """`native_layer_norm(input, normalized_shape, weight, bias, eps)`: CUDA's LayerNormKernelImplInternal reads the
    weight and bias as the input's type (`gamma.const_data_ptr<T>()`, layer_norm_kernel.cu), so a float LayerNorm
    given a half input, or a half one given a float input, stops in that read; the CPU's kernel takes half input
    with float parameters (its mixed type path), and the emulator computes both in float."""
    x = args[0]
    for parameter in args[2:4]:
        if isinstance(parameter, torch.Tensor) and parameter.dtype != x.dtype and x.numel():
            raise RuntimeError(f"expected scalar type {c10_name(x.dtype)} but found "
                               f"{c10_name(parameter.dtype)}")


def _takes_cudnn_batch_norm(x, weight, bias, running_mean, running_var, training) -> bool:
    """`_select_batch_norm_backend` (aten/src/ATen/native/Normalization.cpp) on a GPU built with cuDNN 9, whose
    CUDNN_BN_MIN_EPSILON is 0: cuDNN for no bfloat16, a half input only with float parameters, weight and bias
    given, running statistics given (or neither, in training), at least 3 dimensions and cuDNN's size limits."""
    return (torch.backends.cudnn.enabled and weight is not None and bias is not None
            and torch.bfloat16 not in (x.dtype, weight.dtype)
            and (x.dtype != torch.float16 or weight.dtype == torch.float32)
            and ((running_mean is not None and running_var is not None)
                 or (running_mean is None and running_var is None and training))
            and x.dim() >= 3 and x.size(0) <= (880801 if training else 65535) and x.numel() < 2 ** 31 - 1)


def _same_types(*arguments) -> None:
    """ATen's `checkAllSameType` (TensorUtils.cpp) on (position, name, tensor) arguments, the undefined ones skipped."""
    (first_pos, first_name, first), *rest = [a for a in arguments if a[2] is not None]
    for pos, name, t in rest:
        if t.dtype != first.dtype:
            raise RuntimeError(
                f"Expected tensor for argument #{first_pos} '{first_name}' to have the same type as tensor for "
                f"argument #{pos} '{name}'; but type torch.cuda.{c10_name(first.dtype)}Tensor does not equal "
                f"torch.cuda.{c10_name(t.dtype)}Tensor (while checking arguments for cudnn_batch_norm)")


def _batch_norm_dtypes(args) -> None:
    """`native_batch_norm(input, weight, bias, running_mean, running_var, training, ...)` with parameters of another
    dtype than the input: the emulator computes any mix in float, a GPU only some. cuDNN's `cudnn_batch_norm`
    (cudnn/BatchNorm.cpp) wants a half input's weight in float, any other input's in its own dtype, and the running
    statistics in the weight's. CUDA's own kernels (cuda/Normalization.cu, Normalization.cuh) read the parameters of
    a "mixed type" call as the input's accumulate type (float for half, bfloat16 and float): the contiguous kernel's
    accessor checks it, the channels-last one's `const_data_ptr`; a strided input's TensorIterator casts any dtype."""
    x, weight, bias, running_mean, running_var, training = args[:6]
    if _takes_cudnn_batch_norm(x, weight, bias, running_mean, running_var, training):
        if x.dtype != torch.float16:
            _same_types((1, "input", x), (2, "weight", weight))
        _same_types((2, "weight", weight), (3, "bias", bias), (4, "running_mean", running_mean),
                    (5, "running_var", running_var))
        return
    parameters = [(name, t) for name, t in (("weight", weight), ("bias", bias)) if t is not None]
    if not parameters or parameters[0][1].dtype == x.dtype:
        return
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    channels_last = x.is_contiguous() and x.stride(1) == 1 or x.is_contiguous(memory_format=torch.channels_last)
    if not (x.is_contiguous() or channels_last) or x.numel() >= 2 ** 31:
        return  # the General path's TensorIterator
    for name, t in parameters:
        if t.dtype != acc:
            raise RuntimeError(f"expected scalar type {c10_name(acc)} but found {c10_name(t.dtype)}" if channels_last
                               else f"Expected {name} to have type {c10_name(acc)} but got {c10_name(t.dtype)}")


def _group_norm_dtypes(args) -> None:
    """`native_group_norm(input, weight, bias, N, ...)` of half or bfloat16 activations with float parameters, which
    group_norm.cpp's mixed-type check lets through and saves float statistics for: CUDA's GroupNormKernelImplInternal
    (group_norm_kernel.cu) writes the statistics as the input's type (`mean.mutable_data_ptr<T>()`) and stops; the CPU's
    kernel has a mixed-type path. Other mixes stop in the shared check, with the CPU's words on both."""
    x, parameters, batch = args[0], [t for t in args[1:3] if isinstance(t, torch.Tensor)], args[3]
    if x.dtype in _HALVES and parameters and all(t.dtype == torch.float32 for t in parameters) and batch:
        raise RuntimeError(f"expected scalar type {c10_name(x.dtype)} but found Float")


def refusal(func):
    """For an op whose CUDA kernel lacks dtypes the CPU's has, what raises CUDA's error for them; None for the rest."""
    if func._overloadpacket is aten.native_layer_norm:
        return _layer_norm_dtypes
    if func._overloadpacket is aten.native_batch_norm:
        return _batch_norm_dtypes
    if func._overloadpacket is aten.native_group_norm:
        return _group_norm_dtypes
    entry = _REFUSED.get(func._overloadpacket)
    if entry is None:
        return None
    name, refused, common = entry

    def refuse(args) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or any(t.numel() == 0 for t in tensors):  # empty inputs return before the kernels' dispatch
            return
        dtype = torch.result_type(tensors[0], args[1]) if common else tensors[0].dtype
        if dtype not in refused:
            return
        if func._overloadpacket in (aten.scatter_reduce, aten.scatter_reduce_) and args[4] == "sum":
            return  # its ReduceAdd kernel dispatches Bool too
        if func._overloadpacket is aten.histc and dtype is torch.float16:
            raise RuntimeError("HalfTensor is not supported")  # _histc_cuda checks Half before its dispatch
        if func._overloadpacket is aten.upsample_bilinear2d and tensors[0].shape[2:] == tuple(args[1] or ()):
            return  # upsample_bilinear2d_out_cuda_template copies a same-size input before its dispatch
        kernel = name or _convolution_kernel(args)
        raise not_implemented(kernel, dtype)
    return refuse
