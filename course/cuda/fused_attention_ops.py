"""CUDA's fused attention ops called directly (`torch.ops.aten._flash_attention_forward`, `_efficient_attention_forward`,
`_scaled_dot_product_flash_attention`, `_scaled_dot_product_efficient_attention` and their backward ops).

A CPU build has no kernel for them. `F.scaled_dot_product_attention` reaches them on the emulator only under a
program's dispatch mode (course/cuda/attention.py), but tests and libraries call them by name. Here each one returns
what its CUDA kernel returns, with the shapes and dtypes of their meta functions (torch/_meta_registrations.py): the
output in the query's dtype and layout, the float32 log-sum-exp (padded to a multiple of 32 with +inf for the
memory-efficient kernel, whose kernel_forward.h writes +inf past the last query), and seed and offset tensors. The
values come from the math path in float32 (the kernels accumulate in float), or, where it takes the call, from the
CPU's fused kernel that SDPA runs on emulated GPUs, so that both routes give the same numbers. `is_causal` is
flash-attention 2's lower-right alignment (sdp_utils.cpp, check_flash_causal_non_square_seqlens); the
memory-efficient kernel's `custom_mask_type` 1 is upper-left and 2 lower-right. Rows with no key left give 0 and a
log-sum-exp of +inf, as flash's kernel writes them (the memory-efficient kernel's log-sum-exp there is not checked
against its source).

Dropout: the kernels draw their mask from Philox at the seed and offset they return, and backward draws it again
from those. Here the forward draws a seed from the emulated GPU's generator (the host's, as for every random op on
the emulator, course/cuda/rng.py), returns it as the seed with offset 0, and both passes draw the mask from a
generator seeded with it: the same mask forward and backward, values that differ from a GPU's as every draw does.
Variable-length batches for flash (`cum_seq_*`: sequences packed along the first dimension, as
`torch.nn.attention.varlen.varlen_attn` passes them) attend sequence by sequence. Not modelled, and refused by name:
variable-length batches for the memory-efficient kernel (`cu_seqlens_*`) or with dropout, sliding windows, ALiBi,
paged KV (`block_table`, `seqused_k`) and the debug mask.
Differences from a GPU box: the memory-efficient kernel's seed and offset are CPU tensors there, GPU ones here.
"""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import current_emulator

aten = torch.ops.aten
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _refuse(name: str, **unsupported) -> None:
    for what, value in unsupported.items():
        if value not in (None, False, 0, 0.0):
            raise not_modelled(f"{name} with {what}", "call F.scaled_dot_product_attention instead, or run this "
                               "part on a real GPU")


def _check_flash(q, k, v) -> None:
    """flash_api.cpp's mha_fwd checks (the dtypes and Ampere or newer)."""
    major, _ = current_emulator("flash attention").gpu.compute_capability
    if major < 8:
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    if q.dtype not in _FLASH_DTYPES:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")


def _mask(m: int, n: int, causal: str | None, device) -> torch.Tensor | None:
    """Which keys each query may see: None for all; upper-left (j <= i) or lower-right (j <= i + n - m)."""
    if causal is None:
        return None
    shift = 0 if causal == "upper_left" else n - m
    return torch.arange(n, device=device) <= torch.arange(m, device=device).unsqueeze(-1) + shift


def _draw_seed(dropout_p: float) -> int:
    """The seed a dropout mask is drawn from, taken from the emulated GPU's generator (0 without dropout)."""
    return int(torch.randint(0, 2**62, ())) if dropout_p > 0 else 0


def _keep(shape, dropout_p: float, seed: int, device) -> torch.Tensor | None:
    """Which attention weights dropout keeps, drawn the same way in forward and backward from the seed."""
    if dropout_p == 0:
        return None
    if device.type == "meta":
        return torch.ones(shape, dtype=torch.bool, device=device)
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) >= dropout_p


