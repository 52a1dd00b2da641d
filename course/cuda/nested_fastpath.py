"""`nn.TransformerEncoder`'s inference fast path, whose padded positions come back as zeros.

In eval mode without gradients, given a `src_key_padding_mask`, PyTorch packs the batch into a nested tensor, runs
the layers on the real tokens only and pads the result with 0.0 (torch/nn/modules/transformer.py). It skips that
path for tensor subclasses and under a torch-function mode ("some Tensor argument has_torch_function"), so under
the emulator the padded positions, of GPU and CPU tensors alike, would silently hold computed values. This forward
takes the decision PyTorch takes without the emulator and, where it would nest, runs the layers with the padding
mask and writes the zeros the nested path writes.
"""
from __future__ import annotations

import torch
import torch.nn.modules.transformer as transformer

from course.cuda.devices import EmulatedTensor

_REAL_FORWARD = transformer.TransformerEncoder.forward


def _without_the_emulator_no_torch_function(tensor) -> bool:
    """Whether `has_torch_function` would be false for this tensor if the emulator were not running: a plain
    tensor or parameter (the emulator's mode aside), or an emulated GPU tensor (a plain CUDA tensor on a GPU)."""
    return (tensor is None or isinstance(tensor, EmulatedTensor) or type(tensor) is torch.Tensor
            or type(tensor).__torch_function__ is torch._C._disabled_torch_function_impl)


def _nests(encoder, src, mask, padding) -> bool:
    """TransformerEncoder.forward's conditions for the nested path, as they would be without the emulator (the
    layers' own conditions are folded into `use_nested_tensor` when the encoder is built)."""
    layer = encoder.layers[0]
    if not (torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor", False)
            and not layer.training and src.dim() == 3 and padding is not None and mask is None
            and not torch.is_autocast_enabled()):
        return False
    attn = layer.self_attn
    weights = (attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias, layer.norm1.weight,
               layer.norm1.bias, layer.norm2.weight, layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
               layer.linear2.weight, layer.linear2.bias)
    if not all(_without_the_emulator_no_torch_function(t) for t in (src,) + weights):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (src,) + weights):
        return False
    left_aligned = torch._nested_tensor_from_mask_left_aligned(src, padding.logical_not())
    if getattr(encoder, "mask_check", True):
        return left_aligned
    if not left_aligned:
        raise NotImplementedError(
            "The GPU emulator does not model TransformerEncoder(mask_check=False) with a src_key_padding_mask that "
            "is not left-aligned (the nested fast path then keeps the first tokens of each row, whatever the "
            "mask says); use a left-aligned mask or run this part on a real GPU.")
    return True


def encoder_forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
    """`TransformerEncoder.forward`, with the nested fast path's zeros where PyTorch would take that path."""
    padding = src_key_padding_mask
    if padding is not None and padding.dtype != torch.bool:
        padding = padding != 0  # a float mask pads where it is not 0.0 (-inf)
    if not _nests(self, src, mask, padding):
        return _REAL_FORWARD(self, src, mask, src_key_padding_mask, is_causal)
    is_causal = transformer._detect_is_causal_mask(None, is_causal, src.shape[1])  # batch first, as use_nested_tensor
    output = src
    for layer in self.layers:
        output = layer(output, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
    output = output.masked_fill(padding.unsqueeze(-1), 0.0)
    return output if self.norm is None else self.norm(output)
