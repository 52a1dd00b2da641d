"""Which of CUDA's SDPA kernels would take a call, when a program turns the math fallback off.

With `torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)` (or `torch.backends.cuda.enable_math_sdp(False)`),
a GPU runs `F.scaled_dot_product_attention` only if an enabled fused kernel accepts its inputs; otherwise it warns
why each one refused and stops with "No available kernel. Aborting execution." The emulator computes attention with
CPU kernels that take anything, so without this a program that stops on a GPU (float32 into flash attention, a mask
into flash attention) ran here. The checks are those of `select_sdp_backend` in
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp for dense 4-D inputs, with its warnings' words; cuDNN's layout
and stride checks are left out, so cuDNN attention is taken a little more often than on a GPU, never less. Unequal
head counts are grouped-query attention only with `enable_gqa=True`, which torch 2.13's flash and cuDNN kernels take
and its memory-efficient kernel refuses (`check_batch_size_and_num_heads_dense` in sdp_utils_cpp.h).
"""
from __future__ import annotations

import warnings

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _in_range(cc, low, high) -> bool:
    return low <= cc <= high


def _head_dims(query, key, value):
    return query.shape[-1], key.shape[-1], value.shape[-1]


def _shape_refusal(query, key, value) -> str | None:
    """`check_tensor_shapes`, every fused kernel's first look at its inputs (sdp_utils_cpp.h)."""
    if not query.dim() == key.dim() == value.dim() == 4:
        return ("All fused kernels requires query, key and value to be 4 dimensional, but got Query dim: "
                f"{query.dim()}, Key dim: {key.dim()}, Value dim: {value.dim()} instead.")
    return None


def _heads_refusal(query, key, value, gqa) -> str | None:
    """`check_batch_size_and_num_heads_dense` (sdp_utils_cpp.h): one batch size, and one number of heads unless the
    kernel takes grouped-query attention (flash and cuDNN do with `enable_gqa`, the memory-efficient kernel never)."""
    q, k, v = (list(t.shape) for t in (query, key, value))
    broadcast = (" instead. To broadcast dense inputs, try using unsqueeze and expand_to before passing them into the "
                 "kernel.")
    if not q[0] == k[0] == v[0]:
        return ("For dense inputs, both fused kernels require query, key and value to have the same batch_size. "
                f"Query.sizes(): {q}, Key.sizes(): {k}, Value.sizes(): {v}" + broadcast)
    if gqa and k[-3] != v[-3]:
        return ("Both fused kernels require key and value to have the same num_heads and batch_size but got: Key "
                f"sizes: {k}, Value sizes: {v}, Query sizes: {q} instead.")
    if gqa and q[-3] % k[-3]:
        return ("The number of heads in key/value must divide number of heads in query.Got input Key sizes(): "
                f"{k[-3]}, Value sizes(): {v[-3]}, Query sizes(): {q[-3]} instead.")
    if not gqa and not q[-3] == k[-3] == v[-3]:
        return ("For dense input, both fused kernels require query, key and value to have the same num_heads. "
                f"Query.sizes(): {q}, Key sizes(): {k}, Value sizes(): {v}" + broadcast)
    return None


def _dense_refusal(query, key, value, attn_mask, ignore_singleton_dim, gqa=False) -> str | None:
    """The fused kernels' checks of dense inputs (sdp_utils_cpp.h): batch size and heads (above),
    `check_nonzero_sequence_lengths_dense` (the CPU's flash kernel divides by a zero length and kills the process
    with SIGFPE, where a GPU falls back to math) and `check_last_dim_stride_equals_1_dense`."""
    heads = _heads_refusal(query, key, value, gqa)
    if heads:
        return heads
    if query.size(-2) == 0 or key.size(-2) == 0:
        return "All fused kernels do not support zero seq_len_q or seq_len_kv."
    strides_one = all(t.stride(-1) == 1 for t in (query, key, value)) or (ignore_singleton_dim and query.size(-1) == 1)
    if not strides_one or (attn_mask is not None and attn_mask.stride(-1) != 1):
        message = (f"All fused kernels require the last dimension of the input to have stride 1. Got Query.stride(-1): "
                   f"{query.stride(-1)}, Key.stride(-1): {key.stride(-1)}, Value.stride(-1): {value.stride(-1)}")
        if attn_mask is not None:
            message += (f", Attn_mask.stride(-1): {attn_mask.stride(-1)} (GPU backends require attn_mask's last "
                        "dimension to have stride 1 while the CPU does not).")
        return message
    return None