def _scores(q, k, scale, causal, bias):
    """The (B, H, M, N) float32 scores, masked keys at -inf, and how many query heads share a key/value head."""
    group = q.shape[1] // k.shape[1]  # grouped-query heads: each key/value head serves `group` query heads
    kf = k.float().repeat_interleave(group, dim=1)
    scores = q.float() @ kf.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias.float()
    allowed = _mask(q.shape[-2], k.shape[-2], causal, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores, group


def _probabilities(q, k, scale, causal, bias):
    """The softmax of (B, H, M, N) scores in float32, rows with no key all 0, and their log-sum-exp (+inf there)."""
    scores, group = _scores(q, k, scale, causal, bias)
    lse = scores.logsumexp(-1)
    empty = lse == float("-inf")
    probs = torch.where(empty.unsqueeze(-1), 0.0, torch.exp(scores - lse.unsqueeze(-1)))
    return probs, torch.where(empty, float("inf"), lse), group


def _dropped(probs, keep, dropout_p):
    return probs if keep is None else probs * keep / (1 - dropout_p)


def _host_kernel_takes(q, k, causal, bias, dropout_p) -> bool:
    """Whether the CPU's fused kernel computes this call: host values, one key/value head per query head, no bias or
    dropout, and a causal mask (if any) that is the same upper-left or lower-right. `F.scaled_dot_product_attention`
    on emulated GPUs runs that kernel (course/cuda/attention.py), so the op a GPU names gives the same numbers."""
    m, n = q.shape[-2], k.shape[-2]
    return (q.device.type == "cpu" and not isinstance(q, FakeTensor) and q.shape[1] == k.shape[1] and bias is None
            and dropout_p == 0 and (causal is None or m == n))


def _forward(q, k, v, scale, causal, bias=None, dropout_p=0.0, seed=0):
    """(B, H, M, D) inputs: the output in q's dtype and the float32 log-sum-exp (B, H, M) of the undropped scores."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if _host_kernel_takes(q, k, causal, bias, dropout_p):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal is not None, scale=scale)
        return out, lse.float()
    probs, lse, group = _probabilities(q, k, scale, causal, bias)
    probs = _dropped(probs, _keep(probs.shape, dropout_p, seed, q.device), dropout_p)
    return (probs @ v.float().repeat_interleave(group, dim=1)).to(q.dtype), lse


def _backward(grad, q, k, v, out, lse, scale, causal, bias=None, dropout_p=0.0, seed=0):
    """Gradients of q, k, v and the scores (the bias's). As the kernels do, the probabilities are exp(scores - lse)
    with the log-sum-exp and output passed in, not a softmax of these keys alone: ring attention (context
    parallelism) passes the ones merged over every rank's keys, and each rank's gradients are then its share."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if _host_kernel_takes(q, k, causal, bias, dropout_p):
        lse = lse[..., :q.shape[-2]].to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.to(q.dtype), q, k, v, out, lse, 0.0, causal is not None, scale=scale)
        return dq, dk, dv, None
    scores, group = _scores(q, k, scale, causal, bias)
    probs = torch.exp(scores - lse[..., :q.shape[-2]].float().unsqueeze(-1))  # +inf (a row with no key) gives 0
    keep = _keep(probs.shape, dropout_p, seed, q.device)
    g, kf, vf = grad.float(), k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    d_probs = _dropped(g @ vf.transpose(-2, -1), keep, dropout_p)
    d_scores = probs * (d_probs - (g * out.float()).sum(-1, keepdim=True))
    dq = d_scores @ kf * scale
    dk = (d_scores.transpose(-2, -1) @ q.float() * scale).unflatten(1, (-1, group)).sum(2)
    dv = (_dropped(probs, keep, dropout_p).transpose(-2, -1) @ g).unflatten(1, (-1, group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_scores


def _seqs_first(*tensors):
    """(B, S, H, D), the kernels' layout, to (B, H, S, D) and back."""
    return [t.transpose(1, 2) for t in tensors]


def _flash_rng_state(seed: int, device):
    """flash's (seed, offset) pair and the unused 0-dim tensor (uint64, as its meta function makes them)."""
    return (torch.tensor([seed, 0], dtype=torch.uint64, device=device),
            torch.zeros((), dtype=torch.uint64, device=device))


def _seed_of(tensor) -> int:
    """The seed a forward returned; 0 where there is no value to read (DTensor's sharding propagation runs the
    backward on fake tensors to learn its output's shapes)."""
    if tensor is None or tensor.is_meta or tensor.numel() == 0 or isinstance(tensor, FakeTensor):
        return 0
    return int(tensor.reshape(-1)[0])


def _flash_causal(is_causal, window_size_left, window_size_right) -> str | None:
    """flash's mask: lower-right causal (`is_causal`, or the window (-1, 0) that torch.nn.attention.varlen passes for
    it), or none (no window, or (-1, -1)); a sliding window is refused by name."""
    window = (-1 if window_size_left is None else window_size_left, -1 if window_size_right is None else
              window_size_right)
    _refuse("flash attention", sliding_window=window not in ((-1, -1), (-1, 0)))
    return "lower_right" if is_causal or window == (-1, 0) else None


def _sequences(cum_seq_q, cum_seq_k):
    """The (start, end) rows of each packed sequence's queries and keys, read on the host as the kernel's grid is."""
    q_bounds, k_bounds = cum_seq_q.tolist(), cum_seq_k.tolist()
    return list(zip(zip(q_bounds, q_bounds[1:]), zip(k_bounds, k_bounds[1:])))


def _one(packed, bounds):
    """One sequence's rows of a packed (total, H, D) tensor as (1, H, L, D)."""
    return packed[bounds[0]:bounds[1]].transpose(0, 1).unsqueeze(0)


def _varlen_forward(query, key, value, cum_seq_q, cum_seq_k, scale, causal):
    """Packed sequences (total, H, D) with their offsets, as `mha_varlen_fwd` takes them: each attends to its own keys;
    the output is packed as the queries, the log-sum-exp is (H, total_q)."""
    outs, lses = [], []
    for rows_q, rows_k in _sequences(cum_seq_q, cum_seq_k):
        out, lse = _forward(_one(query, rows_q), _one(key, rows_k), _one(value, rows_k), scale, causal)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def _varlen_backward(grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, scale, causal):
    grads = [[], [], []]
    for rows_q, rows_k in _sequences(cum_seq_q, cum_seq_k):
        pieces = _backward(_one(grad_out, rows_q), _one(query, rows_q), _one(key, rows_k), _one(value, rows_k),
                           _one(out, rows_q), lse[:, rows_q[0]:rows_q[1]].unsqueeze(0), scale, causal)
        for grad, piece in zip(grads, pieces):
            grad.append(piece[0].transpose(0, 1))
    return tuple(torch.cat(grad) for grad in grads)


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    _refuse("_flash_attention_forward", debug_mask=return_debug_mask, seqused_k=seqused_k is not None,
            alibi=alibi_slopes is not None, paged_kv=block_table is not None,
            variable_lengths_with_dropout=cum_seq_q is not None and dropout_p > 0)
    _check_flash(query, key, value)
    causal = _flash_causal(is_causal, window_size_left, window_size_right)
    if cum_seq_q is not None:
        out, lse = _varlen_forward(query, key, value, cum_seq_q, cum_seq_k, scale, causal)
        rng_state, unused = _flash_rng_state(0, query.device)
        return out, lse, rng_state, unused, query.new_empty(0)
    q, k, v = _seqs_first(query, key, value)
    seed = _draw_seed(dropout_p)
    out, lse = _forward(q, k, v, scale, causal, None, dropout_p, seed)
    rng_state, unused = _flash_rng_state(seed, query.device)
    return out.transpose(1, 2), lse, rng_state, unused, query.new_empty(0)


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None):
    causal = _flash_causal(is_causal, window_size_left, window_size_right)
    if cum_seq_q is not None:
        return _varlen_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, scale, causal)
    g, q, k, v, o = _seqs_first(grad_out, query, key, value, out)
    dq, dk, dv, _ = _backward(g, q, k, v, o, logsumexp, scale, causal, None, dropout_p, _seed_of(rng_state))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _custom_mask(custom_mask_type: int) -> str | None:
    return {0: None, 1: "upper_left", 2: "lower_right"}[custom_mask_type]


def _padded_lse(lse, compute_log_sumexp):
    """The memory-efficient kernel's log-sum-exp: (B, H, ceil(M / 32) * 32), +inf past the queries; (B, H, 0) when
    not asked for."""
    m = lse.shape[-1]
    width = math.ceil(m / 32) * 32 if compute_log_sumexp else 0
    padded = torch.full(lse.shape[:-1] + (width,), float("inf"), device=lse.device)
    padded[..., :min(m, width)] = lse[..., :width]
    return padded


def efficient_attention_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                dropout_p, custom_mask_type, compute_log_sumexp=False, *, scale=None, seqlen_k=None,
                                window_size=None):
    _refuse("_efficient_attention_forward", variable_lengths=cu_seqlens_q is not None,
            seqlen_k=seqlen_k is not None, window=window_size is not None)
    if query.dtype not in _EFFICIENT_DTYPES:
        raise NotImplementedError(f"_efficient_attention_forward: no kernel for {query.dtype}")
    q, k, v = _seqs_first(query, key, value)
    seed = _draw_seed(dropout_p)
    out, lse = _forward(q, k, v, scale, _custom_mask(custom_mask_type), bias, dropout_p, seed)
    seed_t = torch.tensor(seed, dtype=torch.int64, device=query.device)
    return (out.transpose(1, 2), _padded_lse(lse, compute_log_sumexp), seed_t, torch.zeros_like(seed_t),
            query.shape[1], key.shape[1])


