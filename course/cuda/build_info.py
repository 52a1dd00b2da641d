"""What a CUDA build of PyTorch says about itself: `torch.version.cuda`, `torch.backends.cudnn.version()`,
`torch.cuda.get_arch_list()` (and so `get_gencode_flags()`), `torch.backends.cuda.is_built()`, answered while the
emulator runs.

A CPU build answers None, None and [], so programs that branch on them (`if torch.version.cuda:`,
`cudnn.version() >= 8000`, `"sm_80" in torch.cuda.get_arch_list()`) would silently take their CPU paths. The
emulator reports the build a GPU box running this torch release would have: the CUDA 12.6 wheels, the one build of
torch 2.13 whose kernels cover every GPU preset (V100's sm_70 included; CUDA 13 builds start at sm_75).
Sources: torch 2.13 ships cu126 and cu130 wheels (pytorch/FBGEMM PR 5976, which counted them on
download.pytorch.org); the cu126 build's architectures are 5.0;6.0;7.0;7.5;8.0;8.6;9.0 without PTX (pytorch/pytorch
RELEASE.md support matrix, PR 182849 for release 2.12, and .ci/manywheel/build_cuda.sh), and it pins cuDNN 9.10.2.21 (the legacy CUDA 12.6 line of
the release RFCs, pytorch/pytorch issues 172663 and 190355), which `cudnn.version()` encodes as 91002
(major * 10000 + minor * 100 + patch for cuDNN 9, CUDNN_VERSION in cudnn_version.h; NVIDIA/cosmos-framework PR 153
prints 92000 for torch 2.13+cu130's cuDNN 9.20.0). sm_89 GPUs (L4, RTX 4090) run
the sm_86 code, as CUDA's binary compatibility within a major version allows.

Nothing in torch reads these in a way that breaks on a CPU build while they are set: `torch.cuda._is_compiled()` still
answers False (cuda_api.DEVICE_BINDINGS), so cpp_extension finds no CUDA_HOME and `_lazy_init`'s capability checks
are not reached; cpp_extension names its build folder `py311_cu126` as on the GPU box; inductor keys its caches by it
(torch.compile runs eagerly here). `torch.backends.cudnn.is_available()` is True and `is_acceptable(x)` answers as on a
GPU (cuDNN on, x a float16/32/64 GPU tensor): a CPU build's answer made nn.LSTM's `flatten_parameters` warn "PyTorch
was compiled without cuDNN" for every model moved to a GPU. Past that check it asks
`torch._use_cudnn_rnn_flatten_weight()`, which stays False on this build, so it still does nothing.

`torch.backends.cuda.is_flash_attention_available()` is True, as on every Linux CUDA build: PyTorch's CMakeLists.txt
turns USE_FLASH_ATTENTION on for "USE_CUDA OR USE_ROCM;NOT MSVC". A CPU build's False told programs and test suites
(which pick `SDPBackend.FLASH_ATTENTION` by it) that the A100 they see has no flash kernel.

`torch.backends.cuda.is_built()` (and its deprecated alias `torch.has_cuda`) answers True to the program: scripts pick
their device with `torch.cuda.is_available() and torch.backends.cuda.is_built()`, and a CPU build's False sent them to
the CPU, silently, with nothing on the emulated GPUs. PyTorch's own modules keep the CPU build's False, because each one
that asks goes on to the C++ CUDA bindings a CPU build lacks: torch/_inductor/cudagraph_trees.py imports
`torch._C._cuda_CUDAAllocator_AllocatorState` at import time (an ImportError here), the test harness's
`setBlasBackendsToDefaultFinally` (torch/testing/_internal/common_utils.py) calls
`torch._C._cuda_resetCublasWorkspaceSize`, and torch/_native/triton_utils.py and cutedsl_utils.py cache their answer for
the rest of the process. The original `torch.cuda.Stream.__new__` asks too; under the emulator `torch.cuda.Stream` is
the emulator's (cuda_api.Stream).
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.backends.cuda
import torch.backends.cudnn
import torch.version

CUDA_VERSION = "12.6"
CUDNN_VERSION = 91002  # cuDNN 9.10.2
ARCH_FLAGS = "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90"  # what torch._C._cuda_getArchFlags() gives on that build


def is_acceptable(tensor) -> bool:
    """`torch.backends.cudnn.is_acceptable`: whether cuDNN would take `tensor`, as a CUDA build with cuDNN answers."""
    return (torch.backends.cudnn.enabled and tensor.device.type == "cuda"
            and tensor.dtype in torch.backends.cudnn.CUDNN_TENSOR_DTYPES)


def get_arch_list() -> list[str]:
    """`torch.cuda.get_arch_list()`; PyTorch's own `get_gencode_flags()` builds its flags from this."""
    return ARCH_FLAGS.split()


@functools.wraps(torch.backends.cuda.is_built)  # torch.has_cuda's deprecation warning names it as torch's
def is_built() -> bool:
    caller = sys._getframe(1).f_globals.get("__name__", "")
    return not caller.startswith("torch.")  # torch's own modules (see above); torch/__init__ only for torch.has_cuda


# torch.backends.cudnn is a module object of its own class (CudnnModule) around the real module: what programs read
# goes on that class, so the real module's own functions (`set_flags`, `flags`, which read the CUDA-only benchmark
# limit when cuDNN is available) keep the CPU build's answers.
PATCHES = [(torch.version, {"cuda": CUDA_VERSION}),
           (type(torch.backends.cudnn), {"version": staticmethod(lambda: CUDNN_VERSION),
                                         "is_available": staticmethod(lambda: True),
                                         "is_acceptable": staticmethod(is_acceptable)}),
           (torch.cuda, {"get_arch_list": get_arch_list}),
           (torch.backends.cuda, {"is_built": is_built, "is_flash_attention_available": lambda: True}),
           (torch, {"_deprecated_attrs": {**torch._deprecated_attrs, "has_cuda": is_built}})]
