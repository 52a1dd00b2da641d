"""`torch.autocast("cuda")` on emulated GPUs: CUDA's op lists applied to tensors on fake `cuda:i` devices.

CUDA's autocast kernels sit at the AutocastCUDA dispatch key and cast only tensors whose C++ device is
cuda. An EmulatedTensor's C++ device is the CPU, so without this module a cuda autocast region would
silently run (and be timed) in fp32, while CPU autocast would cast GPU tensors a real box leaves alone.
While an emulator runs, Python kernels replace both keys' kernels: at AutocastCUDA (put in each thread's
include set, so every tensor reaches it while cuda autocast is on) they apply CUDA's policy to tensors on
emulated GPUs, and at AutocastCPU they apply CPU's policy to CPU tensors only, as on a GPU box.
The lists are PyTorch's (aten/src/ATen/autocast_mode.h and .cpp); only overloads this torch registers
at the key are taken over, so the ops covered are exactly the ones torch itself autocasts.
"""
from __future__ import annotations

import threading
import warnings
import weakref

import torch
import torch.amp.autocast_mode

from course.cuda.devices import CPU, EmulatedTensor

aten = torch.ops.aten

# CUDA's lists (autocast_mode.h AT_FORALL_*, 2.13), as "op" or "op.overload".
CUDA_LOWER_PRECISION = """
_convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
conv_transpose3d.input convolution cudnn_convolution cudnn_convolution_transpose prelu addmm addmv addr matmul
einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
scaled_dot_product_attention
""".split()
CUDA_FP32 = """
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar pow.Tensor_Tensor
pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim nuclear_norm
nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
upsample_bicubic2d _upsample_bicubic2d_aa
""".split()
CUDA_FP32_SET_OPT_DTYPE = """
prod prod.dim_int prod.dim_Dimname softmax.int softmax.Dimname log_softmax.int log_softmax.Dimname cumprod
cumprod.dimname cumsum cumsum.dimname linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum
sum.dim_IntList sum.dim_DimnameList
""".split()
# fp32_append_dtype: the overload without a dtype is redirected to the one with it.
CUDA_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
                          "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"}
CUDA_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()
CUDA_BANNED = ["binary_cross_entropy"]
# A CUDA build autocasts cuDNN's RNN (`_cudnn_rnn`, aten/src/ATen/cudnn/AutocastRNN.cpp): input, hidden state and
# weights go in as float16 whatever the region's dtype, so LSTM, GRU and RNN outputs are float16. A CPU build has no
# `_cudnn_rnn`, so the RNN ops that reach it are taken over one level up. With cuDNN switched off a GPU runs its own
# cells, which are on the lower-precision list: the region's dtype.
CUDA_CUDNN_RNN = "lstm.input lstm.data gru.input gru.data rnn_tanh.input rnn_tanh.data rnn_relu.input rnn_relu.data"

# CPU's lists (autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)); every other op torch registers at
# AutocastCPU is in its fp32 list (checked by tests/test_autocast.py against that list).
CPU_LOWER_PRECISION = """
conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot baddbmm addmm
_addmm_activation addbmm linear mkldnn_reorder_linear_weight _convolution.deprecated matmul conv_tbc
mkldnn_rnn_layer conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention
_native_multi_head_attention
""".split()
CPU_PROMOTE = "stack cat index_copy index_copy.dimname".split()

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)

_KEY = {"cuda": torch._C.DispatchKey.AutocastCUDA, "cpu": torch._C.DispatchKey.AutocastCPU}
_OWN_KEY = {device: torch._C.DispatchKeySet(key) for device, key in _KEY.items()}
# C++ excludes every device's autocast key (AutocastFunctionality) before running the op; the two seen here.
_ALL_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU).add(torch._C.DispatchKey.AutocastCUDA)


def _on_gpu(tensor) -> bool:
    return isinstance(tensor, EmulatedTensor) and tensor._device_index != CPU


_ON_DEVICE = {"cuda": _on_gpu, "cpu": lambda tensor: (tensor.is_cpu or tensor.is_mkldnn) and not _on_gpu(tensor)}


