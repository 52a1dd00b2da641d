"""`F.scaled_dot_product_attention` on an emulated GPU runs as CUDA runs it: one fused kernel.

On a GPU, PyTorch sends SDPA to its flash or memory-efficient kernel, which streams keys and values through
on-chip memory and never writes the (queries x keys) attention matrix. On the CPU the emulator runs on, a
shape-only tensor takes the math path instead (matmul, softmax, matmul, with bf16 upcast to fp32), whose cost
is that of a dozen kernels and a materialised matrix. So on emulated GPUs the call goes to one fused op,
costed with FlopCounterMode's flash-attention formula and the bytes of q, k, v and the output.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch._higher_order_ops.flex_attention import flex_attention_backward as flex_attention_backward_hop
from torch._higher_order_ops.flex_attention import sdpa_dense, sdpa_dense_backward
from torch.nested._internal.nested_tensor import NestedTensor, nested_view_from_values_offsets_lengths
from torch.nn.attention import SDPBackend, sdpa_kernel

from course.cuda import autocast, sdpa_backends
from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import CPU, EmulatedTensor, current_emulator
from course.cuda.transfers import program_dispatch_mode

aten = torch.ops.aten
# PyTorch's own SDPA, kept before anything replaces the module attribute: context parallelism swaps in a wrapper
# that makes DTensors and calls this, so calling the attribute again from inside would wrap them twice
_SDPA = torch.nn.functional.scaled_dot_product_attention


def _fused_kernels_enabled() -> bool:
    """Whether PyTorch may pick a fused kernel: `torch.nn.attention.sdpa_kernel(SDPBackend.MATH)` (or the older
    `torch.backends.cuda.sdp_kernel(enable_flash=False, ...)`, as gpt-fast's decode loop uses) turns them off."""
    backends = torch.backends.cuda
    return backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled() or backends.cudnn_sdp_enabled()


def _math_on_the_host(on_gpu: bool):
    """The CPU's SDPA with math attention allowed, for GPU inputs a fused CUDA kernel has taken (sdpa_backends.check
    passed) but the CPU's kernels cannot (cuDNN's different key and value head sizes with math off)."""
    if not on_gpu or torch.backends.cuda.math_sdp_enabled():
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])


def _on_emulated_gpu(*tensors) -> bool:
    return all(isinstance(t, EmulatedTensor) and t._device_index != CPU for t in tensors)


def scaled_dot_product_attention(*args, **kwargs):
    """`F.scaled_dot_product_attention` on the emulator. Its tensor calls name no device, so they need none of the
    emulator's routing: they skip its torch-function layer (a Python call each, in every attention layer's call).
    A jagged nested query keeps it: its own torch function is its SDPA (torch/nested/_internal/sdpa.py)."""
    query = args[0] if args else kwargs.get("query")
    if isinstance(query, NestedTensor):
        return _jagged_attention(*args, **kwargs)
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # imported by DTensor programs
    if dtensor is not None and isinstance(query, dtensor) and _on_emulated_gpu(query._local_tensor):
        return _dtensor_attention(*args, **kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return _scaled_dot_product_attention(*args, **kwargs)


def _dtensor_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """SDPA on DTensors over emulated GPUs, as CUDA's flash and memory-efficient sharding rules run it with batch or
    heads sharded (torch/distributed/tensor/_ops/_matrix_ops.py): each rank attends over its own shard, with no
    communication, and the output has the query's placements. The CPU kernel the emulator runs has no such rule.
    Other layouts go to the fused op a GPU would pick, on the DTensors, so that DTensor's own rules for it run: a
    sequence sharded by context parallelism reaches its ring attention (torch/distributed/tensor/experimental/
    _context_parallel), whose local calls are the emulator's fused ops (course/cuda/fused_attention_ops.py)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements, mesh = query.placements, query.device_mesh
    local = all(isinstance(t, DTensor) and t.placements == placements and t.device_mesh == mesh
                for t in (key, value)) and all(p in (Replicate(), Shard(0), Shard(1)) for p in placements)
    if not local or attn_mask is not None or dropout_p:
        return _dtensor_fused_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    out = scaled_dot_product_attention(query.to_local(), key.to_local(), value.to_local(), is_causal=is_causal,
                                       scale=scale, enable_gqa=enable_gqa)
    shape = (*query.shape[:-1], value.shape[-1])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=stride)


def _gpu_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> str:
    """The SDPA kernel a GPU of the emulated model picks: "flash", "mem", "math" or "cudnn"."""
    cc = current_emulator("F.scaled_dot_product_attention").gpu.compute_capability
    return "math" if enable_gqa else sdpa_backends.chosen(cc, query, key, value, attn_mask, dropout_p, is_causal)


def _fused_op(kernel, query, key, value, attn_mask, dropout_p, is_causal, scale):
    """CUDA's fused SDPA op for `kernel` ("flash" or "mem"), as sdpa's CUDA dispatch calls it; its derivative is that
    op's backward (course/cuda/fused_attention_ops.py computes both on emulated GPUs)."""
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, grad, dropout_p, is_causal,
                                                        scale=scale)[0]


