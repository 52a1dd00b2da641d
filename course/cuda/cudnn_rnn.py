"""What cuDNN's RNN refuses that the CPU's RNN runs: nn.RNN, nn.GRU and nn.LSTM on emulated GPUs.

A CUDA build runs these modules' `torch._VF` ops with cuDNN when it takes the input (`cudnn_is_acceptable`:
float16, float32 or float64 on a GPU, cuDNN enabled), and cuDNN's kernels (aten/src/ATen/native/cudnn/RNN.cpp)
check what the CPU's do not: the hidden state must be contiguous ("rnn: hx is not contiguous", which public code
meets after slicing a bidirectional encoder's state), and a backward through an RNN run in eval mode is refused
("cudnn RNN backward can only be called in training mode"). The emulator computes with the CPU's RNN, so without
these checks such a program runs here and fails on a GPU. `with torch.backends.cudnn.flags(enabled=False)` runs
PyTorch's own kernels there, and here too.
"""
from __future__ import annotations

import torch

from course.cuda.devices import CPU, EmulatedTensor

_CUDNN_DTYPES = (torch.float16, torch.float32, torch.float64)


def _refuse_eval_mode_backward(grad):
    """A hook on an eval-mode RNN's outputs: the gradient reaching them stops as cuDNN's `_cudnn_rnn_backward` does.
    A hook, not an autograd Function, so the outputs stay the RNN's own (not views a program may not modify)."""
    raise RuntimeError("cudnn RNN backward can only be called in training mode")


def _on_cudnn(input) -> bool:
    return isinstance(input, EmulatedTensor) and input._device_index != CPU and input.dtype in _CUDNN_DTYPES \
        and torch.backends.cudnn.enabled


def _check_attributes(input, hidden, params) -> None:
    """RNN.h's `check_attributes`, which both devices' kernels run: the hidden state, then every weight, on the
    input's device. Here the tensors would meet in the CPU's kernel with the generic mixed-device error instead."""
    states = hidden if isinstance(hidden, (list, tuple)) else [hidden]
    for name, tensors in (("hidden", states), ("parameter", params)):
        for tensor in tensors:
            if tensor is not None and tensor.device != input.device:
                raise RuntimeError(f"Input and {name} tensors are not at the same device, found input tensor at "
                                   f"{input.device} and {name} tensor at {tensor.device}")


def _checked(vf_op):
    def run(*args, **kwargs):
        """`torch._VF.<rnn>(input, hx, ..., train, bidirectional, batch_first)` or, packed, `(data, batch_sizes, hx,
        ..., train, bidirectional)`, positional as nn.RNN passes them."""
        if kwargs:
            with torch._C.DisableTorchFunctionSubclass():
                return vf_op(*args, **kwargs)
        packed = not isinstance(args[1], (list, tuple)) and args[1].dim() == 1 and not args[1].is_floating_point()
        hidden, params, train = (args[2], args[3], args[-2]) if packed else (args[1], args[2], args[-3])
        _check_attributes(args[0], hidden, params)
        if _on_cudnn(args[0]):
            states = hidden if isinstance(hidden, (list, tuple)) else [hidden]
            for name, state in zip(("hx", "cx"), states):
                if not state.is_contiguous():
                    raise RuntimeError(f"rnn: {name} is not contiguous")
        with torch._C.DisableTorchFunctionSubclass():
            outputs = vf_op(*args)
        if _on_cudnn(args[0]) and not train:
            for output in outputs:
                if output.requires_grad:
                    output.register_hook(_refuse_eval_mode_backward)
        return outputs
    return run


def handlers() -> dict:
    """The `torch._VF` RNN ops that nn.RNN, nn.GRU and nn.LSTM call, with cuDNN's checks in front."""
    return {op: _checked(op) for op in (torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu)}
