"""Fake CUDA tensors: a real CPU (or shape-only meta) tensor inside, a `cuda:i` device outside.

Every aten op on them, forward and backward, arrives in `__torch_dispatch__`, which hands it to the
dispatcher (course/cuda/kernels.py): it checks devices the way CUDA PyTorch does, runs the op on the CPU,
charges its cost to the simulated clock and counts the memory it allocates. The C++ device stays cpu/meta:
a C++ `cuda` device aborts backward. This module is the bottom of the CUDA layer: the modules that give the
tensor its behaviour sit above it and are connected through `hooks`.
"""
from __future__ import annotations

import copy
import functools
import os
from types import SimpleNamespace

import torch
import torch.utils._foreach_utils
from torch.optim import optimizer as _optimizer

from course.cuda.tensor_attributes import (STATE, assign_attributes, instance_dict, parameter_from_its_class,
                                           program_attributes)
from course.machine.memory import Block

# Emulator developers: COURSE_DEBUG=1 keeps the emulator's own frames in tracebacks. Otherwise an error in an
# emulated op is raised from the learner's call, as CUDA's errors come from C++ below the learner's line.
KEEP_FRAMES = bool(os.environ.get("COURSE_DEBUG"))

CPU = -1  # device index of the host in the emulator's bookkeeping

# Set by course.emulate() while an emulator is active; see course/cuda/emulator.py.
active = None
# True in a process forked from an emulating one, where CUDA may not be used (course/cuda/sharing.py).
forked_from_emulator = False

# How an EmulatedTensor answers PyTorch: Python-level torch calls (interception.handle_torch_function), aten ops
# (kernels.run_kernel) and pickling (checkpoints.reduce_ex). Those modules need this one, so it cannot import
# them: course/cuda/emulator.py, which imports them all, connects them here.
hooks = SimpleNamespace(torch_function=None, torch_dispatch=None, reduce_ex=None)


# Compressed sparse layouts (CSR, CSC and their block forms) and the accessors of their index parts. A tensor subclass
# of these layouts answers its layout through dispatch (`dispatch_layout`): its C++ wrapper cannot hold one.
COMPRESSED_PARTS = {torch.sparse_csr: ("crow_indices", "col_indices"),
                    torch.sparse_bsr: ("crow_indices", "col_indices"),
                    torch.sparse_csc: ("ccol_indices", "row_indices"),
                    torch.sparse_bsc: ("ccol_indices", "row_indices")}


def sparse_parts(inner: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors a sparse tensor is made of: indices and values (COO), or compressed indices, plain indices
    and values; the bytes it holds and a copy moves are theirs."""
    if inner.layout is torch.sparse_coo:
        return [inner._indices(), inner._values()]
    if inner.layout not in COMPRESSED_PARTS:
        raise NotImplementedError(f"The GPU emulator does not model {inner.layout} tensors on GPUs; run this part on "
                                  "a real GPU, or keep these tensors on the CPU.")
    return [getattr(inner, name)() for name in COMPRESSED_PARTS[inner.layout]] + [inner.values()]


def device_name(index: int) -> str:
    return "cpu" if index == CPU else f"cuda:{index}"


@functools.cache
def _device_object(index: int, torch_device=torch.device) -> torch.device:
    """`tensor.device`, made once per index: programs read it on every step, and while the emulator runs each
    `torch.device(...)` call goes through its wrapper and torch-function mode (PyTorch's own class is kept here)."""
    return torch_device("cpu") if index == CPU else torch_device("cuda", index)


def current_emulator(what: str):
    """The active emulator, or a clear error if a fake-GPU tensor outlived its `with` block."""
    if active is None:
        if forked_from_emulator:
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                               "you must use the 'spawn' start method")
        raise RuntimeError(
            f"{what}: this tensor lives on an emulated GPU, and no `with course.emulate(...)` block is "
            "active any more. Move results to the CPU with `.cpu()` inside the block."
        )
    return active


def parse_device(spec, emu=None) -> int:
    """Device index for 'cuda', 'cuda:1', torch.device, an int, or 'cpu' (-1), checked against the count."""
    emu = emu or current_emulator("device")
    if isinstance(spec, int):
        index = spec
    else:
        device = torch.device(spec)
        if device.type == "cpu":
            return CPU
        if device.type != "cuda":
            raise RuntimeError(
                f"The GPU emulator runs 'cuda' and 'cpu' devices; '{device}' is not emulated."
            )
        index = emu.current_device() if device.index is None else device.index
    if not 0 <= index < emu.num_gpus:
        raise torch.AcceleratorError(
            "CUDA error: invalid device ordinal\n"
            f"(this emulator has {emu.num_gpus} GPU{'s' if emu.num_gpus > 1 else ''}: "
            f"cuda:0 to cuda:{emu.num_gpus - 1}; asked for cuda:{index})"
        )
    return index


def device_mismatch(first: int, second: int) -> RuntimeError:
    """PyTorch's own wording, so learners meet the message they will see on real GPUs."""
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{device_name(first)} and {device_name(second)}!"
    )


