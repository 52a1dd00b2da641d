"""`torch.use_deterministic_algorithms(True)` on emulated GPUs: the CUDA kernels that raise (or warn) on a GPU.

The emulator runs CPU kernels, whose deterministic-mode checks are the CPU's: a program that runs here would stop
on a GPU box. Each op listed below raises PyTorch's own error, with the caller name its CUDA kernel passes to
`at::Context::alertNotDeterministic` (aten/src/ATen/Context.cpp), under the conditions the kernel checks; with
`warn_only=True` it warns instead. The list is the one torch.use_deterministic_algorithms documents as raising on CUDA
(ops it documents as raising everywhere, such as `put_` without accumulate or MaxUnpool, already raise in the CPU
kernel); ReflectionPad2d's backward, which the list still names, has a deterministic CUDA kernel
(aten/src/ATen/native/cuda/ReflectionPad.cu) and runs. Every cuBLAS matmul calls `alertCuBLASConfigNotDeterministic`
(aten/src/ATen/cuda/CUDABlas.cpp), which raises unless CUBLAS_WORKSPACE_CONFIG is ":4096:8" or ":16:8"; PyTorch
reads the variable once, at the first cuBLAS call of the process, and so does this.
"""
from __future__ import annotations

import os
import warnings

import torch

aten = torch.ops.aten

_CUBLAS_CONFIGS = (":4096:8", ":16:8")
_cublas_config_deterministic: bool | None = None


def _alert(message: str) -> None:
    """TORCH_WARN under warn_only=True, else TORCH_CHECK's error."""
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning)
    else:
        raise RuntimeError(message)


def _not_deterministic(caller: str) -> None:
    """`at::Context::alertNotDeterministic(caller)`, its two messages word for word."""
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(f"{caller} does not have a deterministic implementation, but you set "
                      "'torch.use_deterministic_algorithms(True, warn_only=True)'. You can file an issue at "
                      "https://github.com/pytorch/pytorch/issues to help us prioritize adding deterministic support "
                      "for this operation.", UserWarning)
        return
    raise RuntimeError(f"{caller} does not have a deterministic implementation, but you set "
                       "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this "
                       "operation, or you can use the 'warn_only=True' option, if that's acceptable for your "
                       "application. You can also file an issue at https://github.com/pytorch/pytorch/issues to help "
                       "us prioritize adding deterministic support for this operation.")


def _cublas() -> None:
    """`at::Context::alertCuBLASConfigNotDeterministic`."""
    global _cublas_config_deterministic
    if _cublas_config_deterministic is None:
        _cublas_config_deterministic = os.environ.get("CUBLAS_WORKSPACE_CONFIG") in _CUBLAS_CONFIGS
    if _cublas_config_deterministic:
        return
    _alert("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or "
           "`at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because it uses "
           "CuBLAS and you have CUDA >= 10.2. To enable deterministic behavior in this case, you must set an "
           "environment variable before running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8 or "
           "CUBLAS_WORKSPACE_CONFIG=:16:8. For more information, go to "
           "https://docs.nvidia.com/cuda/cublas/index.html#results-reproducibility")


def _named(func, args, kwargs) -> dict:
    return dict(zip((a.name for a in func._schema.arguments), args)) | kwargs


def _gemm(*operands):
    """cuBLAS runs (and alerts) only when the product has work: an empty result or inner dimension returns early."""
    def check(func, args, kwargs):
        named = _named(func, args, kwargs)
        first, second = named[operands[0]], named[operands[1]]
        if first.numel() and second.numel():
            _cublas()
    return check


def _always(caller: str):
    return lambda func, args, kwargs: _not_deterministic(caller)


def _functional_or_out(kernel: str):
    """A CUDA kernel pair that alerts as `<kernel>_cuda`, and as `<kernel>_out_cuda` for its out= overload."""
    return lambda func, args, kwargs: _not_deterministic(
        f"{kernel}_cuda" if func._overloadname == "default" else f"{kernel}_out_cuda")


def _when(caller: str, condition):
    def check(func, args, kwargs):
        if condition(_named(func, args, kwargs)):
            _not_deterministic(caller)
    return check


