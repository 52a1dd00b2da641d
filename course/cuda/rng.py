"""Random numbers on emulated GPUs: one generator, the CPU's, so seeded code gives plain CPU torch's numbers.

The model: every op on an emulated GPU runs on the CPU, so `torch.randn(..., device="cuda")`, dropout and
`init.normal_` on a fake-GPU tensor all draw from `torch.default_generator`. A real GPU has a Philox
generator per device instead, whose numbers cannot be reproduced here; drawing from the CPU one keeps
every result equal to the same program run on the CPU, which is what the course compares against.

So the "CUDA RNG state" of each emulated GPU is the CPU generator's state: `torch.cuda.default_generators[i]`
is `torch.default_generator`, and `get_rng_state`/`set_rng_state` (and their `_all` forms),
`manual_seed(_all)`, `seed(_all)`, `initial_seed` and `torch.random.fork_rng` all act on it, through
PyTorch's own `torch.cuda.random` code. Saving and restoring round-trips exactly. Two differences from a
GPU box follow, and are the price of equal numbers: `torch.cuda.manual_seed` reseeds CPU draws too, and
`set_rng_state_all` with different states per GPU leaves the last one. A state saved on a real GPU
(16 bytes: seed and offset) cannot be loaded; the error says so.

"The CPU generator" is the process's, except in rank threads (`course.run_threads`, PyTorch's threaded test world):
each of those has its own, which its CPU and GPU draws and all the calls above act on, as a rank process has
(course/cuda/rank_rng.py).

`torch.Generator(device="cuda")` is a CPU generator that reports a CUDA device, so `generator=` works
with factories on emulated GPUs and seeds reproduce.
"""
from __future__ import annotations

import torch
import torch.cuda.random

from course.cuda.devices import current_emulator, parse_device

RealGenerator = torch.Generator  # PyTorch's own class, kept before the emulator puts `Generator` below in its place


class CudaGenerator(RealGenerator):
    """A generator for an emulated GPU: a CPU generator underneath, `cuda:i` as its device."""

    def __new__(cls, index: int):
        generator = RealGenerator.__new__(cls, "cpu")
        generator._index = index
        return generator

    def __init__(self, index: int):
        pass

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._index)

    def set_state(self, new_state: torch.Tensor) -> "CudaGenerator":
        return RealGenerator.set_state(self, _checked(new_state))

    def __reduce__(self):
        return _rebuild_generator, (self._index, self.get_state())

    def __repr__(self):
        return f"<torch.Generator device=cuda:{self._index} (emulated: a CPU generator)>"


def _rebuild_generator(index: int, state: torch.Tensor) -> CudaGenerator:
    return CudaGenerator(index).set_state(state)


class _GeneratorMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, RealGenerator)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, RealGenerator)


class Generator(metaclass=_GeneratorMeta):
    """`torch.Generator` while the emulator runs: `device="cuda"` gives a `CudaGenerator`, the rest PyTorch's."""

    def __new__(cls, device="cpu"):
        if isinstance(device, int) or torch.device(device).type == "cuda":
            return CudaGenerator(parse_device(device, current_emulator("torch.Generator")))
        return RealGenerator(device)


Generator.__module__, Generator.__qualname__ = "torch", "Generator"


def _checked(state: torch.Tensor) -> torch.Tensor:
    if state.device.type != "cpu":  # an emulated tensor would pass PyTorch's own check, which sees a CPU tensor
        raise TypeError("RNG state must be a torch.ByteTensor")
    expected = torch.default_generator.get_state().numel()
    if state.numel() != expected:
        raise RuntimeError(
            f"This RNG state has {state.numel()} bytes; an emulated GPU's generator is the CPU one, whose "
            f"state has {expected} bytes (torch.cuda.get_rng_state() under course.emulate). A state saved "
            "on a real GPU (Philox seed and offset) is not modelled by the GPU emulator; reseed instead."
        )
    return state


_torch_set_rng_state = torch.cuda.random.set_rng_state


def set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    """PyTorch's `torch.cuda.set_rng_state`, after checking the state is one this model can take."""
    _torch_set_rng_state(_checked(new_state), device)


_torch_cpu_set_rng_state = torch.random.set_rng_state


def cpu_set_rng_state(new_state: torch.Tensor) -> None:
    """`torch.set_rng_state`, refusing a state on an emulated GPU as it refuses one on a real GPU."""
    if new_state.device.type != "cpu":
        raise TypeError("RNG state must be a torch.ByteTensor")
    _torch_cpu_set_rng_state(new_state)


def _emu():
    return current_emulator("torch.cuda random numbers")


# torch/cuda/random.py imported these by name; pointed at the emulator, its own code runs unchanged.
RANDOM_MODULE_PATCHES = {
    "_lazy_init": lambda: None,
    "is_initialized": lambda: True,
    "current_device": lambda: _emu().current_device(),
    "device_count": lambda: _emu().num_gpus,
    "set_rng_state": set_rng_state,
}


def patches(num_gpus: int) -> list[tuple[object, dict]]:
    """What the emulator puts in place for a machine of num_gpus GPUs."""
    return [(torch.cuda.random, RANDOM_MODULE_PATCHES),
            (torch.cuda, {"default_generators": (torch._C.default_generator,) * num_gpus,
                          "set_rng_state": set_rng_state}),
            (torch.random, {"set_rng_state": cpu_set_rng_state}),
            (torch, {"Generator": Generator, "set_rng_state": cpu_set_rng_state})]
