"""`F.dropout` on emulated GPUs runs CUDA's fused kernel, `aten.native_dropout`, as ATen's dropout does for a CUDA
input in training (aten/src/ATen/native/Dropout.cpp, `is_fused_kernel_acceptable`: 0 < p < 1, not in place).

The CPU the emulator runs on composes dropout instead (bernoulli_ into a noise tensor of the input's dtype, div_,
mul) and autograd keeps that noise for backward: 4 bytes an element in float32 where CUDA keeps a 1-byte bool mask,
so activation memory was overstated, and a half-precision gradient was scaled by 1/(1-p) rounded to the input's
dtype where CUDA's masked_scale kernel scales in float. The fused op draws the same numbers from the generator, so
float32 values and gradients equal the CPU's; a dispatch mode (selective checkpointing's policy) sees the op a GPU
runs. Rank threads keep the CPU's composition: the fused op takes no `generator`, so its draw would miss the rank's
own generator (course/cuda/rank_rng.py catches the draws of ops that take one).
"""
from __future__ import annotations

import torch

from course.cuda import rank_rng
from course.cuda.devices import CPU, EmulatedTensor

_DROPOUT = torch.nn.functional.dropout


def dropout(input, p=0.5, training=True, inplace=False):
    with torch._C.DisableTorchFunctionSubclass():
        if training and not inplace and 0 < p < 1 and isinstance(input, EmulatedTensor) and \
                input._device_index != CPU and input.numel() > 0 and rank_rng.current() is None:
            return torch.native_dropout(input, p, True)[0]
        return _DROPOUT(input, p, training, inplace)


def handlers() -> dict:
    """For the emulator's torch-function routing."""
    return {torch.nn.functional.dropout: dropout}
