"""Communication across emulated GPUs: `torch.cuda.comm`, `torch.cuda.nccl`, and so `nn.parallel`.

On a CPU build these call CUDA-only C++ (`torch._C._scatter`, `_broadcast_coalesced`, NCCL) and fail,
and `nn.DataParallel` quietly runs unsplit. While the emulator is active these versions stand in:
real values, and times from the ring alpha-beta model over the links NCCL's rings would use
(`Emulator.collective_link`).
"""
from __future__ import annotations

import torch
import torch.nn.parallel._functions

from course.cuda.devices import CPU, EmulatedTensor, current_emulator, parse_device, wrap
from course.cuda.kernels import _storage_nbytes
from course.cuda.transfers import _raw_move, charge_copy, device_of
from course.machine import costs

SUM, PROD, MIN, MAX = 0, 1, 2, 3  # torch.cuda.nccl's reduction codes
_REDUCE = {SUM: torch.Tensor.add_, PROD: torch.Tensor.mul_, MIN: torch.Tensor.clamp_max_,
           MAX: torch.Tensor.clamp_min_}


def _gpu_index(device) -> int:
    if device == "cpu" or device == -1:
        return CPU
    return parse_device(device)


def _check_collective(what: str, tensors, same_shape: bool = True) -> list[int]:
    """Devices of the tensors of one collective: one per GPU, all CUDA, matching shapes."""
    if isinstance(tensors, torch.Tensor) or not tensors:
        raise TypeError(f"{what} takes a list of tensors, one per GPU; got {type(tensors).__name__}")
    devices = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, EmulatedTensor) or tensor._device_index == CPU:
            raise RuntimeError(f"{what}: tensor {i} is on the CPU; every tensor must be on a GPU "
                               f"(move it with .to('cuda:{i}'))")
        if tensor._device_index in devices:
            raise RuntimeError(f"{what}: two tensors are on {tensor.device}; a collective takes exactly "
                               "one tensor per GPU")
        if same_shape and (tensor.shape != tensors[0].shape or tensor.dtype != tensors[0].dtype):
            raise RuntimeError(
                f"{what}: tensor {i} is {tuple(tensor.shape)} {tensor.dtype} but tensor 0 is "
                f"{tuple(tensors[0].shape)} {tensors[0].dtype}; all tensors must match")
        devices.append(tensor._device_index)
    return devices


def _collective(emu, name: str, devices: list[int], duration_ns: int, tensors, nbytes: int) -> int:
    lanes = [(d, emu.current_stream_id(d)) for d in devices]
    ready = max((t.ready_ns for t in tensors if isinstance(t, EmulatedTensor)), default=0)
    return emu.clock.launch_collective(name, lanes, duration_ns, ready, nbytes)


def _nbytes(tensor) -> int:
    return _storage_nbytes(_inner(tensor)) if tensor.is_sparse else tensor.numel() * tensor.element_size()


def _inner(tensor):
    return tensor._inner if isinstance(tensor, EmulatedTensor) else tensor


def _new_on(emu, device: int, inner: torch.Tensor, ready_ns: int):
    """Wrap a freshly computed CPU tensor as a result living on `device`."""
    if device == CPU:
        return inner
    block = emu.memory.allocate(device, _storage_nbytes(inner), ready_ns)
    return wrap(inner, device, block)


# ---- torch.cuda.comm (what nn.parallel's Broadcast, Scatter, Gather, ReduceAddCoalesced call) ----

