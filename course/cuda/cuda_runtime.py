"""`torch.cuda.cudart()`, the CUDA runtime module, as far as programs use it on emulated GPUs.

Programs profiled with Nsight Systems call `cudaProfilerStart`/`cudaProfilerStop` through it (directly or through
`torch.cuda.profiler`) and pass the result to `torch.cuda.check_error`; with no profiler attached CUDA answers
success, and so does the emulator, marking the timeline as `torch.cuda.profiler.start()` does. `check_error` and
`torch.cuda.CudaError` read the error codes and CUDA's strings for them from the same module. Other runtime calls
are refused by name.
"""
from __future__ import annotations

import enum
import types

from course.cuda import nvtx
from course.cuda.cuda_bindings import not_modelled


class cudaError(enum.IntEnum):  # noqa: N801 - named as torch._C._cudart.cudaError
    """cudaError_t's codes (CUDA's driver_types.h) for the errors the emulator names; other codes pass through."""
    success = 0
    invalid_value = 1
    memory_allocation = 2
    initialization_error = 3
    invalid_device = 101
    invalid_resource_handle = 400
    not_ready = 600

    @classmethod
    def _missing_(cls, value):
        code = int.__new__(cls, value)
        code._name_, code._value_ = f"error_{value}", value
        return code


_STRINGS = {  # cudaGetErrorString's words
    cudaError.success: "no error",
    cudaError.invalid_value: "invalid argument",
    cudaError.memory_allocation: "out of memory",
    cudaError.initialization_error: "initialization error",
    cudaError.invalid_device: "invalid device ordinal",
    cudaError.invalid_resource_handle: "invalid resource handle",
    cudaError.not_ready: "device not ready",
}


def _profiler_call(name: str):
    mark = nvtx.capture_mark(name)

    def call() -> cudaError:
        mark()
        return cudaError.success

    return call


def _refuse(name: str):
    raise not_modelled(f"torch.cuda.cudart().{name}", "the emulator models only cudaProfilerStart/Stop and error "
                       "strings of the CUDA runtime; run this part on a real GPU")


RUNTIME = types.ModuleType("torch._C._cudart")
RUNTIME.cudaError = cudaError
RUNTIME.cudaGetErrorString = lambda error: _STRINGS.get(cudaError(error), "unrecognized error code")
RUNTIME.cudaProfilerStart = _profiler_call("cudaProfilerStart")
RUNTIME.cudaProfilerStop = _profiler_call("cudaProfilerStop")
RUNTIME.__getattr__ = _refuse