def sizes_fit_fused(query, key, value, enable_gqa) -> bool:
    """Whether dense 4-D inputs pass the fused kernels' size checks (grouped-query heads aside); a GPU runs any others,
    broadcast batches or heads and empty sequences, with math attention."""
    heads = enable_gqa or query.size(-3) == key.size(-3) == value.size(-3)
    return heads and query.size(0) == key.size(0) == value.size(0) and query.size(-2) > 0 and key.size(-2) > 0


def _flash_refusal(cc, dtypes, query, key, value, attn_mask, dropout_p, is_causal, gqa=False) -> str | None:
    shape = _shape_refusal(query, key, value)
    if shape:
        return shape
    dq, dk, dv = _head_dims(query, key, value)
    if attn_mask is not None:
        return "Flash Attention does not support non-null attn_mask."
    if not (dq == dk == dv and dq <= 256):
        return ("Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256. "
                f"Got Query.size(-1): {dq}, Key.size(-1): {dk}, Value.size(-1): {dv} instead.")
    if not _in_range(cc, (8, 0), (12, 1)):
        return ("Flash attention only supports gpu architectures in the range [sm80, sm121]. Attempting to run on a "
                f"sm {cc[0]}.{cc[1]} gpu.")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if grad and (_in_range(cc, (8, 6), (8, 9)) or _in_range(cc, (12, 0), (12, 1))) and not (
            dq <= 192 or (dropout_p == 0 and dq > 224)):
        return ("Flash attention currently doesn't support training with head_dim ∈ (192, 224] or (head_dim ∈ (224, "
                "256] and dropout > 0.0) on gpu architectures in the range[sm86, sm89].")
    if is_causal and query.shape[-2] != key.shape[-2]:
        return (f"Flash attention does not support the is_causal flag when seqlen_q != seqlen_k. Got seqlen_q: "
                f"{query.shape[-2]} seqlen_k: {key.shape[-2]}.")
    allowed = LOW_PRECISION if cc >= (8, 0) else (torch.float16,)
    return _dtype_refusal(dtypes, allowed) or _dense_refusal(query, key, value, attn_mask, True, gqa)


def _mem_efficient_refusal(cc, dtypes, query, key, value, attn_mask) -> str | None:
    if not _in_range(cc, (5, 0), (12, 1)):
        return ("Mem Efficient Attention only supports gpu architectures in the range [sm50, sm121]. Attempting to "
                f"run on a sm {cc[0]}.{cc[1]} gpu.")
    shape = _shape_refusal(query, key, value)
    if shape:
        return shape
    dq, dk, dv = _head_dims(query, key, value)
    half = dtypes[0] in LOW_PRECISION
    tensor_cores = cc >= (8, 0) or (cc >= (7, 0) and half)
    alignment = max(4 if cc >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)  # minimum_gemm_alignment
    if not (dq == dk and dq % alignment == 0 and dq > 0 and dv % alignment == 0 and dv > 0):
        return (f"Mem efficient attention requires last dimension of inputs to be divisible by {alignment}. Got "
                f"Query.size(-1): {dq}, Key.size(-1): {dk}, Value.size(-1): {dv} instead.")
    if cc >= (8, 0) and any(t.storage_offset() % alignment for t in (query, key, value) if t.numel()):
        return ("Mem efficient attention on sm80 or newer requires q, k, and v storage offsets * element_size to be "
                f"aligned to {alignment * torch.finfo(dtypes[0]).bits // 8} bytes.")
    allowed = (torch.float16, torch.float32, torch.bfloat16) if cc >= (8, 0) else (torch.float16, torch.float32)
    return _dense_refusal(query, key, value, attn_mask, False) or _dtype_refusal(dtypes, allowed)