def broadcast(tensor, devices=None, *, out=None):
    """Copies of `tensor` on every device: one NCCL-style broadcast from its GPU, or a copy from the host to each."""
    emu = current_emulator("torch.cuda.comm.broadcast")
    if out is not None:
        devices = [o.get_device() for o in out]
    devices = [_gpu_index(d) for d in devices]
    if device_of(tensor) == CPU:  # from the host, CUDA copies it to each GPU in turn
        return [_raw_move(tensor, device, non_blocking=True) if out is None else out[i].copy_(tensor)
                for i, device in enumerate(devices)]
    _check_collective("broadcast", [tensor])
    src = tensor._device_index
    end = _collective(emu, "nccl:broadcast", sorted(set(devices) | {src}),
                      costs.broadcast_ns(emu.collective_link(set(devices) | {src}), _nbytes(tensor),
                                         len(set(devices) | {src}), launches=len(set(devices) | {src})),
                      [tensor], _nbytes(tensor))
    copies = []
    for i, device in enumerate(devices):
        if out is not None:
            _inner(out[i]).copy_(_inner(tensor))
            out[i]._block.ready_ns = end
            copies.append(out[i])
        elif device == src:
            copies.append(tensor)
        else:
            copies.append(_new_on(emu, device, _inner(tensor).clone(), end))
    return copies


def broadcast_coalesced(tensors, devices, buffer_size=10485760):
    """Every tensor to every device, as one transfer of all their bytes (what `replicate` uses)."""
    emu = current_emulator("torch.cuda.comm.broadcast_coalesced")
    devices = [_gpu_index(d) for d in devices]
    if not tensors:
        return [[] for _ in devices]
    src = {t.get_device() for t in tensors}
    if len(src) != 1 or devices[0] not in src:
        raise RuntimeError("broadcast_coalesced: all tensors must be on devices[0] "
                           f"(cuda:{devices[0]}); found them on {sorted(src)}")
    nbytes = sum(_nbytes(t) for t in tensors)
    end = _collective(emu, "nccl:broadcast", devices,
                      costs.broadcast_ns(emu.collective_link(devices), nbytes, len(devices),
                                         launches=len(devices)), tensors, nbytes)
    result = [list(tensors)]
    for device in devices[1:]:
        result.append([_new_on(emu, device, _inner(t).clone(), end) for t in tensors])
    return result


def _sum(tensors) -> torch.Tensor:
    total = _inner(tensors[0]).clone()
    for tensor in tensors[1:]:
        total.add_(_inner(tensor))
    return total


def reduce_add(inputs, destination=None):
    """The sum of one tensor per GPU, landing on `destination` (NCCL reduce)."""
    return reduce_add_coalesced([[t] for t in inputs], destination, buffer_size=0)[0]


def reduce_add_coalesced(inputs, destination=None, buffer_size=10485760):
    """Per position, the sum over GPUs of per-GPU lists of tensors (DataParallel's gradient sum).

    Tensors travel in buffers of about `buffer_size` bytes, one NCCL reduce per buffer.
    """
    emu = current_emulator("torch.cuda.comm.reduce_add_coalesced")
    originals = list(zip(*inputs))
    # Autograd makes the zero gradients of replicas whose outputs went unused as plain CPU
    # tensors (their C++ device is the CPU): they add nothing and take no part in the transfer.
    positions = [[t for t in position if isinstance(t, EmulatedTensor) or t.dim() > 0 and t.any()]
                 for position in originals]
    devices = [_check_collective("reduce_add", position) for position in positions if position]
    if destination is None:
        destination = devices[0][0] if devices else torch.cuda.current_device()
    destination = _gpu_index(destination)
    lanes = sorted({d for position in devices for d in position} | ({destination} - {CPU}))
    results, group, group_bytes = {}, [], 0
    for index, position in enumerate(positions):
        if not position:  # a parameter no replica used: its gradients, and their sum, are zeros
            results[index] = _new_on(emu, destination, torch.zeros_like(_inner(originals[index][0])), 0)
            continue
        group.append(index)
        group_bytes += _nbytes(position[0])
        if group_bytes >= buffer_size or not any(positions[index + 1:]):
            end = _collective(emu, "nccl:reduce", lanes,
                              costs.broadcast_ns(emu.collective_link(lanes), group_bytes, len(lanes),
                                                 launches=len(lanes)),
                              [t for i in group for t in positions[i]], group_bytes)
            results.update((i, _new_on(emu, destination, _sum(positions[i]), end)) for i in group)
            group, group_bytes = [], 0
    return [results[i] for i in range(len(positions))]


def scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
    """Chunks of `tensor` along `dim`, one per device, each copied from where the tensor lives."""
    emu = current_emulator("torch.cuda.comm.scatter")
    if out is not None:
        devices = [o.get_device() for o in out]
        chunk_sizes = [o.size(dim) for o in out]
    devices = [_gpu_index(d) for d in devices]
    if chunk_sizes is None:
        chunks = tensor.chunk(len(devices), dim)
    else:
        if sum(chunk_sizes) != tensor.size(dim):
            raise RuntimeError(f"scatter: chunk sizes {list(chunk_sizes)} do not add up to "
                               f"{tensor.size(dim)}, the size of dimension {dim}")
        chunks = tensor.split(list(chunk_sizes), dim)
    results = []
    for i, (chunk, device) in enumerate(zip(chunks, devices)):
        moved = _raw_move(chunk.contiguous(), device, non_blocking=True) if device_of(chunk) != device \
            else chunk
        if out is not None:
            _inner(out[i]).copy_(_inner(moved))
            out[i]._block.ready_ns = moved.ready_ns
            moved = out[i]
        results.append(moved)
    return tuple(results)


def gather(tensors, dim=0, destination=None, *, out=None):
    """Concatenate per-GPU tensors on one device: each one travels there over its link."""
    emu = current_emulator("torch.cuda.comm.gather")
    _check_collective("gather", tensors, same_shape=False)
    destination = device_of(out) if out is not None else (
        emu.current_device() if destination is None else _gpu_index(destination))
    ready = 0
    for tensor in tensors:
        src = tensor._device_index
        if src != destination:
            ready = max(ready, charge_copy(emu, src, destination, _nbytes(tensor), tensor.ready_ns,
                                           non_blocking=True))
        else:
            ready = max(ready, tensor.ready_ns)
    if destination == CPU:
        emu.clock.host_wait(ready, "gather to cpu")
    joined = torch.cat([_inner(t) for t in tensors], dim)
    if out is not None:
        _inner(out).copy_(joined)
        if isinstance(out, EmulatedTensor):
            out._block.ready_ns = ready
        return out
    return _new_on(emu, destination, joined, ready)


_scatter_forward = torch.nn.parallel._functions.Scatter.forward
_scatter_backward = torch.nn.parallel._functions.Scatter.backward


def _scatter_remembering_devices(ctx, target_gpus, chunk_sizes, dim, input):
    ctx.chunk_devices = [_gpu_index(device) for device in target_gpus]
    return _scatter_forward(ctx, target_gpus, chunk_sizes, dim, input)


def _scatter_gradients_on_gpus(ctx, *grad_outputs):
    """nn.parallel's Scatter backward, after putting the zero gradients autograd makes for unused chunks on their
    GPUs: autograd makes them with the CPU device the emulated chunks have underneath, and Gather refuses CPU."""
    from course.cuda.interception import _create_on_device

    grad_outputs = [grad if grad is None or isinstance(grad, EmulatedTensor) else
                    _create_on_device(torch.zeros, device, (grad.shape,), {"dtype": grad.dtype})
                    for grad, device in zip(grad_outputs, ctx.chunk_devices)]
    return _scatter_backward(ctx, *grad_outputs)


SCATTER_PATCHES = {"forward": staticmethod(_scatter_remembering_devices),
                   "backward": staticmethod(_scatter_gradients_on_gpus)}


COMM_PATCHES = {
    "broadcast": broadcast,
    "broadcast_coalesced": broadcast_coalesced,
    "reduce_add": reduce_add,
    "reduce_add_coalesced": reduce_add_coalesced,
    "scatter": scatter,
    "gather": gather,
}


# ---- torch.cuda.nccl: in-place collectives over one tensor per GPU ----

def _reduce_values(inputs, op):
    total = _inner(inputs[0]).clone()  # a copy: the inputs are overwritten with the result
    for tensor in inputs[1:]:
        _REDUCE[op](total, _inner(tensor))
    return total