def wait_for(tensor: EmulatedTensor, reason: str) -> None:
    """Block the host until the tensor's value exists: what `.item()` or printing does on a GPU."""
    emu = current_emulator(reason)
    if tensor._device_index != CPU:
        stream_ready = emu.clock.stream_ready(tensor._device_index, emu.current_stream_id(tensor._device_index))
        emu.clock.host_wait(max(tensor.ready_ns, stream_ready), f"{reason} waits for {tensor.device}")


# PyTorch's own, kept before the emulator puts its version for programs' subclasses in its place (subclasses.py)
_make_wrapper = torch._C.TensorBase._make_wrapper_subclass


class EmulatedTensor(torch.Tensor):
    """A tensor on an emulated GPU. `_inner` holds the data; `_block` its storage and readiness."""

    _inner: torch.Tensor
    _device_index: int
    _block: Block | None

    @staticmethod
    def __new__(cls, inner: torch.Tensor | None = None, device_index: int | None = None, block: Block | None = None,
                requires_grad=None, **attributes):
        if device_index is None:
            return parameter_from_its_class(inner, requires_grad, attributes)
        requires_grad = bool(requires_grad)
        tensor = None
        layout = inner.layout
        if layout is torch.strided and inner.is_contiguous() and not inner.storage_offset():
            # Most kernel outputs: the default strides and layout, which are cheaper not to pass (every op makes one;
            # `.shape` is cheaper than `.size()`, a method call that parses its arguments, for the same reason).
            # Contiguous is not always default: a size-1 dimension's stride may be anything (`x.t_()` of a row).
            tensor = _make_wrapper(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                         requires_grad=requires_grad)
            if tensor.stride() != inner.stride():
                tensor = None
        elif layout in COMPRESSED_PARTS:  # no strides, no storage offset: its parts have them
            tensor = _make_wrapper(cls, inner.shape, dtype=inner.dtype, layout=layout,
                                                         device=inner.device, requires_grad=requires_grad,
                                                         dispatch_layout=True)
        if tensor is None:
            tensor = _make_wrapper(
                cls,
                inner.shape,
                strides=inner.stride(),
                storage_offset=inner.storage_offset(),
                dtype=inner.dtype,
                layout=layout,
                device=inner.device,
                requires_grad=requires_grad,
            )
        tensor._inner = inner
        tensor._device_index = device_index
        tensor._block = block
        if inner.is_conj() or inner.is_neg():  # lazy conj()/imag views: the bit must be where the dispatcher sees it
            _copy_math_bits(tensor, inner)
        return tensor

    @property
    def __dict__(self):
        """The attributes a program set, as on a GPU box, where a parameter's `__dict__` is empty: code that copies
        them onto a new parameter (`moved.__dict__.update(param.__dict__)`) must not copy the emulator's own."""
        return program_attributes(self)

    @__dict__.setter
    def __dict__(self, attributes):
        assign_attributes(self, attributes)

    @property
    def device(self) -> torch.device:
        return _device_object(self._device_index)

    @property
    def is_cuda(self) -> bool:
        return self._device_index != CPU

    @property
    def is_cpu(self) -> bool:
        return self._device_index == CPU

    @property
    def is_meta(self) -> bool:
        return False

    def get_device(self) -> int:
        return self._device_index

    @property
    def ready_ns(self) -> int:
        return self._block.ready_ns if self._block is not None else 0

    def __repr__(self, *, tensor_contents=None) -> str:
        wait_for(self, "print")
        with torch._C.DisableTorchFunction():
            text = _format(self)
        # nn.Parameter keeps a tensor subclass's class and flags it instead; on a GPU box it is a Parameter,
        # whose __repr__ (torch/nn/parameter.py) puts this line first. A program's own subclass keeps its repr.
        if type(self) is EmulatedTensor and instance_dict(self).get("_is_param", False):
            return "Parameter containing:\n" + text
        return text

    def tolist(self):
        """`.tolist()`, also where torch functions are off: a jagged tensor's ops read its offsets so (unbind)."""
        if torch._C._is_torch_function_enabled():
            return super().tolist()
        return hooks.torch_function(torch.Tensor.tolist, (self,), {})

    def to(self, *args, **kwargs):
        """`.to()`, also where torch functions are off: a jagged tensor's `_to_copy` moves its offsets so."""
        if torch._C._is_torch_function_enabled():
            return super().to(*args, **kwargs)
        return hooks.torch_function(torch.Tensor.to, (self, *args), kwargs)

    def __format__(self, spec: str) -> str:
        """`f"{loss:.2f}"` formats a 0-dim tensor's value (a copy to the host, as `.item()`), like CUDA tensors."""
        if self.dim() == 0 and spec:
            if self._inner.is_meta:
                raise RuntimeError(f"Cannot format a shape-only tensor with {spec!r}: course.emulate(materialize="
                                   "False) computes shapes, times and memory, not values.")
            return format(self.item(), spec)
        return object.__format__(self, spec)

    def __copy__(self):
        """`copy.copy(x)`: another leaf tensor on x's memory, with its requires_grad and attributes, as PyTorch
        rebuilds one from the storage it shares (`Tensor.__reduce_ex__`); pickling would have copied the values."""
        twin = self.detach().requires_grad_(self.requires_grad)
        for key, value in instance_dict(self).items():
            if key not in STATE:
                setattr(twin, key, value)
        return twin

    def __deepcopy__(self, memo):
        """A copy on the same device (with its own memory), carrying over grad and user attributes. As in
        `Tensor.__deepcopy__`, a GPU tensor is rebuilt on the deep copy of its storage, which `memo` keeps: tensors
        that shared memory (views, the storages themselves) still share it in the copy."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            if self._device_index == CPU or self._block is None or not _plain_values(self._inner):
                twin = self.clone()
            else:
                storage = copy.deepcopy(self.untyped_storage(), memo)
                twin = torch.empty(0, dtype=self.dtype, device=self.device).set_(
                    storage, self.storage_offset(), self.size(), self.stride())
        twin.requires_grad_(self.requires_grad)
        if self.grad is not None:
            twin.grad = copy.deepcopy(self.grad, memo)
        for key, value in instance_dict(self).items():
            if key not in STATE:
                setattr(twin, key, copy.deepcopy(value, memo))
        memo[id(self)] = twin
        return twin

    def __reduce_ex__(self, protocol):
        """Inside torch.save, what a CUDA tensor saves as; other pickling sends a CPU copy plus the device
        (course/cuda/checkpoints.py)."""
        return hooks.reduce_ex(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        __tracebackhide__ = True  # errors read from the learner's line (see interception.handle_torch_function)
        return hooks.torch_function(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        __tracebackhide__ = True
        if len(types) > 1 and _another_subclass(types):
            return NotImplemented  # its own __torch_dispatch__ unwraps it first (torch/_tensor.py's protocol)
        emu = active if active is not None else current_emulator(str(func))
        try:
            return hooks.torch_dispatch(emu, func, args, kwargs or {})
        except Exception as error:
            if KEEP_FRAMES:
                raise
            # The error belongs to the torch call that reached this kernel: the emulator's frames are dropped.
            raise error.with_traceback(None) from error.__cause__


def _plain_values(inner: torch.Tensor) -> bool:
    """Whether a tensor is its storage's values read through sizes and strides (no layout or math bit to redo)."""
    return inner.layout is torch.strided and not (inner.is_meta or inner.is_conj() or inner.is_neg())


