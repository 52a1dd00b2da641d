"""Every aten op on an emulated GPU's tensors, forward and backward: the dispatcher behind
`EmulatedTensor.__torch_dispatch__`.

It checks devices the way CUDA PyTorch does, runs the op on the CPU (or meta), charges its cost to the
simulated clock and counts the memory it allocates.
"""
from __future__ import annotations

import functools
import sys
import threading
import warnings

import torch
import torch.utils._pytree
from torch._library import custom_ops
from torch.multiprocessing.reductions import StorageWeakRef

from course.cuda import (blas_dtypes, cuda_only_ops, determinism, device_asserts, device_checks, foreach_devices,
                         forked_rng, functorch_layers, graphs, host_only_ops, kernel_dtypes, out_devices, quantized,
                         sync_debug)
from course.cuda.devices import CPU, EmulatedTensor, device_mismatch, device_name, parse_device, sparse_parts, wrap
from course.cuda.interception import ENGINE_ENTRY_POINTS, EmulatorMode, handle_torch_function
from course.cuda.transfers import _raw_move, copy_into, device_of, moving_to_host, read_scalar
from course.machine import costs


_group_by_cpp_device = torch._C._group_tensors_by_device_and_dtype


def group_tensors_by_device_and_dtype(tensorlistlist, with_indices=False):
    """PyTorch's grouping before foreach kernels, by the emulated device: C++ sees every EmulatedTensor as a
    CPU tensor, so it would put cuda:0 and cuda:1 in one group and hand `clip_grad_norm_` a "cpu" key to
    move its scale to (a copy and a host wait no GPU run has)."""
    grouped = {}
    for (device, dtype), (lists, indices) in _group_by_cpp_device(tensorlistlist, with_indices).items():
        by_device: dict = {}
        for position, tensor in enumerate(lists[0]):
            by_device.setdefault(tensor.device, []).append(position)
        for real_device, positions in by_device.items():
            parts = [[tensors[p] for p in positions] if tensors else tensors for tensors in lists]
            _check_same_index_devices(real_device, parts[1:])
            grouped[(real_device, dtype)] = (parts, [indices[p] for p in positions] if indices else indices)
    return grouped


_HOST_STEP_DTYPES = (torch.float32, torch.float64)


def _check_same_index_devices(device: torch.device, lists) -> None:
    """The grouping's device rule, which C++ checks on the CPU device each EmulatedTensor has inside: a tensor must be
    on its index's first-list device, or be a host float32/float64 tensor (an optimizer's `step`). A state left on
    another GPU (a model moved after its optimizer stepped) is refused with C++'s message."""
    index = device.index if device.type == "cuda" else CPU
    for tensors in lists:
        for t in tensors:
            if type(t) is EmulatedTensor:  # the usual case, checked first: every optimizer step groups its state
                if t._device_index == index:
                    continue
                where = t._device_index
            elif t is None:
                continue
            elif type(t) is torch.Tensor:  # a host tensor (the `step`s): its dtype read below the torch-function modes
                with _no_torch_function():
                    if index == CPU or t.dtype in _HOST_STEP_DTYPES:
                        continue
                where = CPU
            else:  # a wrapper subclass holding GPU shards (FSDP2's DTensor parameters)
                where = t.device.index if t.device.type == "cuda" else CPU
            if where != index and not (where == CPU and t.dtype in _HOST_STEP_DTYPES):
                raise RuntimeError(
                    "Tensors of the same index must be on the same device and the same dtype except `step` tensors "
                    "that can be CPU and float32/64, and optimizer states that can be bfloat16 for mixed-precision "
                    "training")