def all_reduce(inputs, outputs=None, op=SUM, streams=None, comms=None):
    """Every GPU ends with the reduction of all inputs; ring all-reduce time."""
    emu = current_emulator("torch.cuda.nccl.all_reduce")
    devices = _check_collective("all_reduce", inputs)
    outputs = inputs if outputs is None else outputs
    nbytes = _nbytes(inputs[0])
    end = _collective(emu, "nccl:all_reduce", devices,
                      costs.ring_allreduce_ns(emu.collective_link(devices), nbytes, len(devices),
                                              launches=len(devices)), inputs, nbytes)
    total = _reduce_values(inputs, op)
    for output in outputs:
        _inner(output).copy_(total)
        output._block.ready_ns = end


def reduce(inputs, output=None, root=0, op=SUM, streams=None, comms=None, *, outputs=None):
    """The reduction of all inputs lands on GPU `root` (in inputs[root], or `output`)."""
    emu = current_emulator("torch.cuda.nccl.reduce")
    devices = _check_collective("reduce", inputs)
    target = output if output is not None else (outputs[root] if outputs is not None else inputs[root])
    nbytes = _nbytes(inputs[0])
    end = _collective(emu, "nccl:reduce", devices,
                      costs.broadcast_ns(emu.collective_link(devices), nbytes, len(devices),
                                         launches=len(devices)), inputs, nbytes)
    _inner(target).copy_(_reduce_values(inputs, op))
    target._block.ready_ns = end


def nccl_broadcast(inputs, root=0, streams=None, comms=None):
    """inputs[root]'s values copied into every other input."""
    emu = current_emulator("torch.cuda.nccl.broadcast")
    devices = _check_collective("broadcast", inputs)
    nbytes = _nbytes(inputs[0])
    end = _collective(emu, "nccl:broadcast", devices,
                      costs.broadcast_ns(emu.collective_link(devices), nbytes, len(devices),
                                         launches=len(devices)), inputs, nbytes)
    for tensor in inputs:
        if tensor is not inputs[root]:
            _inner(tensor).copy_(_inner(inputs[root]))
        tensor._block.ready_ns = end


def all_gather(inputs, outputs, streams=None, comms=None):
    """Every output holds all inputs concatenated along dimension 0, in GPU order."""
    emu = current_emulator("torch.cuda.nccl.all_gather")
    devices = _check_collective("all_gather", inputs)
    _check_collective("all_gather outputs", outputs)
    nbytes = _nbytes(outputs[0])
    end = _collective(emu, "nccl:all_gather", devices,
                      costs.ring_allgather_ns(emu.collective_link(devices), nbytes, len(devices),
                                              launches=len(devices)), inputs, nbytes)
    joined = torch.cat([_inner(t).reshape(-1) for t in inputs])
    for output in outputs:
        _inner(output).copy_(joined.view_as(_inner(output)))
        output._block.ready_ns = end


def reduce_scatter(inputs, outputs, op=SUM, streams=None, comms=None):
    """Output i holds chunk i of the reduction of all inputs."""
    emu = current_emulator("torch.cuda.nccl.reduce_scatter")
    devices = _check_collective("reduce_scatter", inputs)
    _check_collective("reduce_scatter outputs", outputs)
    nbytes = _nbytes(inputs[0])
    end = _collective(emu, "nccl:reduce_scatter", devices,
                      costs.ring_reduce_scatter_ns(emu.collective_link(devices), nbytes, len(devices),
                                                   launches=len(devices)), inputs,
                      nbytes)
    chunks = _reduce_values(inputs, op).reshape(-1).chunk(len(outputs))
    for output, chunk in zip(outputs, chunks):
        _inner(output).copy_(chunk.view_as(_inner(output)))
        output._block.ready_ns = end


NCCL_PATCHES = {
    "is_available": lambda tensors: True,
    # What c10d's error logging asks for; the NCCL of torch 2.12's cu130 wheels (NVIDIA/TensorRT-LLM PR
    # #17160 requirements.txt), the nearest release our sources name. Nothing else depends on it.
    "version": lambda: (2, 29, 7),
    "all_reduce": all_reduce,
    "reduce": reduce,
    "broadcast": nccl_broadcast,
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
}
