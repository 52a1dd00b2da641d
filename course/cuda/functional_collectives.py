"""Functional collectives (`torch.ops._c10d_functional.*`) on emulated GPUs, timed like `dist.*` collectives.

DTensor (`full_tensor()`, `redistribute`, tensor parallelism) and FSDP2's state dict communicate through
these ops, not through `dist.all_gather_into_tensor` and friends. Left to the emulator's generic path, each
would run on the CPU tensors inside: the group would see plain CPU tensors (no GPU, no input ready time)
and the op itself would be charged once more as a compute kernel. The rules below, registered for
`EmulatedTensor` only, do what the C++ implementation (torch/csrc/distributed/c10d/Functional.cpp) does:
make the output (no kernel, as `at::empty`; a copy for the all-reduce family, as `clone`), call the same
collective of the process group on the emulated tensors, and let `wait_tensor` make the current stream wait
for it. With an emulated NCCL group that collective is the timed one of course/cuda/nccl.py; any other group
gets the generic path, waited for before its result is handed back.
"""
from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from course.cuda import devices, kernels
from course.cuda.devices import EmulatedTensor

_ops = torch.ops._c10d_functional
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
               "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
               "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def _reduce_op(name: str):
    try:
        return _REDUCE_OPS[name.lower()]
    except KeyError:
        raise ValueError(f"Unknown reduce_op {name!r} for a functional collective") from None


def _empty(like: EmulatedTensor, shape) -> EmulatedTensor:
    """A new tensor on `like`'s GPU: memory counted, no kernel (as at::empty on a GPU)."""
    emu = devices.current_emulator("functional collective")
    inner = torch.empty(shape, dtype=like.dtype, device=like._inner.device)
    block = emu.memory.allocate(like._device_index, inner.untyped_storage().nbytes())
    return devices.wrap(inner, like._device_index, block)


def _group(group_name):
    """The emulated NCCL group the op names, else None. While the emulator runs, torch.distributed's
    ProcessGroupNCCL is course/cuda/nccl.py's EmulatedNCCL (nccl.C10D_PATCHES), and these rules only run then."""
    group = group_name if isinstance(group_name, dist.ProcessGroup) else \
        distributed_c10d._resolve_process_group(group_name)
    return group if isinstance(group, distributed_c10d.ProcessGroupNCCL) else None


def _options(kind, reduce_op=None):
    opts = kind()
    if reduce_op is not None:
        opts.reduceOp = _reduce_op(reduce_op)
    return opts


def _all_reduce_(group, input, reduce_op):
    group.allreduce([input], _options(distributed_c10d.AllreduceOptions, reduce_op))
    return input


def _all_gather_out(group, input, group_size, out):
    group._allgather_base(out, input.contiguous(), distributed_c10d.AllgatherOptions())
    return out


def _gathered(input, group_size):
    return _empty(input, (input.size(0) * group_size, *input.shape[1:]))


def _reduce_scatter_out(group, input, reduce_op, group_size, out):
    group._reduce_scatter_base(out, input.contiguous(), _options(distributed_c10d.ReduceScatterOptions, reduce_op))
    return out


