"""DTensor's random ops (`torch.distributed.tensor.randn`, dropout or `init.normal_` on a DTensor) on an emulated GPU
mesh: refused with an error that names them.

On a GPU box, DTensor draws them through OffsetBasedRNGTracker (torch/distributed/tensor/_random.py): each rank moves
the offset of CUDA's Philox generator to where its shard starts, so the shards together are the full tensor's
values. The emulated GPUs draw from the CPU generator (course/cuda/rng.py), whose state has no offset to move: the
tracker failed with a bare AssertionError reading it as Philox's 16 bytes.
"""
from __future__ import annotations

import sys

from course.cuda.cuda_bindings import not_modelled

MODULE = "torch.distributed.tensor._random"


def _refuse(self, spec, generator=None):
    raise not_modelled(
        "A random op on a DTensor of an emulated GPU mesh (DTensor's OffsetBasedRNGTracker moves each rank to its "
        "shard's offset in CUDA's Philox generator, and the emulated GPUs draw from the CPU generator, which has no "
        "offset)", "draw the full tensor with plain torch ops and shard it with distribute_tensor, or run on a real GPU")


def patches() -> list[tuple[object, dict]]:
    """The tracker's region refused, once DTensor's random module is imported (else nothing)."""
    module = sys.modules.get(MODULE)
    tracker = getattr(module, "OffsetBasedRNGTracker", None)
    return [] if tracker is None else [(tracker, {"_distribute_region": _refuse})]
