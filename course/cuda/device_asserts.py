"""Index and value checks that CUDA's kernels make on the GPU: a device-side assert, not the CPU's error.

A class index past the classifier's width, a token id past the embedding table, a gather index out of range: the
CPU's kernels check these on the host and raise an IndexError or RuntimeError naming the value; CUDA's kernels check
them in device code (`CUDA_KERNEL_ASSERT`, `_assert_async`), and the program gets "CUDA error: device-side assert
triggered", the words learners search for. The emulator raises it at the op itself (a GPU reports it at a later
call, after which its CUDA context is unusable, which is not modelled), with the CPU's words as what was checked.
`F.one_hot` of a GPU tensor leaves its check to scatter's assert, but a tensor subclass takes its scatter-free path
(Onehot.cpp), which checks nothing: its labels are checked here.
"""
from __future__ import annotations

import re

import torch

from course.cuda.devices import CPU, EmulatedTensor

aten = torch.ops.aten

# The CPU's words for the bounds and range checks these ops' CUDA kernels make on the device; their other checks
# (dtypes, shapes, dimensions) run on the host on a GPU too.
_OUT_OF_RANGE = re.compile(r"Target -?\d+ is out of bounds|index out of range in self|index -?\d+ is out of bounds "
                           r"for dimension|out of range: tried to access index|all elements of input should be "
                           r"between 0 and 1|probability tensor contains either|invalid multinomial distribution")
_OPS = {aten.nll_loss_forward, aten.nll_loss2d_forward, aten.index_select, aten.embedding, aten.index,
        aten.index_put, aten.index_put_, aten._index_put_impl_, aten.gather, aten.scatter, aten.scatter_,
        aten.scatter_add, aten.scatter_add_, aten.scatter_reduce, aten.scatter_reduce_, aten.index_add,
        aten.index_add_, aten.take, aten.binary_cross_entropy, aten.multinomial}

_WORDS = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at some other "
          "API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
          "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


def asserts(func) -> bool:
    """Whether `func`'s CUDA kernel checks values on the device (`_assert_async` does nothing else)."""
    return func._overloadpacket in _OPS or func._overloadpacket is aten._assert_async


def triggered(func, error: Exception) -> Exception | None:
    """The error a GPU gives where the CPU's kernel raised `error`, or None when a GPU raises the same."""
    if not isinstance(error, (IndexError, RuntimeError)):
        return None
    if func._overloadpacket is not aten._assert_async and not _OUT_OF_RANGE.search(str(error)):
        return None
    return _device_assert(str(error).splitlines()[0])


def _device_assert(cpu_words: str) -> Exception:
    return torch.AcceleratorError(f"{_WORDS}(emulated GPU: the kernel's assert checked what the CPU words as "
                                  f"{cpu_words!r})")


_ONE_HOT = torch.nn.functional.one_hot


def _one_hot(tensor, num_classes=-1):
    """`F.one_hot`: labels below 0, or not below `num_classes`, trip scatter's assert on a GPU. Reading them here
    costs no simulated time (num_classes=-1 reads the maximum on a GPU too, with `.item()`)."""
    labels = tensor._inner if isinstance(tensor, EmulatedTensor) and tensor._device_index != CPU else None
    if labels is not None and labels.numel() and not labels.is_meta and labels.dtype == torch.long:
        if labels.min() < 0:
            raise _device_assert("Class values must be non-negative.")
        if 0 < num_classes <= labels.max():
            raise _device_assert("Class values must be smaller than num_classes.")
    with torch._C.DisableTorchFunctionSubclass():
        return _ONE_HOT(tensor, num_classes)


def handlers() -> dict:
    """`F.one_hot`, for the emulator's torch-function routing."""
    return {_ONE_HOT: _one_hot}