# On a GPU, optimizers and gradient clipping default to their foreach (multi-tensor) kernels; both check
# the tensor's type, so EmulatedTensors go on PyTorch's lists to take the same path (and kernel count).
for _supported in (_optimizer._foreach_supported_types,
                   torch.utils._foreach_utils._foreach_supported_types):
    if EmulatedTensor not in _supported:
        _supported.append(EmulatedTensor)


def _another_subclass(types) -> bool:
    """An op that also takes a tensor subclass with its own `__torch_dispatch__` that wraps emulated ones (a jagged
    tensor's view of its values, a program's LoggingTensor or int8 weight made with `_make_wrapper_subclass`): that
    subclass's handler must run first and hand the emulator its inner tensors, as PyTorch tries each subclass in turn
    until one does not return NotImplemented. Run here instead, the CPU kernel met a tensor with no storage."""
    return any(not issubclass(t, EmulatedTensor) and t.__torch_dispatch__ is not _NO_DISPATCH for t in types)


_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl


def _format(tensor: EmulatedTensor) -> str:
    """Format like a CUDA tensor: the values, then device, dtype and autograd suffixes."""
    inner = tensor._inner.detach()
    if inner.layout is not torch.strided and not inner.is_meta:
        return _format_sparse(tensor, inner)
    # A program's subclass (course/cuda/subclasses.py) prints its own name, as torch/_tensor_str.py's _str_intern has it.
    prefix = "tensor(" if type(tensor) is EmulatedTensor else f"{type(tensor).__name__}("
    if inner.is_meta:
        body, suffixes = "...", [f"device='{tensor.device}'", f"size={tuple(inner.shape)}"]
        suffixes.append("shape only: emulated with materialize=False, there are no values")
    elif inner.is_quantized:
        body = torch._tensor_str._tensor_str(inner.dequantize(), len(prefix))
        suffixes = [f"device='{tensor.device}'"] if tensor._device_index != CPU else []
        suffixes += _quantized_suffixes(inner)
    else:
        body = torch._tensor_str._tensor_str(inner, len(prefix))
        suffixes = [f"device='{tensor.device}'"] if tensor._device_index != CPU else []
        if inner.numel() == 0 and inner.dim() != 1:
            suffixes.append(f"size={tuple(inner.shape)}")
    # PyTorch's rule (torch/_tensor_str.py): values show int64, bool and the default complex dtype; no values do not.
    default_complex = torch.cdouble if torch.get_default_dtype() == torch.double else torch.cfloat
    implied = (torch.get_default_dtype(),) if inner.is_meta or inner.numel() == 0 else (
        torch.get_default_dtype(), default_complex, torch.int64, torch.bool)
    if inner.dtype not in implied and not inner.is_quantized:
        suffixes.append(f"dtype={inner.dtype}")
    if tensor.grad_fn is not None:
        suffixes.append(f"grad_fn=<{type(tensor.grad_fn).__name__}>")
    elif tensor.requires_grad:
        suffixes.append("requires_grad=True")
    return torch._tensor_str._add_suffixes(prefix + body, suffixes, len(prefix), False)