def _eligible(value, device: str) -> bool:
    """C++'s is_eligible: a floating tensor of the region's device type, not float64."""
    return (isinstance(value, torch.Tensor) and _ON_DEVICE[device](value) and value.is_floating_point()
            and value.dtype is not torch.float64)


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif type(value) in (list, tuple):
            yield from (v for v in value if isinstance(v, torch.Tensor))


# Casts of fp32 leaf weights are cached inside a region, as C++'s cached_cast does (one cast per weight per
# forward, however often it is used). Keyed by id, holding a weakref so a recycled id cannot hit. As in PyTorch
# since pytorch/pytorch#165068, the cached cast is made with grad mode on, so one first made under no_grad (an
# eval pass, a custom autograd.Function's forward) still carries the weight's gradient to later uses, and nothing
# is cached under inference_mode. Nor are tensors registered with `torch._C._add_cached_tensor` (CUDA graph trees'
# static inputs), as C++ checks `at::caching::is_cached_tensor`.
_cache = threading.local()


def _cast_cache() -> dict:
    if not hasattr(_cache, "casts"):
        _cache.casts = {}
    return _cache.casts


def clear_cache() -> None:
    _cast_cache().clear()


def _cast(value, dtype: torch.dtype, device: str):
    if type(value) in (list, tuple):
        return type(value)(_cast(v, dtype, device) for v in value)
    if not _eligible(value, device) or value.dtype is dtype:
        return value
    cacheable = (dtype is torch.get_autocast_dtype(device) and value.dtype is torch.float32 and value.requires_grad
                 and value.is_leaf and not value._is_view() and torch.is_autocast_cache_enabled()
                 and not torch.is_inference_mode_enabled() and not torch._C._is_cached_tensor(value))
    if not cacheable:
        return value.to(dtype)
    casts = _cast_cache()
    hit = casts.get(id(value))
    if hit is not None and hit[0]() is value:
        return hit[1]
    with torch.enable_grad():
        casted = value.to(dtype)
    casts[id(value)] = (weakref.ref(value), casted)
    return casted


def to_lower_precision(*tensors, device: str = "cuda"):
    """What autocast does to the arguments of an op on its lower-precision list, for emulator code that runs such an
    op as another one (SDPA as a fused kernel, course/cuda/attention.py): cast to the autocast dtype when it is on."""
    if not torch.is_autocast_enabled(device):
        return tensors
    return tuple(_cast(t, torch.get_autocast_dtype(device), device) for t in tensors)


def _cast_all(args, kwargs, dtype, device):
    return (tuple(_cast(a, dtype, device) for a in args), {k: _cast(v, dtype, device) for k, v in kwargs.items()})


def _promote_type(values, device: str) -> torch.dtype:
    """C++'s promote_type: fp32 wins over the lower precision; another floating dtype is an error."""
    lower = current = torch.get_autocast_dtype(device)
    for tensor in _tensors(values):
        if not _eligible(tensor, device):
            continue
        if current is torch.float32 or tensor.dtype is torch.float32:
            current = torch.float32
        elif not (current is lower and tensor.dtype is lower):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _set_opt_dtype(op, args, kwargs):
    """fp32_set_opt_dtype: ask for a float32 result unless the caller chose a dtype."""
    position = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    if len(args) > position:
        if args[position] is None:
            args = args[:position] + (torch.float32,) + args[position + 1:]
    elif kwargs.get("dtype") is None:
        kwargs = dict(kwargs, dtype=torch.float32)
    return args, kwargs


