"""`torch.fft` in half precision on emulated GPUs: cuFFT's float16 / complex32 transforms, which a CPU build lacks.

CUDA PyTorch lets float16 through its FFTs' dtype check only on a CUDA device (`promote_type_fft`,
aten/src/ATen/native/SpectralOps.cpp: "Only CUDA supports half precision FFT"), and cuFFT then takes only signal
sizes that are powers of two, with compute capability 5.3 or later (the `CuFFTConfig` constructor,
aten/src/ATen/native/cuda/CuFFTPlanCache.h). The results are complex32 for complex outputs and float16 for real
ones, and gradients flow back in the same dtypes.

Here the composite `torch.fft.*` function sees a CPU tensor in C++ and refuses Half, so the call is taken over at
the Python level: it runs on a float32 / complex64 copy, with cuFFT's size check made by the `_fft_*` kernels it
reaches (the sizes each transform is planned with), and its result is rounded to the half dtypes. The values are
cuFFT's computed in float and rounded once; the timeline has the two conversions as kernels of their own.
"""
from __future__ import annotations

import threading

import torch

from course.cuda.devices import CPU, EmulatedTensor, current_emulator

aten = torch.ops.aten
_HALF = (torch.float16, torch.complex32)
_computing_half = threading.local()  # set while a half transform runs in float on this thread


def _pow_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_signal(sizes: list[int]) -> None:
    """cuFFT's checks of a half-precision plan (CuFFTPlanCache.h), on the signal sizes of one transform."""
    major, minor = current_emulator("torch.fft in half precision").gpu.compute_capability
    if (major, minor) < (5, 3):
        raise RuntimeError("cuFFT doesn't support signals of half type with compute capability less than SM_53, but "
                           f"the device containing input half tensor only has SM_{major}{minor}")
    if not all(_pow_of_two(n) for n in sizes):
        raise RuntimeError("cuFFT only supports dimensions whose sizes are powers of two when computing in half "
                           f"precision, but got a signal size of[{', '.join(map(str, sizes))}]")


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.complex64 if dtype.is_complex else torch.float32


def _narrow(dtype: torch.dtype) -> torch.dtype:
    return torch.complex32 if dtype.is_complex else torch.float16


def _transform(op, signal_sizes):
    """An `_fft_*` kernel: cuFFT's size check when a half transform is planned, the CPU's transform in float for a
    half input (one called directly, or by a half transform's backward) rounded back."""
    def kernel(x, *args):
        half = x.dtype in _HALF
        if half or getattr(_computing_half, "on", False):
            _check_signal(signal_sizes(x, *args))
        if not half:
            return op(x, *args)
        return op(x.to(_wide(x.dtype)), *args).to(_narrow(x.dtype))
    return kernel


KERNELS = {
    aten._fft_c2c.default: _transform(aten._fft_c2c.default, lambda x, dim, *_: [x.shape[d] for d in dim]),
    aten._fft_r2c.default: _transform(aten._fft_r2c.default, lambda x, dim, *_: [x.shape[d] for d in dim]),
    aten._fft_c2r.default: _transform(aten._fft_c2r.default,
                                      lambda x, dim, _norm, last: [x.shape[d] for d in dim[:-1]] + [last]),
}


def _in_half(func):
    """A `torch.fft` function given a half GPU tensor: run in float, cuFFT's checks made, the result rounded."""
    def run(input, *args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            if not (isinstance(input, EmulatedTensor) and input._device_index != CPU and input.dtype in _HALF):
                return func(input, *args, **kwargs)
            out = kwargs.pop("out", None)
            _computing_half.on = True
            try:
                result = func(input.to(_wide(input.dtype)), *args, **kwargs)
            finally:
                _computing_half.on = False
            result = result.to(_narrow(result.dtype))
            return result if out is None else out.resize_(result.shape).copy_(result)
    return run


_FUNCTIONS = ["fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2", "rfftn", "irfftn",
              "hfft", "ihfft", "hfft2", "ihfft2", "hfftn", "ihfftn"]


def handlers() -> dict:
    """The torch.fft functions, for the emulator's torch-function routing."""
    return {getattr(torch.fft, name): _in_half(getattr(torch.fft, name)) for name in _FUNCTIONS}
