"""`nn.TransformerEncoder`'s inference fast path, whose padded positions a GPU gives back as zeros.

In eval mode without gradients, given a `src_key_padding_mask`, PyTorch packs the batch into a nested tensor, runs
the layers on the real tokens only and pads the result with 0.0 (torch/nn/modules/transformer.py). It skips that
path for any tensor subclass ("some Tensor argument has_torch_function"), so on emulated GPUs the padded positions
would silently hold computed values. This forward takes the same decision as on a GPU and, where a GPU would nest,
runs the layers with the padding mask and writes the zeros a GPU writes.
"""
from __future__ import annotations

import torch
import torch.nn.modules.transformer as transformer

from course.cuda.devices import CPU, EmulatedTensor

_REAL_FORWARD = transformer.TransformerEncoder.forward


def _nests_on_gpu(encoder, src, mask, padding) -> bool:
    """TransformerEncoder.forward's conditions for the nested path, short of has_torch_function (the layers' own
    conditions are folded into `use_nested_tensor` when the encoder is built)."""
    if not (isinstance(src, EmulatedTensor) and src._device_index != CPU):
        return False
    layer = encoder.layers[0]
    if not (torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor", False)
            and not layer.training and src.dim() == 3 and padding is not None and mask is None
            and not torch.is_autocast_enabled()):
        return False
    attn = layer.self_attn
    weights = (attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias, layer.norm1.weight,
               layer.norm1.bias, layer.norm2.weight, layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
               layer.linear2.weight, layer.linear2.bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (src,) + weights):
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
    """`TransformerEncoder.forward`, with the GPU's nested fast path where a GPU would take it."""
    padding = src_key_padding_mask
    if padding is not None and padding.dtype != torch.bool:
        padding = padding != 0  # a float mask pads where it is not 0.0 (-inf)
    if not _nests_on_gpu(self, src, mask, padding):
        return _REAL_FORWARD(self, src, mask, src_key_padding_mask, is_causal)
    is_causal = transformer._detect_is_causal_mask(None, is_causal, src.shape[1])  # batch first, as use_nested_tensor
    output = src
    for layer in self.layers:
        output = layer(output, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
    output = output.masked_fill(padding.unsqueeze(-1), 0.0)
    return output if self.norm is None else self.norm(output)