def _kernel(op, policy: str, device: str, target=None):
    """The Python kernel for one op overload at one autocast key, mirroring C++'s WrapFunction_<policy>."""
    own_key = _OWN_KEY[device]

    def kernel(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            values = (*args, *kwargs.values())
            if policy == "banned" and any(_ON_DEVICE[device](t) for t in _tensors(values)):
                raise RuntimeError(_BANNED_MESSAGE)
            if not any(_eligible(t, device) for t in _tensors(values)):
                # Tensors of the other device type never reach this key on a real machine: pass them on.
                with torch._C._ExcludeDispatchKeyGuard(own_key):
                    return op(*args, **kwargs)
            with torch._C._ExcludeDispatchKeyGuard(_ALL_AUTOCAST):
                if policy == "lower_precision_fp":
                    args, kwargs = _cast_all(args, kwargs, torch.get_autocast_dtype(device), device)
                elif policy == "fp32":
                    args, kwargs = _cast_all(args, kwargs, torch.float32, device)
                elif policy == "promote":
                    args, kwargs = _cast_all(args, kwargs, _promote_type(values, device), device)
                elif policy == "cudnn_rnn":
                    dtype = torch.float16 if torch.backends.cudnn.enabled else torch.get_autocast_dtype(device)
                    args, kwargs = _cast_all(args, kwargs, dtype, device)
                elif not _eligible(args[0], device):  # the fp32_*_dtype policies look at the first argument only
                    pass
                elif policy == "fp32_set_opt_dtype":
                    args, kwargs = _set_opt_dtype(op, args, kwargs)
                else:  # fp32_append_dtype
                    return target(*args, **kwargs, dtype=torch.float32)
                return op(*args, **kwargs)

    return kernel


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


def policies(device: str) -> dict[str, str]:
    """Op overload name ("aten::mm", "aten::pow.Scalar") -> autocast policy, for the ops this torch registers."""
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key(_KEY[device].name))
    if device == "cuda":
        table = {**dict.fromkeys(CUDA_LOWER_PRECISION, "lower_precision_fp"), **dict.fromkeys(CUDA_FP32, "fp32"),
                 **dict.fromkeys(CUDA_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
                 **dict.fromkeys(CUDA_FP32_APPEND_DTYPE, "fp32_append_dtype"),
                 **dict.fromkeys(CUDA_PROMOTE, "promote"), **dict.fromkeys(CUDA_BANNED, "banned")}
        return {f"aten::{name}": policy for name, policy in table.items() if f"aten::{name}" in registered}
    table = {**dict.fromkeys(CPU_LOWER_PRECISION, "lower_precision_fp"), **dict.fromkeys(CPU_PROMOTE, "promote")}
    return {name: table.get(name.removeprefix("aten::"), "fp32") for name in registered if name.startswith("aten::")}


def _build_library() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point here
        warnings.simplefilter("ignore", UserWarning)
        for device in ("cuda", "cpu"):
            for name, policy in policies(device).items():
                short = name.removeprefix("aten::")
                target = _overload(CUDA_FP32_APPEND_DTYPE[short]) if policy == "fp32_append_dtype" else None
                library.impl(short, _kernel(_overload(short), policy, device, target), _KEY[device].name)
        for short in CUDA_CUDNN_RNN.split():
            library.impl(short, _kernel(_overload(short), "cudnn_rnn", "cuda"), _KEY["cuda"].name)
    return library


def _include_cuda_key() -> None:
    """Make every tensor of this thread reach AutocastCUDA; it stays inert while cuda autocast is off."""
    torch._C._dispatch_tls_set_dispatch_key_included(_KEY["cuda"], True)


class _Installation:
    """Who uses the takeover and what it replaced; an instance, so its changes are the emulator's own state."""

    def __init__(self):
        self.library: torch.library.Library | None = None
        self.users = 0
        self.saved: dict = {}


_installed = _Installation()


def install() -> None:
    """Take over autocast while an emulator runs (nested emulators share one installation)."""
    _installed.users += 1
    if _installed.users > 1:
        return
    _installed.library = _build_library()
    autocast_class = torch.amp.autocast_mode.autocast
    enter, clear = autocast_class.__enter__, torch.clear_autocast_cache
    _installed.saved = {"enter": enter, "clear": clear, "included": torch._C._dispatch_tls_is_dispatch_key_included(
        _KEY["cuda"])}

    def __enter__(self):
        if self.device == "cuda":
            _include_cuda_key()  # autocast state is per thread, so each thread entering a region needs it
        return enter(self)

    def clear_autocast_cache():
        clear()
        clear_cache()

    autocast_class.__enter__ = __enter__
    torch.clear_autocast_cache = clear_autocast_cache
    _include_cuda_key()


def uninstall() -> None:
    if _installed.users == 0:
        return
    _installed.users -= 1
    if _installed.users > 0:
        return
    torch.amp.autocast_mode.autocast.__enter__ = _installed.saved["enter"]
    torch.clear_autocast_cache = _installed.saved["clear"]
    torch._C._dispatch_tls_set_dispatch_key_included(_KEY["cuda"], _installed.saved["included"])
    _installed.library._destroy()
    _installed.library = None
    clear_cache()
