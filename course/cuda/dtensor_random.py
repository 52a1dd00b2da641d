"""DTensor's random ops (`torch.distributed.tensor.randn`, dropout or `init.normal_` on a DTensor) on an emulated GPU
mesh: each shard holds its part of the draw one device makes from the same seed.

On a GPU box, DTensor draws them through OffsetBasedRNGTracker (torch/distributed/tensor/_random.py): each rank moves
the offset of CUDA's Philox generator to its shard's place (shard index x shard size), so shards differ, replicas
agree, and every rank's generator ends where the whole tensor's draw ends. The emulated GPUs draw from the CPU
generator (course/cuda/rng.py), which has no offset to move: here each rank draws the full tensor on the host and
keeps its shard, which keeps those three properties, and makes the shards the draw a single device makes from the
same seed (meta-device init of an FSDP2 model equals its init on one device; on a GPU box the values differ). The op itself still runs on the local
shard, so its time and memory are the shard's, and its values are then replaced. Drawing the full tensor costs each
rank's CPU the whole draw.
"""
from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course.cuda.devices import EmulatedTensor, current_emulator, parse_device
from course.cuda.transfers import move

MODULE = "torch.distributed.tensor._random"
_LOCK = threading.Lock()  # rank threads share the process's default generator while drawing here


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._inner if isinstance(tensor, EmulatedTensor) else tensor


class _FullDraw(TorchDispatchMode):
    """While DTensor runs a random op on its local shard: draw it for the whole tensor, keep the shard's part."""

    def __init__(self, spec, generator):
        super().__init__()
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        local_shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
        self.shape = tuple(spec.shape)
        self.part = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
        self.generator = generator

    def _full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor on the host with the local shard's values in place (dropout's input, bernoulli's p)."""
        full = torch.zeros(self.shape, dtype=local.dtype)
        full[self.part] = _host(local)
        return full

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generator = kwargs.get("generator")  # the rank's, which course/cuda/rank_rng.py passed
        first = args[0] if args else None
        meta = kwargs.get("device") == torch.device("meta") or (isinstance(first, torch.Tensor) and first.is_meta)
        if torch.Tag.nondeterministic_seeded not in func.tags or meta:  # the emulator's own steps: shapes, detach
            return func(*args, **kwargs)
        if isinstance(first, torch.Tensor) and tuple(first.shape) != self.shape:
            full_args = (self._full(first), *args[1:])
        elif isinstance(first, (list, tuple, torch.Size)):  # a factory: its size is the shard's
            full_args = (list(self.shape), *args[1:])
        else:  # already the whole tensor (replicated)
            full_args = (_host(first), *args[1:]) if isinstance(first, torch.Tensor) else args
        kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        host_kwargs = {**kwargs, "device": "cpu"} if "device" in kwargs else kwargs
        if any(a.name == "generator" for a in func._schema.arguments):
            kwargs = {**kwargs, "generator": torch._C.default_generator}
            host_kwargs = {**host_kwargs, "generator": torch._C.default_generator}
        with _LOCK, _drawing_from(self.generator or generator) as process_generator:
            start = process_generator.get_state()
            full = func(*full_args, **host_kwargs)
            after = process_generator.get_state()
            process_generator.set_state(start)
            result = func(*args, **kwargs)  # on the shard: timed, allocated and counted as the GPU's kernel
            process_generator.set_state(after)
        for out, drawn in zip(_tensors(result), _tensors(full)):
            _host(out).copy_(drawn[self.part] if tuple(drawn.shape) == self.shape and drawn.shape != out.shape
                             else drawn)
        return result


def _tensors(result) -> list[torch.Tensor]:
    return [t for t in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _drawing_from(generator):
    """The process's default generator, holding the state of the generator the op draws from (the calling rank's,
    course/cuda/rank_rng.py, or a program's, which DTensor took out of the op's arguments) while it draws: inside
    this mode's handler the rank's generator is not passed to the ops (its dispatch key is below), so the handler
    passes the process's, under a lock, and gives the state back after."""
    generator = generator or torch.default_generator
    process = torch._C.default_generator
    saved = process.get_state()
    process.set_state(generator.get_state())
    try:
        yield process
    finally:
        generator.set_state(process.get_state())
        process.set_state(saved)


@contextlib.contextmanager
def _distribute_region(self, spec, generator=None):
    """OffsetBasedRNGTracker._distribute_region on emulated GPUs: the full draw, each rank keeping its shard."""
    if not self.distribute_region_enabled:
        yield
        return
    with _FullDraw(spec, generator):
        yield


def _in_place_draw_meta(propagate):
    """ShardingPropagator's output metadata for `x.uniform_()` and the other in-place draws: `x`'s own. PyTorch finds
    it by running the op on fake tensors of the mesh's device, and uniform_'s decomposition (a copy_ between fake
    CUDA tensors) stops a CPU build's device guard."""

    def tensor_meta(self, op_schema):
        op = op_schema.op
        if torch.Tag.nondeterministic_seeded in op.tags and op._schema.name.endswith("_") and op_schema.args_schema:
            return getattr(op_schema.args_schema[0], "tensor_meta", None) or propagate(self, op_schema)
        return propagate(self, op_schema)
    tensor_meta.course_emulated = True
    return tensor_meta


def _device_state(self) -> torch.Tensor:
    """OffsetBasedRNGTracker._get_device_state: the GPU generator's state moved to the GPU with the emulator's move,
    as DTensor can first build the tracker inside an op's dispatch, below the emulator's torch-function mode, where
    `.to("cuda")` would reach the CPU build's CUDA initialisation."""
    return move(self._device_handle.get_rng_state(), parse_device(self._device, current_emulator("DTensor random")))


def patches() -> list[tuple[object, dict]]:
    """The tracker's region replaced, and in-place draws' metadata given, once DTensor's random module is imported
    and not yet patched (else nothing: the emulator calls this at every collective, and a second wrapper would wrap
    the first)."""
    module = sys.modules.get(MODULE)
    tracker = getattr(module, "OffsetBasedRNGTracker", None)
    if tracker is None:
        return []
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    if getattr(propagate, "course_emulated", False):
        return []
    return [(tracker, {"_distribute_region": _distribute_region, "_get_device_state": _device_state}),
            (ShardingPropagator, {"_propagate_tensor_meta_non_cached": _in_place_draw_meta(propagate)})]