def _cumsum_is_floating(named) -> bool:
    """cumsum's CUDA kernel alerts for floating or complex results; 0-dim and empty inputs never reach it."""
    self, dtype = named["self"], named.get("dtype")
    dtype = dtype if dtype is not None else self.dtype
    return self.dim() > 0 and self.numel() > 0 and (dtype.is_floating_point or dtype.is_complex)


def _with_dim(func, args, kwargs) -> None:
    if func._overloadname in ("dim", "dim_values"):
        _not_deterministic("median CUDA with indices output")


# aten op (all overloads) -> check, from the CUDA kernels' alertNotDeterministic calls; kernels.run_kernel calls it
# on emulated GPUs while deterministic algorithms are enabled.
ALERTS = {
    aten.mm: _gemm("self", "mat2"), aten.addmm: _gemm("mat1", "mat2"), aten._addmm_activation: _gemm("mat1", "mat2"),
    aten.bmm: _gemm("self", "mat2"), aten.baddbmm: _gemm("batch1", "batch2"), aten.addbmm: _gemm("batch1", "batch2"),
    aten.mv: _gemm("self", "vec"), aten.addmv: _gemm("mat", "vec"),
    aten.avg_pool3d_backward: _always("avg_pool3d_backward_cuda"),
    # autograd calls the functional kernels, which alert under their own names (the out= ones say "_out_cuda")
    aten._adaptive_avg_pool2d_backward: _always("adaptive_avg_pool2d_backward_cuda"),
    aten._adaptive_avg_pool3d_backward: _always("adaptive_avg_pool3d_backward_cuda"),
    aten.adaptive_max_pool2d_backward: _always("adaptive_max_pool2d_backward_cuda"),
    aten.fractional_max_pool2d_backward: _always("fractional_max_pool2d_backward_cuda"),
    aten.fractional_max_pool3d_backward: _functional_or_out("fractional_max_pool3d_backward"),
    aten.upsample_linear1d_backward: _always("upsample_linear1d_backward_out_cuda"),
    aten.upsample_bilinear2d_backward: _always("upsample_bilinear2d_backward_out_cuda"),
    aten.upsample_bicubic2d_backward: _always("upsample_bicubic2d_backward_out_cuda"),
    aten.upsample_trilinear3d_backward: _always("upsample_trilinear3d_backward_out_cuda"),
    aten.reflection_pad1d_backward: _always("reflection_pad1d_backward_out_cuda"),
    aten.reflection_pad3d_backward: _always("reflection_pad3d_backward_out_cuda"),
    aten.nll_loss2d_forward: _when("nll_loss2d_forward_out_cuda_template", lambda n: n["reduction"] != 0),
    aten._ctc_loss_backward: _always("ctc_loss_backward_gpu"),
    aten._embedding_bag_dense_backward: _when("embedding_bag_backward_cuda_max", lambda n: n["mode"] == 2),
    # autograd calls this one: on CUDA it hands dense gradients to the kernel above, on the CPU it runs its own
    aten._embedding_bag_backward: _when("embedding_bag_backward_cuda_max",
                                        lambda n: n["mode"] == 2 and not n["sparse"]),
    aten.put_: _when("put_", lambda n: n.get("accumulate", False)),
    aten.put: _when("put_", lambda n: n.get("accumulate", False)),
    aten.histc: _always("_histc_cuda"),
    aten.bincount: _when("_bincount_cuda", lambda n: n.get("weights") is not None),
    aten.median: _with_dim, aten.nanmedian: _with_dim,
    aten.grid_sampler_2d_backward: _always("grid_sampler_2d_backward_cuda"),
    aten.grid_sampler_3d_backward: _always("grid_sampler_3d_backward_cuda"),
    aten.cumsum: _when("cumsum_cuda_kernel", _cumsum_is_floating),
    aten.cumsum_: _when("cumsum_cuda_kernel", _cumsum_is_floating),
    aten.scatter_reduce: _when("scatter_reduce_cuda", lambda n: n["reduce"] == "prod"),
    aten.scatter_reduce_: _when("scatter_reduce_cuda", lambda n: n["reduce"] == "prod"),
}