def _cudnn_refusal(cc, dtypes, query, key, value, attn_mask, dropout_p, gqa=False) -> str | None:
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return "cuDNN SDPA is not deterministic."
    refused = _shape_refusal(query, key, value) or _dense_refusal(query, key, value, attn_mask, False, gqa)
    if refused:
        return refused
    refused = _dtype_refusal(dtypes, LOW_PRECISION)
    if refused:
        return refused
    if not _in_range(cc, (8, 0), (12, 1)):
        return (f"cuDNN MHA only supports gpu architectures in the range [sm80, sm121]. Attempting to run on a sm "
                f"{cc[0]}.{cc[1]} gpu.")
    if dropout_p * 16.0 != int(dropout_p * 16.0):
        return "cuDNN dropout probability resolution is limited to 1/16."
    dq, _, dv = _head_dims(query, key, value)
    limit = 192 if cc == (9, 0) and (dq, dv) == (192, 128) else 128  # cuDNN 9.10 (build_info.CUDNN_VERSION)
    if dq > limit or dv > limit:
        return f"head_dim should be no more than {limit}"
    if dq % 8 or dv % 8:
        return "head_dim should be a multiple of 8"
    if key.shape[-2] == 1:
        return "cudnn SDPA does not support key/value sequence length 1."
    return None


def _dtype_refusal(dtypes, allowed) -> str | None:
    if dtypes[0] in allowed and dtypes[1] == dtypes[2] == dtypes[0]:
        return None
    names = ", ".join({torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float"}[d] for d in allowed)
    return (f"Expected query, key and value to all be of dtype: {{{names}}}. Got Query dtype: {dtypes[0]}, Key "
            f"dtype: {dtypes[1]}, and Value dtype: {dtypes[2]} instead.")


def _dtypes_after_autocast(*tensors) -> tuple:
    """SDPA is on CUDA autocast's lower-precision list: its kernel is picked for the cast inputs."""
    if not torch.is_autocast_enabled("cuda"):
        return tuple(t.dtype for t in tensors)
    cast = torch.get_autocast_dtype("cuda")
    return tuple(cast if t.is_floating_point() and t.dtype is not torch.float64 else t.dtype for t in tensors)


def chosen(cc, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=False) -> str:
    """The kernel a GPU picks for a dense call: "flash", "mem", "math" or "cudnn", the first enabled one that takes
    it in `priority_order`'s default order (flash, memory-efficient, math, cuDNN)."""
    backends = torch.backends.cuda
    dtypes = _dtypes_after_autocast(query, key, value)
    if backends.flash_sdp_enabled() and not _flash_refusal(cc, dtypes, query, key, value, attn_mask, dropout_p,
                                                           is_causal, enable_gqa):
        return "flash"
    if backends.mem_efficient_sdp_enabled() and not _mem_efficient_refusal(cc, dtypes, query, key, value, attn_mask):
        return "mem"
    if backends.math_sdp_enabled():
        return "math"
    # stops with the GPU's words unless cuDNN takes it
    check(cc, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    return "cudnn"


def check(cc, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=False) -> None:
    """Stop as a GPU stops when math attention is off and no enabled fused kernel takes the call (nothing to do
    while the math fallback is on, PyTorch's default)."""
    backends = torch.backends.cuda
    if backends.math_sdp_enabled():
        return
    enabled = {"flash": backends.flash_sdp_enabled(), "mem": backends.mem_efficient_sdp_enabled(),
               "cudnn": backends.cudnn_sdp_enabled()}
    if not any(enabled.values()):
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found. This is likely due to "
                           "turning off both the math kernel and the fused kernels.")
    dtypes = _dtypes_after_autocast(query, key, value)
    refusals = {
        "mem": "Memory Efficient attention has been runtime disabled." if not enabled["mem"] else
        _mem_efficient_refusal(cc, dtypes, query, key, value, attn_mask),
        "flash": "Flash attention has been runtime disabled." if not enabled["flash"] else
        _flash_refusal(cc, dtypes, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa),
        "cudnn": "CuDNN attention has been runtime disabled." if not enabled["cudnn"] else
        _cudnn_refusal(cc, dtypes, query, key, value, attn_mask, dropout_p, enable_gqa),
    }
    if any(reason is None for reason in refusals.values()):
        return
    for title, key_ in (("Memory efficient kernel", "mem"), ("Flash attention kernel", "flash"),
                        ("cuDNN attention kernel", "cudnn")):
        warnings.warn(f"{title} not used because:", UserWarning, stacklevel=3)
        warnings.warn(refusals[key_], UserWarning, stacklevel=3)
    raise RuntimeError("No available kernel. Aborting execution.")