def _quantized_suffixes(inner: torch.Tensor) -> list[str]:
    """Size, dtype and quantization parameters, as torch/_tensor_str.py's _str_intern gives them."""
    suffixes = [f"size={tuple(inner.shape)}", f"dtype={inner.dtype}", f"quantization_scheme={inner.qscheme()}"]
    if inner.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return suffixes + [f"scale={inner.q_scale()}", f"zero_point={inner.q_zero_point()}"]
    return suffixes + [f"scale={inner.q_per_channel_scales()}", f"zero_point={inner.q_per_channel_zero_points()}",
                       f"axis={inner.q_per_channel_axis()}"]


def _format_sparse(tensor: EmulatedTensor, inner: torch.Tensor) -> str:
    """A sparse tensor as CPU torch prints its parts, then the suffixes in torch/_tensor_str.py's order and line
    breaks, the device first."""
    text = torch._tensor_str._str(inner)
    contents = text[:text.rfind("size=(")].rstrip()[:-1]  # the parts, without the CPU tensor's suffixes
    suffixes = [f"device='{tensor.device}'"] if tensor._device_index != CPU else []
    suffixes += [f"size={tuple(inner.shape)}", f"nnz={inner._nnz()}"]
    default_complex = torch.cdouble if torch.get_default_dtype() == torch.double else torch.cfloat
    if inner.dtype not in (torch.get_default_dtype(), default_complex, torch.int64, torch.bool):
        suffixes.append(f"dtype={inner.dtype}")
    suffixes.append(f"layout={inner.layout}")
    if tensor.grad_fn is not None:
        suffixes.append(f"grad_fn=<{type(tensor.grad_fn).__name__}>")
    elif tensor.requires_grad:
        suffixes.append("requires_grad=True")
    return torch._tensor_str._add_suffixes(contents, suffixes, len("tensor("), inner.is_sparse)


def _copy_math_bits(tensor: torch.Tensor, inner: torch.Tensor) -> None:
    """`z.conj()` and `z.conj().imag` are views with a conjugate or negative bit that ops resolve before their
    kernel runs. Inside `__torch_dispatch__` that resolution is switched off, so a kernel handed the inner tensor
    would read it unconjugated: the wrapper carries the bit instead, and PyTorch resolves it before dispatching."""
    torch._C._set_conj(tensor, inner.is_conj())
    torch._C._set_neg(tensor, inner.is_neg())


def wrap(inner: torch.Tensor, device_index: int, block: Block | None, requires_grad=False):
    return EmulatedTensor(inner, device_index, block, requires_grad)
