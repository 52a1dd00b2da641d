"""`torch.backends.cuda`'s switches for the CUDA libraries, answered as a CUDA build answers them.

A CPU build refuses `preferred_linalg_library("cusolver")` or `("magma")` and `preferred_blas_library("cublaslt")`
("... if PyTorch has not been compiled with ..."), and has no cuFFT plan cache ("Cannot access cuFFT plan cache
without ATen_cuda library"). A CUDA build takes the choices (aten/src/ATen/Context.cpp: a warning, once, that they
are experimental) and keeps a plan cache per GPU whose capacity can be read and set
(aten/src/ATen/native/cuda/CuFFTPlanCache.h). The choices change no values here, as the libraries agree up to
rounding; how many plans a cache holds is not modelled.
"""
from __future__ import annotations

import warnings

import torch
import torch.backends.cuda

from course.cuda.cuda_bindings import not_modelled

CUFFT_MAX_PLAN_NUM = 4096  # CuFFTPlanCache.h for CUDA 10 and later: the default capacity and the largest allowed


def _warn_experimental(which: str, warned: set) -> None:
    """TORCH_WARN_ONCE in Context::set{Linalg,Blas}PreferredBackend."""
    if which not in warned:
        warned.add(which)
        warnings.warn(f"torch.backends.cuda.{which} is an experimental feature. If you see any error or unexpected "
                      "behavior when this flag is set please file an issue on GitHub.", UserWarning, stacklevel=3)


def patches() -> list[tuple[object, dict]]:
    """Fresh state for each emulator: the preferred BLAS library and each GPU's plan-cache capacity."""
    set_linalg, set_blas, get_blas = (torch._C._set_linalg_preferred_backend, torch._C._set_blas_preferred_backend,
                                      torch._C._get_blas_preferred_backend)
    blas, max_plans, warned = {}, {}, set()

    def set_linalg_preferred(backend):
        try:
            set_linalg(backend)  # the CPU build stores the choice before it checks for the library
        except RuntimeError as error:
            if "has not been compiled with" not in str(error):
                raise
        if backend != torch._C._LinalgBackend.Default:
            _warn_experimental("preferred_linalg_library", warned)

    def set_blas_preferred(backend):
        blas["choice"] = backend
        if backend not in (torch._C._BlasBackend.Default, torch._C._BlasBackend.Cublas):
            _warn_experimental("preferred_blas_library", warned)

    def get_blas_preferred():
        choice = blas.get("choice", get_blas())
        return torch._C._BlasBackend.Cublas if choice == torch._C._BlasBackend.Default else choice

    def get_max_plans(device_index):
        return max_plans.get(device_index, CUFFT_MAX_PLAN_NUM)

    def set_max_plans(device_index, new_size):
        if new_size < 0:
            raise RuntimeError(f"cuFFT plan cache size must be non-negative, but got {new_size}")
        if new_size > CUFFT_MAX_PLAN_NUM:
            raise RuntimeError(f"cuFFT plan cache size can not be larger than {CUFFT_MAX_PLAN_NUM}, but got {new_size}")
        max_plans[device_index] = new_size

    def plans_held(device_index):
        raise not_modelled("torch.backends.cuda.cufft_plan_cache.size (the number of cuFFT plans cached)",
                           "its max_size can be read and set, and clear() runs")

    cache = vars(torch.backends.cuda.cuFFTPlanCache)
    return [(torch._C, {"_set_linalg_preferred_backend": set_linalg_preferred,
                        "_set_blas_preferred_backend": set_blas_preferred,
                        "_get_blas_preferred_backend": get_blas_preferred}),
            (cache["size"], {"getter": plans_held}),
            (cache["max_size"], {"getter": get_max_plans, "setter": set_max_plans}),
            (torch.backends.cuda.cuFFTPlanCache, {"clear": lambda self: None})]
