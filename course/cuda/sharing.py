"""GPU tensors handed to other processes by torch.multiprocessing: the same memory on both sides, as CUDA IPC gives.

On a GPU, a CUDA tensor put on a `mp.Queue` or passed to `mp.Process` is not copied: the other process opens
the same device memory (torch/multiprocessing/reductions.py, `reduce_tensor`), so Hogwild-style workers train
one set of parameters. An emulated tensor's values are its inner CPU tensor, so that is moved to shared memory
and sent instead; the receiving process, emulating too, wraps it on the same GPU. (`share_memory_()` and
`is_shared()` answer as for CUDA tensors through their storage, course/cuda/storages.py.)
A forked child may not use CUDA once its parent has (`torch.cuda._lazy_init`'s "Cannot re-initialize CUDA in
forked subprocess"): here it would compute on private copies the parent never sees, so it gets that error. The
children of multiprocessing's fork server (the "forkserver" start method) are the exception: the server is a fresh
Python that never uses CUDA itself, so on a GPU box they may, and here they go on emulating the machine it started.
"""
from __future__ import annotations

import os
import sys
from multiprocessing.reduction import ForkingPickler

import torch

from course.cuda import devices, storages
from course.cuda.devices import CPU, EmulatedTensor, wrap


def _reduce_shared(tensor: EmulatedTensor):
    """What torch.multiprocessing sends for an emulated tensor: its values in shared memory, and its device."""
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not support "
            "crossing process boundaries.  If you just want to transfer the data, call detach() on the tensor "
            "before serializing (e.g., putting it on the queue).")
    inner = tensor._inner
    storages.shown_as_host(inner.untyped_storage())  # its values are a CPU storage, shared as one
    if not inner.is_shared():
        inner.share_memory_()  # in place: the sender's tensor and its views now live in shared memory
    return _rebuild_shared, (inner, tensor._device_index, tensor.requires_grad,
                             getattr(tensor, "_is_param", False))


def _rebuild_shared(inner: torch.Tensor, device_index: int, requires_grad: bool, is_param: bool):
    """In the receiving process: the shared values, on the sender's GPU. They were allocated by the sender, so
    they add nothing to this process's allocator counts (as memory opened through CUDA IPC)."""
    emu = devices.active
    if emu is None or device_index == CPU:
        raise RuntimeError(
            "A tensor on an emulated GPU was sent to a process that does not emulate GPUs: start it with the "
            "emulator running (python -m course ..., or torch.multiprocessing from inside course.emulate).")
    tensor = wrap(inner, device_index, emu.memory.allocate(device_index, 0), requires_grad)
    if is_param:
        tensor._is_param = True
    return tensor


ForkingPickler.register(EmulatedTensor, _reduce_shared)


def _forked_child_has_no_cuda() -> None:
    if devices.active is not None and not _FORK_SERVER:
        devices.active, devices.forked_from_emulator = None, True


# The command multiprocessing.forkserver starts its server with (ForkServer.ensure_running); its children keep it.
_FORK_SERVER = "".join(sys.orig_argv[-1:]).startswith("from multiprocessing.forkserver import main")


def in_bad_fork() -> bool:
    """`torch.cuda._is_in_bad_fork`: True in a child forked from an emulating process (torch.manual_seed, run by
    DataLoader workers, then leaves the GPUs' generators alone, as it does on a GPU)."""
    return devices.forked_from_emulator


os.register_at_fork(after_in_child=_forked_child_has_no_cuda)