def _scattered(input, group_size):
    if input.size(0) % group_size:
        raise ValueError(f"reduce_scatter_tensor: the first dimension ({input.size(0)}) must be divisible by "
                         f"the group size ({group_size})")
    return _empty(input, (input.size(0) // group_size, *input.shape[1:]))


# Each rule: (group, args, kwargs) -> result, for args already known to hold EmulatedTensors.
_RULES = {
    _ops.all_reduce.default: lambda g, a, k: _all_reduce_(g, a[0].clone(memory_format=torch.contiguous_format),
                                                          a[1]),
    _ops.all_reduce_.default: lambda g, a, k: _all_reduce_(g, a[0], a[1]),
    _ops.all_reduce_coalesced.default: lambda g, a, k: [
        _all_reduce_(g, t.clone(memory_format=torch.contiguous_format), a[1]) for t in a[0]],
    _ops.all_reduce_coalesced_.default: lambda g, a, k: [_all_reduce_(g, t, a[1]) for t in a[0]],
    _ops.all_gather_into_tensor.default: lambda g, a, k: _all_gather_out(g, a[0], a[1], _gathered(a[0], a[1])),
    _ops.all_gather_into_tensor_out.default: lambda g, a, k: _all_gather_out(g, a[0], a[1], k["out"]),
    _ops.all_gather_into_tensor_coalesced.default: lambda g, a, k: [
        _all_gather_out(g, t, a[1], _gathered(t, a[1])) for t in a[0]],
    _ops.reduce_scatter_tensor.default: lambda g, a, k: _reduce_scatter_out(g, a[0], a[1], a[2],
                                                                            _scattered(a[0], a[2])),
    _ops.reduce_scatter_tensor_out.default: lambda g, a, k: _reduce_scatter_out(g, a[0], a[1], a[2], k["out"]),
    _ops.reduce_scatter_tensor_coalesced.default: lambda g, a, k: [
        _reduce_scatter_out(g, t, a[1], a[2], _scattered(t, a[2])) for t in a[0]],
    _ops.all_to_all_single.default: lambda g, a, k: _all_to_all(g, *a[:3]),
    _ops.broadcast.default: lambda g, a, k: _broadcast_(g, a[0].clone(memory_format=torch.contiguous_format), a[1]),
    _ops.broadcast_.default: lambda g, a, k: _broadcast_(g, a[0], a[1]),
}


def _all_to_all(group, input, output_split_sizes, input_split_sizes):
    input = input.contiguous()
    rows = sum(output_split_sizes) if output_split_sizes else input.size(0)
    out = _empty(input, (rows, *input.shape[1:]))
    group.alltoall_base(out, input, list(output_split_sizes or []), list(input_split_sizes or []),
                        distributed_c10d.AllToAllOptions())
    return out


def _broadcast_(group, input, src):
    opts = distributed_c10d.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([input], opts)
    return input


def _group_name_arg(func, args, kwargs):
    names = [a.name for a in func._schema.arguments]
    index = names.index("group_name")
    return args[index] if index < len(args) else kwargs["group_name"]


def _collective(cls, func, types, args, kwargs):
    group = _group(_group_name_arg(func, args, kwargs))
    register()
    # Not an emulated NCCL group (gloo on emulated GPUs): the generic path. Its work is registered under the CPU
    # tensor inside, which wait_tensor on the emulated one never reaches: waited for here, or the result is read
    # before gloo has written it.
    if group is None:
        out = kernels.run_kernel(devices.current_emulator(str(func)), func, args, kwargs)
        for tensor in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(tensor, EmulatedTensor):
                _ops.wait_tensor.default(tensor._inner)
        return out
    return _RULES[func](group, args, kwargs)


def _wait_tensor(cls, func, types, args, kwargs):
    """The current stream waits for the collective that wrote the tensor; the tensor itself comes back."""
    tensor = args[0]
    emu = devices.current_emulator("wait_tensor")
    device = tensor._device_index
    if device != devices.CPU:
        key = (device, emu.current_stream_id(device))
        with emu.clock.lock:
            emu.clock.stream_ready_ns[key] = max(emu.clock.stream_ready(*key), tensor.ready_ns)
    return tensor


def _wrap_tensor_autograd(cls, func, types, args, kwargs):
    """funcol's AsyncCollectiveTensor defers a wait the emulated collective does not need (its values are
    there and readers wait for its end): the same data and block, as a new tensor, as the wrapper is."""
    tensor = args[0]
    return devices.wrap(tensor._inner, tensor._device_index, tensor._block)


_registered: set = set()
_register_lock = threading.Lock()


def register() -> None:
    """Put the rules in place (once per process; they apply to EmulatedTensors only). The rule for
    `_wrap_tensor_autograd` waits until torch.distributed._functional_collectives is imported: that op is
    defined there, and importing it (with DTensor) costs about a second no program should pay unasked."""
    with _register_lock:  # rank threads create their process groups at the same time
        if "c10d" not in _registered:
            for func in _RULES:
                torch.library.register_torch_dispatch(func, EmulatedTensor, _collective)
            torch.library.register_torch_dispatch(_ops.wait_tensor.default, EmulatedTensor, _wait_tensor)
            _registered.add("c10d")
        # another rank thread may be importing the module right now, before it has defined the op: the next
        # call (every group creation and collective makes one) registers it
        if "wrap" not in _registered and "torch.distributed._functional_collectives" in sys.modules \
                and hasattr(_ops, "_wrap_tensor_autograd"):
            torch.library.register_torch_dispatch(_ops._wrap_tensor_autograd.default, EmulatedTensor,
                                                  _wrap_tensor_autograd)
            _registered.add("wrap")