class _OpInfo:
    """What the dispatcher needs to know about an op, worked out once per op rather than per call."""

    __slots__ = ("name", "no_kernel", "returns_view", "tensor_cores", "cudnn", "overwrites_first", "kernel",
                 "special", "sizes_from_data", "embedding", "restrides", "writes_in_place", "alert",
                 "python_cuda_kernel", "gpu_check", "bumps_versions", "writes_unreturned", "asserts", "draws")

    def __init__(self, func):
        self.name = func._overloadpacket._qualified_op_name
        unsafe_view = func is torch.ops.aten._unsafe_view.default
        # Views, metadata-only ops and uninitialised allocations launch no kernel on a real GPU (`_unsafe_view` is
        # a view whose schema does not say so: `linear` and `matmul` reshape their result with it; `empty_like`
        # only asks the caching allocator for memory).
        self.restrides = func._overloadpacket in _RESTRIDING_OPS
        # Arguments an op that returns nothing writes (`_foreach_mul_(params, ...)`): they are ready when it ends.
        self.writes_in_place = tuple(i for i, a in enumerate(func._schema.arguments)
                                     if not func._schema.returns and a.alias_info is not None and a.alias_info.is_write)
        # CUDA's foreach kernels bump the version counters of the tensors they write (ForeachFunctors.cuh's
        # increment_version), as ATen's per-tensor in-place ops do: these ops have no ADInplaceOrView kernel to.
        self.bumps_versions = self.writes_in_place if self.name.startswith("aten::_foreach_") else ()
        # Tensors an op writes without returning them, which its kernel may resize: `_fused_moving_avg_obs_fq_helper`
        # (a QAT per-channel FakeQuantize) grows its observer's empty min/max and its scale and zero point to one per
        # channel, as FusedObsFakeQuant.cu does. Their wrappers must take the new shape, as `_given_back` gives a
        # returned one. Foreach ops never resize theirs.
        returned = [r.alias_info.before_set for r in func._schema.returns if r.alias_info is not None]
        self.writes_unreturned = () if self.name.startswith("aten::_foreach_") else tuple(
            i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
            and not a.kwarg_only and a.type.kind() == "TensorType" and a.alias_info.before_set not in returned)
        self.no_kernel = (func.is_view or unsafe_view or func._overloadpacket in _ALLOCATION_ONLY or self.restrides
                          or func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default))
        self.returns_view = unsafe_view or any(r.alias_info is not None for r in func._schema.returns)
        self.tensor_cores = costs.uses_tensor_cores(func)
        self.cudnn = func._overloadpacket in (torch.ops.aten.convolution, torch.ops.aten._convolution,
                                              torch.ops.aten.convolution_backward, torch.ops.aten.cudnn_convolution,
                                              torch.ops.aten.cudnn_convolution_transpose)
        # These write their first argument without reading it: it is not memory traffic in.
        self.overwrites_first = func._overloadpacket in _OVERWRITING_OPS
        # What runs it: the C++ operator itself (an OpOverload's __call__ only forwards to it), or a CUDA-only op
        # written with CPU ops.
        self.kernel = cuda_only_ops.KERNELS.get(func) or func._op
        # Ops that may leave the kernel path: a copy between devices, a read of a value by the host, a convolution
        # being traced, a compressed sparse tensor's layout.
        self.special = func in (torch.ops.aten.copy_.default, torch.ops.aten._local_scalar_dense.default,
                                torch.ops.aten.convolution.default, _LAYOUT, _TO_COPY) or \
            func in foreach_devices.PACKED_SCALARS
        # Ops whose CUDA kernel may wait for the GPU to size its output: torch.cuda.set_sync_debug_mode warns there.
        self.sizes_from_data = func._overloadpacket in sync_debug.DATA_DEPENDENT_OPS or func in sync_debug.SOMETIMES
        self.embedding = func is torch.ops.aten.embedding.default  # reads only the rows it returns
        # What its CUDA kernel says under torch.use_deterministic_algorithms(True) (course/cuda/determinism.py).
        self.alert = determinism.ALERTS.get(func._overloadpacket)
        self.asserts = device_asserts.asserts(func)  # checks indices on the GPU (course/cuda/device_asserts.py)
        self.draws = torch.Tag.nondeterministic_seeded in func.tags  # from the GPU's generator (course/cuda/forked_rng.py)
        # What a GPU refuses that the CPU runs: a matrix product of integers, an op with no CUDA kernel at all, or
        # none for quantized tensors.
        blas_name = blas_dtypes.DISPATCH_NAMES.get(func._overloadpacket)
        self.gpu_check = functools.partial(blas_dtypes.check, blas_name) if blas_name else (
            host_only_ops.refusal(func) or _both(quantized.refusal(func), kernel_dtypes.refusal(func)))
        if func is _CONVOLUTION:  # cuDNN compares the tensors' types before anything else
            self.gpu_check = _both(device_checks.check_convolution_types, self.gpu_check)
        # A CUDA kernel registered from Python, by the program (torch.library.custom_op's register_kernel("cuda"),
        # Library.impl with "CUDA") or by PyTorch itself (FSDP2's fsdp:: copy-in ops, symm_mem): a GPU runs it rather
        # than the op's CPU kernel, so its body runs on the emulated tensors, op by op. So does a custom op's one
        # body for every device (torch/nn/attention/varlen.py's torch_attn ops): on a GPU it runs on CUDA tensors and
        # calls their CUDA kernels. The CUDA kernels a CPU build has in C++ (c10d's collectives, two aten/_native ops)
        # are the emulator's to model.
        self.python_cuda_kernel = func.namespace not in ("aten", "c10d", "_native", "prim", "prims") and (
            torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CUDA") or func.name() in custom_ops.OPDEFS)


def _both(first, second):
    """One check of two (avg_pool2d refuses quantized GPU tensors and integer ones), or the one there is."""
    if first is None or second is None:
        return first or second
    return lambda args: (first(args), second(args))


_ALLOCATION_ONLY = {getattr(torch.ops.aten, name) for name in
                    ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided")}
# In-place ops that give their first argument new sizes, strides or storage (`x.unsqueeze_(0)`, `x.t_()`,
# `x.resize_(n)`, `x.set_(other)`): no kernel runs, and the tensor's own metadata must follow its data's.
_RESTRIDING_OPS = {getattr(torch.ops.aten, name) for name in
                   ("t_", "transpose_", "unsqueeze_", "squeeze_", "as_strided_", "swapdims_", "swapaxes_",
                    "resize_", "resize_as_", "set_")}
_OVERWRITING_OPS = {getattr(torch.ops.aten, name) for name in
                    ("copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_", "exponential_")}
_OP_INFO: dict = {}
_LAYOUT = torch.ops.prim.layout.default
_TO_COPY = torch.ops.aten._to_copy.default
_CUDA_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def _op_info(func) -> _OpInfo:
    """Keyed by the C++ operator, whose hash is C's, where an OpOverload's hash is a Python call."""
    info = _OP_INFO.get(func._op)
    if info is None:
        info = _OP_INFO[func._op] = _OpInfo(func)
    return info


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _common_device(func, tensors, args, kwargs) -> tuple[int | None, bool]:
    """The one device all tensor arguments share, by CUDA PyTorch's rules, else its error.

    0-dim CPU tensors may join a GPU in TensorIterator's kernels, not in those whose generated wrapper checks devices
    (device_checks.py). PyTorch's own C++ (the autograd engine's zero gradients, DDP's gradient buckets) makes
    plain CPU tensors that stand for memory on the op's GPU: those join the GPU too, and the second result says so
    (see `host_scratch`).
    """
    if func is _BLOCK_DIAG:
        _check_block_diag_devices(tensors)
    if func._op in _MASKED_FILLS:  # the C++ operator: its hash is C's
        device_checks.check_masked_fill(args, _host_tensor_from_program)
    elif func is _CONVOLUTION:
        device_checks.check_convolution(args, _host_tensor_from_program)
    device, scratch, host_scalars = None, False, 0
    for arg in tensors:
        if isinstance(arg, EmulatedTensor):
            index = arg._device_index
        elif not (arg.dim() == 0 and arg.device.type in ("cpu", "meta")):  # meta: a scalar C++ wrapped, shape-only
            index = CPU
        else:
            host_scalars += 1
            continue
        if device is None or device == index:
            device = index
        elif CPU in (device, index) and (func in _HOST_INDEX_OPS and device != CPU or _from_torch_internals()):
            device, scratch = max(device, index), True
        elif func is _INDEX and device == CPU:  # `host_table[gpu_ids]`: the meta function's check (pytorch#69607)
            raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        elif func is torch.ops.aten.copy_.default:
            continue
        else:
            device_checks.check(func, args, kwargs)
            # TensorIterator's words: the first device not the CPU's, then the one that differs from it
            raise device_mismatch(max(device, index), CPU) if CPU in (device, index) else device_mismatch(device, index)
    if host_scalars and device not in (None, CPU) and device_checks.checks_devices(func) \
            and _host_tensor_from_program():
        device_checks.check(func, args, kwargs)
    if host_scalars > 1 and device not in (None, CPU) and func._overloadpacket in _TERNARY_POINTWISE \
            and _host_tensor_from_program():
        raise RuntimeError("Trying to pass too many CPU scalars to non-CPU kernel!")  # TensorIterator takes one
    return device, scratch


# Ops with three tensor inputs that TensorIterator runs with `allow_cpu_scalars` (PointwiseOps.cpp, Lerp.cpp)
_TERNARY_POINTWISE = {torch.ops.aten.addcmul, torch.ops.aten.addcmul_, torch.ops.aten.addcdiv, torch.ops.aten.addcdiv_,
                      torch.ops.aten.lerp, torch.ops.aten.lerp_}


_MASKED_FILLS = {op._op for op in (torch.ops.aten.masked_fill.Scalar, torch.ops.aten.masked_fill.Tensor,
                                    torch.ops.aten.masked_fill_.Scalar, torch.ops.aten.masked_fill_.Tensor)}
_CONVOLUTION = torch.ops.aten.convolution.default
_BLOCK_DIAG = torch.ops.aten.block_diag.default
_FILL_TENSOR = torch.ops.aten.fill_.Tensor


def _check_block_diag_devices(tensors) -> None:
    """block_diag compares each input's device with the first's itself (0-dim CPU tensors too), in its own words."""
    first = device_of(tensors[0])
    for position, tensor in enumerate(tensors[1:], 1):
        if device_of(tensor) != first:
            raise RuntimeError("torch.block_diag: input tensors must all be on the same device. Input 0 is on device "
                               f"{device_name(first)} and input {position} is on device "
                               f"{device_name(device_of(tensor))}")


# CUDA indexing accepts index tensors on the CPU and copies them over itself (ATen's index and index_put); a CPU
# tensor takes no GPU index tensors.
_INDEX = torch.ops.aten.index.Tensor
_HOST_INDEX_OPS = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                   torch.ops.aten._index_put_impl_.default}
_PUT_OPS = _HOST_INDEX_OPS - {_INDEX}


def _check_put_values(args, kwargs, device: int) -> None:
    """Only the index tensors of `gpu_x[cpu_idx] = v` may stay on the host: the values must be on x's GPU (a 0-dim
    CPU tensor is copied over), as ATen's `_index_put_impl_` checks on its sort path (accumulate, or deterministic
    algorithms) and TensorIterator on the other."""
    values = args[2] if len(args) > 2 else kwargs["values"]
    on_host = values._device_index == CPU if isinstance(values, EmulatedTensor) else values.device.type == "cpu"
    if values.dim() == 0 or not on_host:
        return
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate or torch.are_deterministic_algorithms_enabled() and values.numel() > 1:
        raise RuntimeError(f"expected device {device_name(device)} but got device cpu for value tensor")
    raise device_mismatch(device, CPU)


def _from_torch_internals(host_scalars_count: bool = False) -> bool:
    """Whether the op being dispatched was issued by PyTorch's C++ rather than by a Python call.

    A learner's `gpu_tensor + cpu_tensor` passes through `EmulatorMode` (or `handle_torch_function`) and must fail
    as on a GPU; the same mix issued by the autograd engine or DDP's reducer (inside `backward()`, or from C++
    with no Python torch call in between) is PyTorch's own bookkeeping and must work. So must the tensors a
    composite op's C++ makes for itself (`one_hot`'s zeros, SDPA's causal mask) when the call was given no
    CPU tensor: C++ makes them with the CPU device the emulated tensors have underneath. A 0-dim CPU tensor the call
    was given counts as one where it is written (`out=`), not only read, hence `host_scalars_count`.
    """
    call = _python_call()
    return call is None or not _host_tensor_among(call.get("args"), call.get("kwargs"), host_scalars_count)


def _host_tensor_from_program() -> bool:
    """Whether the program's own torch call handed the op a host tensor, a 0-dim one included (`x.clamp(max=t)`),
    rather than C++ making it on the CPU device the emulated tensors have underneath."""
    call = _python_call()
    return call is not None and _host_tensor_among(call.get("args"), call.get("kwargs"), scalars=True)


def _python_call() -> dict | None:
    """The arguments of the Python torch call (through `EmulatorMode` or `handle_torch_function`) the op being
    dispatched came from, or None for PyTorch's own bookkeeping (the autograd engine, `backward()`, DDP's C++)."""
    if torch._C._current_autograd_node() is not None or graphs.replaying():  # replay: as issued at capture
        return None
    routing, mode = handle_torch_function.__code__, EmulatorMode.__torch_function__.__code__
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is routing or frame.f_code is mode:
            call = frame.f_locals
            return None if call.get("func") in ENGINE_ENTRY_POINTS else call
        frame = frame.f_back
    return None


def _host_tensor_among(args, kwargs, scalars: bool = False) -> bool:
    """Whether a Python torch call was handed a CPU tensor with dimensions (0-dim ones may join any device), or any
    CPU tensor with `scalars`."""
    leaves = [functorch_layers.unwrapped(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor)]
    return any((scalars or t.dim() > 0)
               and (t._device_index == CPU if isinstance(t, EmulatedTensor) else t.device.type == "cpu")
               for t in leaves)


# Plain CPU tensors that PyTorch's C++ uses as GPU memory (DDP's buckets): when their contents are ready,
# by storage address, so the kernel that reads a bucket after its all-reduce waits for it. Each entry keeps a
# weak reference to its storage: once that storage is freed, the allocator may hand the address to another
# tensor (another rank's, another run's), which must not inherit the old time.
class _ScratchReadyTimes:
    """The ready times above, in an object rather than module-level tables: they change with every run, and the
    grading guard treats a module's dicts and lists as instrument that learner code must not touch."""

    def __init__(self):
        self.by_address: dict[int, tuple[StorageWeakRef, int]] = {}
        self.lock = threading.Lock()
        self.prune_at = 64  # entries before the next sweep of freed storages (amortised)

    def ready(self, tensor: torch.Tensor) -> int:
        if tensor._is_zerotensor():  # forward AD's efficient zero tangent: no storage, never written
            return 0
        entry = self.by_address.get(tensor.untyped_storage().data_ptr())
        if entry is None or entry[0].expired():
            return 0
        return entry[1]

    def mark(self, tensor: torch.Tensor, ready_ns: int) -> None:
        storage = tensor.untyped_storage()
        with self.lock:
            if len(self.by_address) >= self.prune_at:
                for address in [a for a, (ref, _) in self.by_address.items() if ref.expired()]:
                    del self.by_address[address]
                self.prune_at = max(64, 2 * len(self.by_address))
            ready_ns = max(self.ready(tensor), ready_ns)
            self.by_address[storage.data_ptr()] = (StorageWeakRef(storage), ready_ns)


_scratch = _ScratchReadyTimes()
host_scratch_ready = _scratch.ready
mark_host_scratch = _scratch.mark


def _unwrap(value, tensors: list):
    """Replace EmulatedTensors by their inner tensors, in lists and tuples too, collecting every tensor."""
    if type(value) is EmulatedTensor:  # the usual argument, tested first
        tensors.append(value)
        return value._inner
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        if isinstance(value, EmulatedTensor):
            return value._inner
        if value._is_zerotensor():  # forward AD's efficient zero tangent: CPU kernels below the dispatcher read its
            return torch.zeros(value.shape, dtype=value.dtype, device=value.device)  # (absent) memory: a crash
        return value
    if type(value) in (list, tuple):
        for v in value:
            if isinstance(v, (torch.Tensor, list, tuple)):
                break
        else:
            return value  # sizes, dims, scalars (most lists): nothing to unwrap
        unwrapped = []
        for v in value:  # a foreach kernel's tensors: EmulatedTensors, unwrapped without a call each
            if type(v) is EmulatedTensor:
                tensors.append(v)
                unwrapped.append(v._inner)
            else:
                unwrapped.append(_unwrap(v, tensors))
        return type(value)(unwrapped)
    return value


_SCALARS = (int, float, bool, type(None))
_torch_function_mode_on = torch._C._is_torch_function_mode_enabled
_no_torch_function = torch._C.DisableTorchFunction
_tracing = torch._C._is_tracing
_bookkeeping_under_trace = threading.local()


def _run_traced(emu, func, args, kwargs):
    """Under torch.jit.trace every size read in Python is a traced tensor, so the emulator's bookkeeping would warn the
    program that its trace "might not generalize". The tracer records the op above the Python key, before it comes
    here, and PyTorch refuses to turn tracing back on inside a kernel: the warnings are silenced instead."""
    _bookkeeping_under_trace.on = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return run_kernel(emu, func, args, kwargs)
    finally:
        _bookkeeping_under_trace.on = False


def run_kernel(emu, func, args, kwargs):
    """Run one aten op on the CPU and charge it to the simulated GPU it runs on.

    The autograd engine runs backward's ops with the thread's torch-function modes on (EmulatorMode, a program's
    own), where a forward op's arrive with them off: each tensor method the dispatcher calls (a stride, a size)
    would be one more Python call through them. A GPU's kernels run below them, so the dispatcher does too; a
    CUDA kernel written in Python keeps them, since its body may call the torch API.
    """
    info = _OP_INFO.get(func._op) or _op_info(func)
    if _torch_function_mode_on() and not info.python_cuda_kernel:
        with _no_torch_function():
            return run_kernel(emu, func, args, kwargs)  # the same op, the modes now off
    if _tracing() and not getattr(_bookkeeping_under_trace, "on", False):
        return _run_traced(emu, func, args, kwargs)
    # Every op of a training step passes here, so the usual case (EmulatedTensors on one device, one tensor out) is
    # checked first and takes the shortest path; PyTorch's rules for mixing devices run only when needed.
    tensors: list[torch.Tensor] = []
    un_args = []
    for a in args:
        if type(a) is EmulatedTensor:  # the usual argument, unwrapped here rather than in a call per argument
            tensors.append(a)
            un_args.append(a._inner)
        elif type(a) in _SCALARS:
            un_args.append(a)
        else:
            un_args.append(_unwrap(a, tensors))
    un_kwargs = {k: _unwrap(v, tensors) for k, v in kwargs.items()} if kwargs else {}
    device, scratch, emulated = None, False, tensors
    for t in tensors:
        if type(t) is not EmulatedTensor or (device is not None and t._device_index != device):
            if foreach_devices.reroutes(func, args):
                return foreach_devices.run(func, args, kwargs)
            if func is _FILL_TENSOR and isinstance(args[1], EmulatedTensor) and args[1].dim() == 0:
                return args[0].fill_(read_scalar(args[1]))  # ATen's fill_ reads a value on another device with item()
            refusal = out_devices.refusal(func, args, kwargs)
            if refusal is not None and not _from_torch_internals(True):  # DDP's reducer writes host stand-ins
                raise refusal
            device, scratch = _common_device(func, tensors, args, kwargs)
            if func in _PUT_OPS and device != CPU and not _from_torch_internals():  # index_put's backward zeros
                _check_put_values(args, kwargs, device)
            emulated = [t for t in tensors if isinstance(t, EmulatedTensor)]
            break
        device = t._device_index
    if info.python_cuda_kernel and device is not None and device != CPU:
        return func.redispatch(_CUDA_KEYS, *args, **kwargs)  # its ops run on the emulated tensors, and are timed
    if info.special:
        if func is torch.ops.aten.copy_.default and not scratch and _crosses_devices(tensors):
            return copy_into(args[0], args[1], non_blocking=kwargs.get("non_blocking", False))
        if func is torch.ops.aten._local_scalar_dense.default:
            return read_scalar(args[0])
        if func is _TO_COPY and kwargs.get("device") is not None and not scratch:
            target = _to_copy_target(emu, kwargs["device"], device)
            if target is not None:
                return _to_copy_across(emu, args[0], target, kwargs)
            un_kwargs = {k: v for k, v in un_kwargs.items() if k != "device"}  # where it is: the host's kernel
        if func in foreach_devices.PACKED_SCALARS:  # their scalars in a GPU tensor: refused as CUDA refuses them
            return foreach_devices.run(func, args, kwargs)
        if func is _LAYOUT:  # asked only of compressed sparse tensors (devices.COMPRESSED_PARTS)
            return args[0]._inner.layout
        if func is torch.ops.aten.convolution.default and torch._C._get_tracing_state() is not None:
            return _traced_convolution(emu, args)
    if info.sizes_from_data and emu.sync_debug_mode and device not in (None, CPU) and \
            sync_debug.is_data_dependent(func, args, kwargs):
        sync_debug.on_sync(emu)
    if info.alert is not None and device is not None and device != CPU and _deterministic():
        info.alert(func, args, kwargs)
    if un_kwargs and un_kwargs.get("device") is not None:
        device, un_kwargs = _asked_device(emu, device, un_kwargs)
    if info.gpu_check is not None and device is not None and device != CPU:
        info.gpu_check(un_args)
    try:
        if info.draws and device not in (None, CPU) and forked_rng.leaves_out(device):
            out = forked_rng.draw_outside(info.kernel, un_args, un_kwargs)
        elif any(t.is_complex() for t in tensors):
            out = _with_view_bits(info.kernel, un_args, un_kwargs)
        else:
            out = info.kernel(*un_args, **un_kwargs) if un_kwargs else info.kernel(*un_args)
    except NotImplementedError as error:
        if any(t.is_meta for t in tensors if not isinstance(t, EmulatedTensor)) or any(
                t._inner.is_meta for t in emulated):
            raise NotImplementedError(
                f"The GPU emulator cannot run {func} in shape-only mode (materialize=False): "
                f"{str(error).splitlines()[0]} Run this part with course.emulate(..., materialize=True).") from None
        raise NotImplementedError(
            f"The GPU emulator cannot run {func}: CPU PyTorch has no kernel for it and the emulator does not "
            f"model it yet ({str(error).splitlines()[0]}). Run this part on a real GPU.") from None
    except (IndexError, RuntimeError) as error:
        asserted = device_asserts.triggered(func, error) if info.asserts and device not in (None, CPU) else None
        if asserted is None:
            raise
        raise asserted from None
    for index in info.bumps_versions:
        written = args[index] if index < len(args) else ()
        torch.autograd.graph.increment_version([t for t in written if isinstance(t, EmulatedTensor)])
    for index in info.writes_unreturned:
        written = args[index] if index < len(args) else None
        if type(written) is EmulatedTensor and written._inner.layout is torch.strided and (
                written._inner.shape != written.shape or written._inner.stride() != written.stride()):
            _follow_new_metadata(emu, written, (), written._device_index)
    if info.cudnn:
        out = _memory_format_like_cudnn(func, out, un_args)
    if type(out) is torch.Tensor and device is not None and device != CPU and not scratch:
        return _finish_one(emu, func, info, device, tensors, emulated, args, un_args, un_kwargs, out)
    multiple = isinstance(out, (tuple, list))
    flat_out = list(out) if multiple else [out]

    if device is None or device == CPU:
        wrapped = [wrap(o, CPU, None) if isinstance(o, torch.Tensor) else o for o in flat_out]
        return type(out)(wrapped) if multiple else wrapped[0]

    inputs_ready_ns = 0
    for t in emulated:
        block = t._block
        if block is not None and block.ready_ns > inputs_ready_ns:
            inputs_ready_ns = block.ready_ns
    scratch_ids = ()
    if scratch:
        plain = [t for t in tensors if not isinstance(t, EmulatedTensor) and t.dim() > 0]
        scratch_ids = {id(t) for t in plain}
        inputs_ready_ns = max([inputs_ready_ns] + [host_scratch_ready(t) for t in plain])
    end_ns = inputs_ready_ns
    if info.no_kernel:
        emu.clock.host_advance(costs.HOST_VIEW_NS)
    else:
        bytes_read = 0
        for t in tensors:
            if isinstance(t, EmulatedTensor) or id(t) in scratch_ids:
                bytes_read += t.numel() * t.element_size()
        if info.embedding:  # a lookup reads the rows it returns, not the whole table
            bytes_read -= _tensor_nbytes(args[0]) - sum(_tensor_nbytes(o) for o in flat_out)
        if info.overwrites_first and (isinstance(args[0], EmulatedTensor) or id(args[0]) in scratch_ids):
            bytes_read -= _tensor_nbytes(args[0])
        nbytes, dtype = bytes_read, None
        for o in flat_out:
            if isinstance(o, torch.Tensor):
                nbytes += o.numel() * o.element_size()
                if dtype is None:
                    dtype = o.dtype
        end_ns = _charge_kernel(emu, func, info, device, un_args, un_kwargs, out, nbytes, dtype or torch.float32,
                                inputs_ready_ns)
    for index in info.writes_in_place:
        written = args[index] if index < len(args) else ()
        for t in written if isinstance(written, (list, tuple)) else (written,):
            if isinstance(t, EmulatedTensor) and t._block is not None and t._block.ready_ns < end_ns:
                t._block.ready_ns = end_ns
    wrapped = []
    by_inner = {id(t._inner): t for t in emulated}  # one lookup per output: a foreach op has as many as inputs
    for o in flat_out:
        if not isinstance(o, torch.Tensor):
            wrapped.append(o)
            continue
        same = by_inner.get(id(o))
        if same is not None:  # in-place or out=: the same tensor comes back
            wrapped.append(_given_back(emu, info, same, o, args, device, end_ns))
        elif id(o) in scratch_ids:  # PyTorch's C++ wrote into its own buffer (e.g. a DDP bucket)
            mark_host_scratch(o, end_ns)
            wrapped.append(o)
        elif info.returns_view and emulated:
            wrapped.append(_view_of(o, device, emulated[0]))
        else:
            block = emu.memory.allocate(device, _storage_nbytes(o), end_ns)
            wrapped.append(EmulatedTensor(o, device, block))
    return type(out)(wrapped) if multiple else wrapped[0]


_set_excluded = torch._C._SetExcludeDispatchKeyGuard
_CONJUGATE, _NEGATIVE = torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative


def _with_view_bits(kernel, args, kwargs):
    """Run a kernel with the dispatcher's Conjugate and Negative fallbacks on, as a CPU or CUDA kernel runs.

    Inside __torch_dispatch__ every key above Python is excluded, those two included; a kernel that builds a lazy
    conjugate view of a complex tensor itself (`linalg_pinv`'s `Vh.mH() * S`, `linalg_lstsq`) then computed with the
    conjugate bit ignored: a silently wrong answer. Only complex tensors carry those bits, so only their ops pay."""
    with _set_excluded(_CONJUGATE, False), _set_excluded(_NEGATIVE, False):
        return kernel(*args, **kwargs)


def _follow_new_metadata(emu, tensor: EmulatedTensor, args, device: int) -> None:
    """After a restriding op on `tensor`'s data: its sizes and strides become its data's, and its memory block the one
    its data now lives in (the source's for `set_`, a bigger one when `resize_` grew it)."""
    inner, block = tensor._inner, tensor._block
    source = args[1] if len(args) > 1 else None
    if isinstance(source, EmulatedTensor) and source._block is not None:  # set_(tensor)
        block = source._block
    elif getattr(source, "_course_shown_on", None) is not None:  # set_(gpu_tensor.untyped_storage(), ...)
        block = source._course_shown_on
    elif isinstance(getattr(source, "_untyped_storage", None), torch.UntypedStorage):  # set_(gpu_tensor.storage())
        block = getattr(source._untyped_storage, "_course_shown_on", block)
    elif inner.layout is torch.strided and _storage_nbytes(inner) > block.nbytes:  # resize_ grew it
        block = emu.memory.allocate(device, _storage_nbytes(inner), block.ready_ns)
    with torch._C.DisableTorchFunction():
        torch.Tensor.data.__set__(tensor, EmulatedTensor(inner, device, block))
    tensor._block = block


def _finish_one(emu, func, info, device, tensors, emulated, args, un_args, un_kwargs, out):
    """`run_kernel`'s tail for most ops: one tensor out, on a GPU, no host scratch. The same steps as the general
    tail, without its lists and per-output tests."""
    inputs_ready_ns = 0
    for t in emulated:
        block = t._block
        if block is not None and block.ready_ns > inputs_ready_ns:
            inputs_ready_ns = block.ready_ns
    end_ns = inputs_ready_ns
    if info.no_kernel:
        emu.clock.host_advance(costs.HOST_VIEW_NS)
    else:
        nbytes = out.numel() * out.element_size()
        for t in emulated:
            nbytes += t.numel() * t.element_size()
        if info.embedding:
            nbytes -= _tensor_nbytes(args[0]) - _tensor_nbytes(out)
        if info.overwrites_first and isinstance(args[0], EmulatedTensor):
            nbytes -= _tensor_nbytes(args[0])
        end_ns = _charge_kernel(emu, func, info, device, un_args, un_kwargs, out, nbytes, out.dtype, inputs_ready_ns)
    for same in emulated:
        if same._inner is out:  # in-place or out=: the same tensor comes back
            return _given_back(emu, info, same, out, args, device, end_ns)
    if info.returns_view and emulated:
        return _view_of(out, device, emulated[0])
    return EmulatedTensor(out, device, emu.memory.allocate(device, _storage_nbytes(out), end_ns))


def _given_back(emu, info, same: EmulatedTensor, out: torch.Tensor, args, device: int, end_ns: int) -> EmulatedTensor:
    """An in-place or out= op's own tensor, back from it: with its data's new shape if the op restrided it or resized
    an out= tensor of the wrong shape, and ready when the op ends."""
    if info.restrides or (out.layout is torch.strided and (out.shape != same.shape or out.stride() != same.stride())):
        _follow_new_metadata(emu, same, args if info.restrides else (), device)
    same._block.ready_ns = max(same._block.ready_ns, end_ns)
    return same


_inference_mode_enabled = torch._C.is_inference_mode_enabled
_deterministic = torch.are_deterministic_algorithms_enabled


def _view_of(view: torch.Tensor, device: int, base: EmulatedTensor) -> EmulatedTensor:
    """A view shares its base's memory. Under inference_mode a view of a normal tensor is a normal tensor (autograd
    gives it the base's version counter, which an inference tensor cannot take), so its wrapper is made as one."""
    if _inference_mode_enabled() and not base.is_inference():
        with torch.inference_mode(False):
            return EmulatedTensor(view, device, base._block)
    return EmulatedTensor(view, device, base._block)


def _storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a new result holds: its storage, or a sparse tensor's parts (`nn.Embedding(sparse=True)`'s gradient, a
    pruned weight's `to_sparse_csr()`)."""
    if tensor.layout is torch.strided:
        return tensor.untyped_storage().nbytes()
    return sum(_storage_nbytes(part) for part in sparse_parts(tensor))


def _suggests(tensor: torch.Tensor, memory_format) -> bool:
    return tensor.is_contiguous(memory_format=memory_format) and not tensor.is_contiguous()


def _memory_format_like_cudnn(func, out, args):
    """A convolution's results (forward and backward) in the layout cuDNN gives them, which its callers'
    `cudnn_conv_suggest_memory_format` picks (aten/src/ATen/native/ConvUtils.h): channels-last (3d) when the weight
    has 4 (5) dims and it or the image is channels-last, never for float64 or complex128 (cuDNN's NHWC is off for
    double), else channels-first. The CPU's kernels choose otherwise (a float64 channels-last image gives a
    channels-last result there; a shape-only run, channels-first), and strides are a program's to read."""
    image, weight = (args[1], args[2]) if func._overloadpacket is torch.ops.aten.convolution_backward else args[:2]
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(weight.dim())
    if image.dtype in (torch.float64, torch.complex128) or layout is None or not (
            _suggests(image, layout) or _suggests(weight, layout)):
        layout = torch.contiguous_format
    fix = lambda o: o.contiguous(memory_format=layout) if isinstance(o, torch.Tensor) and o.dim() == weight.dim() else o
    return type(out)(fix(o) for o in out) if isinstance(out, (tuple, list)) else fix(out)


def _traced_convolution(emu, args):
    """`convolution` under torch.jit.trace. PyTorch's tracer does not record `convolution` itself but the
    `_convolution` its kernel calls, and an emulated tensor's kernel runs below the tracer (which sees none of its
    ops): the trace failed, or held the result as a constant. So `_convolution` runs, and is recorded here as the
    tracer records it on a GPU."""
    cudnn = torch.backends.cudnn
    args = tuple(args) + (cudnn.benchmark, cudnn.deterministic or _deterministic(), cudnn.enabled, cudnn.allow_tf32)
    out = run_kernel(emu, torch.ops.aten._convolution.default, args, {})
    graph = torch._C._get_tracing_state().graph()
    node = graph.create("aten::_convolution", [
        torch._C._get_value_trace(v) if isinstance(v, torch.Tensor) else graph.insertConstant(v) for v in args], 1)
    graph.insertNode(node)
    node.output().inferTypeFrom(out)
    torch._C._set_value_trace(out, node.output())
    return out


def _to_copy_target(emu, asked, source: int | None) -> int | None:
    """The device a `_to_copy` below the torch API moves to, if it moves. A CUDA device there was named by a program
    or a handler. "cpu" there is what C++ read off an emulated tensor's wrapper when it meant "where it is"
    (`to(dtype)`, `as_tensor`, autograd's ToCopyBackward pass `self.options()`), so it moves only inside a move to the
    host made through the dispatcher (transfers._dispatched_move)."""
    kind = "cuda" if isinstance(asked, int) else torch.device(asked).type
    if kind == "cuda":
        target = parse_device(asked, emu)
    elif kind == "cpu" and moving_to_host():
        target = CPU
    else:  # "cpu" or, in shape-only mode, "meta": the wrapper's device, read by C++
        return None
    return target if target != (CPU if source is None else source) else None


def _asked_device(emu, device: int | None, kwargs: dict) -> tuple[int | None, dict]:
    """An op given a GPU as `device=` below the torch API (`zeros_like(x, device="cuda:1")` in a program's handler or
    dispatch mode): its result goes there, made by the host's kernel. "cpu" there means where the inputs are (see
    `_to_copy_target`)."""
    asked = kwargs["device"]
    if isinstance(asked, int) or torch.device(asked).type == "cuda":
        return parse_device(asked, emu), {**kwargs, "device": torch.device("cpu")}
    return device, kwargs


def _to_copy_across(emu, tensor, target: int, kwargs):
    """`_to_copy` to another device, reached below the torch API: from a program's `__torch_dispatch__` (a wrapper
    subclass's `.cpu()` or `.to("cuda:1")` hands its inner tensor on so), a dispatch mode, autograd's
    ToCopyBackward. The CPU kernel would make a host tensor that the tail above then called the GPU's; here the
    dtype and layout change on the source device, and the copy is the emulator's, timed on the link."""
    rest = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")}
    converted = run_kernel(emu, _TO_COPY, (tensor,), rest) if rest else tensor
    return _raw_move(converted, target, bool(kwargs.get("non_blocking")))


def _crosses_devices(tensors) -> bool:
    devices = {t._device_index if isinstance(t, EmulatedTensor) else CPU for t in tensors[:2]}
    return len(devices) > 1


_TERMS_BY_SHAPE: dict = {}


def _shape_key(value):
    """The arguments with each tensor replaced by its shape, hashable (lists become tuples)."""
    if type(value) in (list, tuple):
        return tuple([v.shape if isinstance(v, torch.Tensor) else _shape_key(v) for v in value])
    return value.shape if isinstance(value, torch.Tensor) else value


def _matmul_terms(func, args, kwargs, out) -> tuple[int, tuple[int, int, int, int] | None]:
    """FLOPs and GEMM shape of a tensor-core op. Both depend on shapes only, and a training loop repeats the same
    shapes: work each out once."""
    key = (func._op, _shape_key(args))  # the C++ operator hashes in C
    if kwargs:
        key += (_shape_key(tuple(sorted(kwargs.items()))),)
    try:
        return _TERMS_BY_SHAPE[key]
    except KeyError:
        terms = _TERMS_BY_SHAPE[key] = (costs.op_flops(func, args, kwargs, out),
                                        costs.gemm_shape(func, args, kwargs, out))
        return terms
    except TypeError:  # an unhashable argument: work them out every time
        return costs.op_flops(func, args, kwargs, out), costs.gemm_shape(func, args, kwargs, out)


def _charge_kernel(emu, func, info, device, args, kwargs, out, nbytes, dtype, inputs_ready_ns) -> int:
    """Roofline cost of the op (`nbytes` in and out, `dtype` its first output's) on the preset GPU, queued on the
    device's current stream.

    A training loop repeats the same kernels, so each distinct cost is worked out once per emulator (a GEMM's
    shape efficiency tries every tile)."""
    if not (info.tensor_cores or info.cudnn):  # most kernels: no FLOP term, their bytes set the time
        duration = emu.kernel_ns_cache.get((nbytes, dtype))
        if duration is None:
            duration = emu.kernel_ns_cache[(nbytes, dtype)] = costs.kernel_ns(emu.gpu, 0, nbytes, dtype, False, False)
        return emu.clock.launch("kernel", info.name, device, emu.current_stream_id(device), duration,
                                inputs_ready_ns, (), 0, nbytes)
    flops, allow_tf32, gemm = 0, False, None
    if info.tensor_cores:
        flops, gemm = _matmul_terms(func, args, kwargs, out)
        dtype = costs.operand_dtype(func, args, dtype)
        if dtype is torch.float32:  # what torch.backends.cudnn.allow_tf32 / .cuda.matmul.allow_tf32 read
            allow_tf32 = torch._C._get_cudnn_allow_tf32() if info.cudnn else torch._C._get_cublas_allow_tf32()
    channels_last = True
    if info.cudnn:
        image = args[1] if func._overloadpacket is torch.ops.aten.convolution_backward else args[0]
        channels_last = image.dim() != 4 or image.is_contiguous(memory_format=torch.channels_last)
    key = (flops, nbytes, dtype, info.tensor_cores, allow_tf32, gemm, info.cudnn, channels_last)
    duration = emu.kernel_ns_cache.get(key)
    if duration is None:
        if allow_tf32 and not info.cudnn and emu.gpu.peak_tflops["tf32"] > emu.gpu.peak_tflops["fp32"]:
            _note_tf32_not_applied()
        duration = emu.kernel_ns_cache[key] = costs.kernel_ns(emu.gpu, flops, nbytes, dtype, info.tensor_cores,
                                                              allow_tf32, gemm, info.cudnn, channels_last)
    return emu.clock.launch("kernel", info.name, device, emu.current_stream_id(device), duration, inputs_ready_ns,
                            (), flops, nbytes)


def _note_tf32_not_applied():
    """TF32 is timed, not applied: the numbers stay the CPU's full float32, where a GPU with TF32 tensor cores
    rounds the inputs to 10 mantissa bits (NVIDIA A100 Tensor Core GPU Architecture whitepaper, "TF32"). Said for
    matmuls, where a program asked for TF32, and not for convolutions, where cuDNN allows it by default (the README
    says so); Python shows it once (one warning location)."""
    warnings.warn("TF32 is allowed (torch.backends.cuda.matmul.allow_tf32 or set_float32_matmul_precision): the GPU "
                  "emulator times float32 matmuls at the TF32 tensor-core rate but computes them in full float32, as "
                  "the CPU does; a GPU's TF32 results differ from these by up to about 1e-3 relative.", stacklevel=2)