def _dtensor_fused_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """`F.scaled_dot_product_attention` as CUDA's dispatch runs it on DTensors: the fused op it selects (flash, then
    memory-efficient), called on the DTensors themselves."""
    kernel = _gpu_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if kernel in ("flash", "mem"):
        return _fused_op(kernel, query, key, value, attn_mask, dropout_p, is_causal, scale)
    raise not_modelled(f"F.scaled_dot_product_attention on DTensors placed {tuple(query.placements)} over emulated "
                       f"GPUs, where CUDA takes its {'cuDNN' if kernel == 'cudnn' else 'math'} kernel",
                       "use inputs flash or memory-efficient attention takes (fp16/bf16, or no grouped-query heads), "
                       "or run this part on a real GPU")


def _jagged_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    """SDPA over jagged (B, H, j, D) tensors on emulated GPUs, one sequence at a time, with each sequence's output
    packed back under the query's offsets as PyTorch's jagged SDPA returns it (torch/nested/_internal/sdpa.py).

    A GPU runs the memory-efficient kernel over the packed sequences (cumulative offsets); a CPU build takes the math
    path through strided-layout nested tensors, which are C++ tensors the emulator cannot hold. Per-sequence
    attention is that math, so the values are the same; it is timed as one fused kernel per sequence, not one in all.
    Masks, dropout, grouped-query heads and sequences with holes (`lengths`) take PyTorch's path (and its error on
    an emulated GPU)."""
    plain = _SDPA
    jagged = (query, key, value)
    if not (all(isinstance(t, NestedTensor) and t._lengths is None and t._ragged_idx == 2 for t in jagged)
            and _on_emulated_gpu(*(t._values for t in jagged)) and query.dim() == 4 and attn_mask is None
            and dropout_p == 0 and not enable_gqa):
        return plain(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    packed = [t.transpose(1, 2).values() for t in jagged]  # (total length, H, D) each
    bounds = [t.offsets().tolist() for t in jagged]  # read on the host, as the kernel's max length is
    pieces = []
    for i in range(len(bounds[0]) - 1):
        q, k, v = (p[b[i]:b[i + 1]].transpose(0, 1).unsqueeze(0) for p, b in zip(packed, bounds))
        pieces.append(plain(q, k, v, is_causal=is_causal, scale=scale)[0].transpose(0, 1))
    return nested_view_from_values_offsets_lengths(
        torch.cat(pieces), query.offsets(), None, min_seqlen=query._maybe_min_seqlen,
        max_seqlen=query._maybe_max_seqlen).transpose(1, 2)


def _fused_takes(query, key, value, enable_gqa) -> bool:
    """Whether CUDA would reach a fused kernel: `validate_sdpa_input` (sdp_utils_cpp.h) first wants one dtype (CUDA
    autocast makes it one), and the fused kernels' `check_batch_size_and_num_heads_dense` (sdp_utils.cpp) want as many
    key and value heads as query heads, or, with `enable_gqa`, a number of them dividing the query's; otherwise a GPU
    stops, or runs its math fallback."""
    heads, kv_heads = query.shape[1], key.shape[1]
    same_dtype = query.dtype == key.dtype == value.dtype or torch.is_autocast_enabled("cuda")
    grouped = enable_gqa and kv_heads == value.shape[1] and heads % kv_heads == 0
    return same_dtype and (kv_heads == value.shape[1] == heads or grouped)


def _scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                  enable_gqa=False):
    """SDPA as one fused kernel where CUDA would run one; PyTorch's own path everywhere else.

    The fused CPU op needs as many key/value heads as query heads. With grouped-query attention and no mask,
    each query row attends to all keys of its key/value head independently, so the query heads of one group
    are folded into its sequence (what CUDA's flash kernel does by indexing, without copying keys or values).
    Dropout (the CPU fused op has none), nested tensors, a math-only backend and unequal head counts without
    `enable_gqa` (no fused CUDA kernel takes them, and math broadcasts a single key/value head or stops, where the
    CPU's fused op would quietly group the heads) take PyTorch's path.
    """
    on_gpu = _on_emulated_gpu(query, key, value)
    if on_gpu and not query.is_nested:  # stops where a GPU finds no kernel (math turned off)
        sdpa_backends.check(current_emulator("F.scaled_dot_product_attention").gpu.compute_capability, query, key,
                            value, attn_mask, dropout_p, is_causal, enable_gqa)
    if on_gpu and attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA does first, on every backend
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(),
                                                                                -float("inf"))
    # a GPU takes broadcast batches and empty sequences to math attention (the CPU's fused kernel would refuse the
    # first and die of SIGFPE on the second); PyTorch's path raises what a GPU raises for mixed dtypes or heads
    fused = _fused_kernels_enabled() and dropout_p == 0 and not query.is_nested and query.dim() == 4 \
        and sdpa_backends.sizes_fit_fused(query, key, value, enable_gqa) and _fused_takes(query, key, value, enable_gqa)
    if not (on_gpu and fused and query.shape[-1] == value.shape[-1]):
        with _math_on_the_host(on_gpu):
            return _SDPA(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)
    # SDPA is on CUDA autocast's lower-precision list; the fused op run in its place is on none
    query, key, value, attn_mask = autocast.to_lower_precision(query, key, value, attn_mask)
    if attn_mask is None and not enable_gqa and program_dispatch_mode():
        # a program's dispatch mode (selective checkpointing's policy, an op logger) sees the op a GPU box runs
        kernel = _gpu_kernel(query, key, value, None, 0.0, is_causal, False)
        if kernel in ("flash", "mem"):
            return _fused_op(kernel, query, key, value, None, 0.0, is_causal, scale)
    if attn_mask is not None and attn_mask.dim() not in (2, 4):  # SDPA broadcasts any mask; the fused op wants 4-D
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if scale is None:
        scale = query.shape[-1] ** -0.5  # the default, fixed before any folding changes the shapes
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if enable_gqa and kv_heads != heads:
        if attn_mask is not None or (is_causal and length > 1):
            group = heads // kv_heads
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        else:
            folded = query.reshape(batch, kv_heads, heads // kv_heads * length, dim)
            out = aten._scaled_dot_product_flash_attention_for_cpu(folded, key, value, 0.0, False, scale=scale)[0]
            return out.reshape(batch, heads, length, value.shape[-1])
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, attn_mask=attn_mask,
                                                            scale=scale)[0]


