"""FSDP1 (`FullyShardedDataParallel`) on emulated GPUs: NO_SHARD runs; a sharding strategy stops with an error
that names what is not modelled.

Sharding a `FlatParameter` frees its storage by resizing it to zero and re-points the parameter at its shard with
`Tensor.set_` (torch/distributed/fsdp/_flat_param.py, `FlatParamHandle.shard`; each all-gather then grows and
frees storage again). An emulated tensor is a wrapper whose shape is fixed when it is made and whose Python
storage is a placeholder, so it can follow neither. Rather than fail deep inside FSDP (or, worse, keep a
parameter whose shape no longer matches its values), `shard()` says so and points at FSDP2's `fully_shard`,
which the emulator runs (course/cuda/fsdp2.py).
"""
from __future__ import annotations

import functools
import sys

from course.cuda.devices import EmulatedTensor

FLAT_PARAM_MODULE = "torch.distributed.fsdp._flat_param"


def _refuse_emulated_shard(original):
    @functools.wraps(original)
    def shard(self):
        if self.uses_sharded_strategy and isinstance(self.flat_param, EmulatedTensor):
            raise RuntimeError(
                f"FullyShardedDataParallel with sharding_strategy={self._sharding_strategy.name} is not modelled by "
                "the GPU emulator: sharding resizes the flat parameter's CUDA storage in place, which an emulated "
                "tensor cannot do. Use FSDP2 (torch.distributed.fsdp.fully_shard), which the emulator runs, or "
                "sharding_strategy=ShardingStrategy.NO_SHARD.")
        return original(self)
    shard.course_emulated = True
    return shard


def patches() -> list:
    """(FlatParamHandle, replacements) once FSDP1 is imported and not yet patched, else nothing."""
    handle = getattr(sys.modules.get(FLAT_PARAM_MODULE), "FlatParamHandle", None)
    if handle is None or getattr(handle.shard, "course_emulated", False):
        return []
    return [(handle, {"shard": _refuse_emulated_shard(handle.shard)})]