def efficient_attention_backward(grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type,
                                 bias_requires_grad, *, scale=None, num_splits_key=None, window_size=None,
                                 shared_storage_dqdkdv=False):
    _refuse("_efficient_attention_backward", variable_lengths=cu_seqlens_q is not None, window=window_size is not None)
    g, q, k, v, o = _seqs_first(grad_out_, query, key, value, out)
    dq, dk, dv, d_scores = _backward(g, q, k, v, o, logsumexp, scale, _custom_mask(custom_mask_type), bias,
                                     dropout_p, _seed_of(philox_seed))
    d_bias = d_scores.to(bias.dtype) if bias is not None and bias_requires_grad else query.new_empty(0)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), d_bias


def sdpa_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """`_scaled_dot_product_flash_attention`: (B, H, S, D) in and out, around `_flash_attention_forward` as
    attention.cu's `_scaled_dot_product_flash_attention_cuda` calls it."""
    out, lse, seed, offset, debug = flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, query.shape[2], key.shape[2],
        dropout_p, is_causal, return_debug_mask, scale=scale)
    return out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], seed, offset, debug


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    dq, dk, dv, _ = _backward(grad_out, query, key, value, out, logsumexp, scale,
                              "lower_right" if is_causal else None, None, dropout_p, _seed_of(philox_seed))
    return dq, dk, dv