def flex_attention(*args, **kwargs):
    """The FlexAttention higher-order op called with emulated GPU tensors that need gradients: refused by name. Its
    autograd rule traces score_mod on fake tensors of the inputs' device, and a fake CUDA tensor makes a CPU build's
    autograd abort the whole process ("PyTorch is not linked with support for cuda devices")."""
    if torch.is_grad_enabled() and any(isinstance(t, EmulatedTensor) and t.requires_grad for t in args[:3]):
        raise not_modelled("FlexAttention's backward on emulated GPUs", "run flex_attention under torch.no_grad() "
                           "(inference), or use F.scaled_dot_product_attention with a mask for training")
    with torch._C.DisableTorchFunctionSubclass():
        return flex_attention_hop(*args, **kwargs)


def register_eager_flex_attention(mode_type) -> None:
    """FlexAttention on emulated GPUs, run as a GPU runs it without torch.compile: PyTorch's dense implementation,
    each of its ops a kernel on the emulated GPU. A higher-order op finds no rule for a tensor subclass unless one
    is registered, and it reaches the rule from inside the emulator's own mode, so the mode (`mode_type`) is put
    back on for the body (its `torch.arange(device=...)` calls)."""
    for hop, dense in ((flex_attention_hop, sdpa_dense), (flex_attention_backward_hop, sdpa_dense_backward)):
        def run(*args, _dense=dense, **kwargs):
            with mode_type():
                return _dense(*args, **kwargs)

        hop.py_impl(EmulatedTensor)(run)
