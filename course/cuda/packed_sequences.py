"""`nn.utils.rnn.pack_padded_sequence` with its input on an emulated GPU and its lengths on the host.

CUDA PyTorch wants the lengths as a 1-D CPU int64 tensor (or a list): its packing kernel reads them on the host
and keeps the batch sizes it computes there, where the packed RNN kernels and `pad_packed_sequence` read them.
The packing itself is PyTorch's own composite kernel (slices of the input and a `cat`, all on the GPU), called
below the autograd layer so that autograd records those ops; on a CPU build the emulator's device check would
otherwise refuse the host lengths beside a GPU input. That call passes no torch function mode: one (the device
context of `set_default_tensor_type(torch.cuda.FloatTensor)`) would call the operator again, through the dispatcher.
"""
from __future__ import annotations

import torch

from course.cuda.devices import CPU, EmulatedTensor

_PACK = torch.ops.aten._pack_padded_sequence.default
_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd


def pack_padded_sequence(input, lengths, batch_first):
    """`torch._VF._pack_padded_sequence`: lengths on a GPU are refused with CUDA's message."""
    if isinstance(lengths, EmulatedTensor):
        if lengths._device_index != CPU:
            scalar = lengths._inner.type().rpartition(".")[2].removesuffix("Tensor")
            raise RuntimeError(f"'lengths' argument should be a 1D CPU int64 tensor, but got {lengths.dim()}D "
                               f"{lengths.device} {scalar} tensor")
        lengths = lengths._inner
    if not isinstance(input, EmulatedTensor) or input._device_index == CPU:
        with torch._C.DisableTorchFunctionSubclass():
            return torch._VF._pack_padded_sequence(input, lengths, batch_first)
    with torch._C.DisableTorchFunction():
        return _PACK._op_dk(_COMPOSITE, input, lengths, batch_first)


def pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length):
    """`torch._VF._pad_packed_sequence`, as PyTorch's C++ (PackedSequence.cpp) does it, with the padded output made
    on the data's GPU: the C++ makes it from `data.options()`, which on a CPU build names the host."""
    if not isinstance(data, EmulatedTensor) or data._device_index == CPU:
        with torch._C.DisableTorchFunctionSubclass():
            return torch._VF._pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length)
    sizes = batch_sizes.tolist()
    max_batch, steps = sizes[0], len(sizes)
    if total_length > 0 and total_length < steps:
        raise ValueError(f"Expected total_length to be at least the length of the longest sequence in input, but got "
                         f"total_length={total_length} and max sequence length being {steps}")
    output = data.new_full((max(steps, total_length), max_batch) + tuple(data.shape[1:]), padding_value)
    lengths = [0] * max_batch
    offset, previous_batch, previous_step = 0, max_batch, 0
    for step in range(steps + 1):
        batch = sizes[step] if step != steps else 0
        if batch != previous_batch:
            count = previous_batch * (step - previous_step)
            rows = data[offset:offset + count].view((step - previous_step, previous_batch) + tuple(data.shape[1:]))
            output[previous_step:step, :previous_batch] = rows
            offset, previous_step = offset + count, step
        for sequence in range(batch, previous_batch):
            lengths[sequence] = step
        previous_batch = batch
    return output.transpose(0, 1) if batch_first else output, torch.tensor(lengths, dtype=torch.int64, device="cpu")


def pad_sequence(sequences, batch_first=False, padding_value=0.0, padding_side="right"):
    """`nn.utils.rnn.pad_sequence` (`torch._C._nn.pad_sequence`) as PyTorch's C++ does it, with the padded tensor made
    on the sequences' GPU: the C++ makes it from `sequences[0].options()`, which on a CPU build names the host."""
    first = sequences[0] if len(sequences) else None
    if not isinstance(first, EmulatedTensor) or first._device_index == CPU:
        with torch._C.DisableTorchFunctionSubclass():
            return torch._C._nn.pad_sequence(sequences, batch_first, padding_value, padding_side)
    longest, trailing = max(s.size(0) for s in sequences), tuple(first.shape[1:])
    shape = (len(sequences), longest) if batch_first else (longest, len(sequences))
    output = first.new_full(shape + trailing, padding_value)
    for index, sequence in enumerate(sequences):
        length = sequence.size(0)
        steps = slice(0, length) if padding_side == "right" else slice(longest - length, longest)
        if batch_first:
            output[index, steps] = sequence
        else:
            output[steps, index] = sequence
    return output