def sdpa_efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """`_scaled_dot_product_efficient_attention`: (B, H, S, D) in and out; `is_causal` is upper-left here, as
    attention.cu passes custom mask type 1 (CausalFromTopLeft)."""
    out, lse, seed, offset, _, _ = efficient_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_bias, None, None, None, None,
        dropout_p, 1 if is_causal else 0, compute_log_sumexp, scale=scale)
    return out.transpose(1, 2), lse, seed, offset


def sdpa_efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                            dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    dq, dk, dv, d_scores = _backward(grad_out_, query, key, value, out, logsumexp, scale,
                                     "upper_left" if is_causal else None, attn_bias, dropout_p, _seed_of(philox_seed))
    wants_bias = attn_bias is not None and len(grad_input_mask) > 3 and grad_input_mask[3]
    return dq, dk, dv, d_scores.to(attn_bias.dtype) if wants_bias else None


KERNELS = {
    aten._flash_attention_forward.default: flash_attention_forward,
    aten._flash_attention_backward.default: flash_attention_backward,
    aten._efficient_attention_forward.default: efficient_attention_forward,
    aten._efficient_attention_backward.default: efficient_attention_backward,
    aten._scaled_dot_product_flash_attention.default: sdpa_flash,
    aten._scaled_dot_product_flash_attention_backward.default: sdpa_flash_backward,
    aten._scaled_dot_product_efficient_attention.default: sdpa_efficient,
    aten._scaled_dot_product_efficient_attention_backward.default: sdpa_efficient_backward,
}
