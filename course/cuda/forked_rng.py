"""`torch.random.fork_rng` on emulated GPUs: a GPU the fork leaves out keeps drawing from its own stream.

On a GPU box each device has its own generator. `fork_rng(devices=[0])` saves the CPU's and cuda:0's states and puts
them back at its end; a draw on cuda:1 inside it advances cuda:1's generator for good. `torch.utils.checkpoint`
recomputes a region inside such a fork, with the states of its inputs' devices set as they were at the forward
(`get_device_states` reads only the devices of the tensors passed in): dropout on another GPU inside the region draws
a new mask there, so its gradients are not those of the same model run without checkpointing. The emulated GPUs all
draw from the CPU generator (course/cuda/rng.py), which the fork restores for all of them: the recomputed mask came out
as the forward's, and what a left-out GPU drew inside the fork was drawn again after it. Here a draw on an emulated GPU
that the innermost fork leaves out comes from the stream as it stood when the fork began, and advances it; at the fork's
end that stream goes on, as the left-out GPU's generator would.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.random

from course.cuda import rank_rng

_FORK_RNG = torch.random.fork_rng  # PyTorch's own, kept before the emulator puts `fork_rng` below in its place
_local = threading.local()


class _Fork:
    """One `fork_rng` under way: the GPUs it forks, and the stream of those it leaves out."""

    __slots__ = ("gpus", "outside")

    def __init__(self, gpus: frozenset, outside: torch.Tensor):
        self.gpus, self.outside = gpus, outside


def _generator() -> torch.Generator:
    return rank_rng.current() or torch._C.default_generator


def _forked_gpus(devices, device_type) -> frozenset:
    """The emulated GPUs whose states a fork saves and restores (none when it forks another device type's)."""
    acc = torch.accelerator.current_accelerator()
    if torch.device(device_type or (acc.type if acc is not None else "cuda")).type != "cuda":
        return frozenset()
    if devices is None:
        return frozenset(range(torch.cuda.device_count()))
    return frozenset(torch.cuda._utils._get_device_index(d, optional=True) for d in devices)


@contextlib.contextmanager
def fork_rng(devices=None, enabled=True, _caller="fork_rng", _devices_kw="devices", device_type=None):
    """PyTorch's `fork_rng`, under which draws on the GPUs it does not fork go on from the stream outside it."""
    if not enabled:
        with _FORK_RNG(devices, enabled, _caller, _devices_kw, device_type):
            yield
        return
    devices = None if devices is None else list(devices)  # a generator would be read twice
    fork = _Fork(_forked_gpus(devices, device_type), _generator().get_state())
    stack = _local.__dict__.setdefault("forks", [])
    stack.append(fork)
    try:
        with _FORK_RNG(devices, enabled, _caller, _devices_kw, device_type):
            yield
    finally:
        stack.remove(fork)
        _generator().set_state(fork.outside)


def leaves_out(device: int) -> bool:
    """Whether a draw on emulated GPU `device` now is outside the innermost fork under way in this thread."""
    forks = getattr(_local, "forks", None)
    return bool(forks) and device not in forks[-1].gpus


def draw_outside(kernel, args, kwargs):
    """Run a drawing kernel on the stream outside the innermost fork (a generator passed in draws as given)."""
    if any(isinstance(a, torch.Generator) for a in (*args, *kwargs.values())):
        return kernel(*args, **kwargs)
    fork, generator = _local.forks[-1], _generator()
    inside = generator.get_state()
    generator.set_state(fork.outside)
    try:
        return kernel(*args, **kwargs)
    finally:
        fork.outside = generator.get_state()
        generator.set_state(inside)


PATCHES = [(torch.random, {"fork_rng": fork_rng})]
