"""`torch.distributed.checkpoint.async_save` of tensors on emulated GPUs: staging them into host memory.

Before writing in the background, async_save copies every tensor of the state dict to the CPU storage by storage
(torch/distributed/checkpoint/_state_dict_stager.py, `StateDictStager._offload_tensor`, which calls
`UntypedStorage.copy_`). An emulated tensor's Python storage is a placeholder, which fails ("copy_() on an
invalid python storage"); its inner CPU tensor holds the values, so that one is staged in its place.
"""
from __future__ import annotations

import functools
import sys

from course.cuda.devices import EmulatedTensor

STAGER_MODULE = "torch.distributed.checkpoint._state_dict_stager"


def _stage_inner(original):
    @functools.wraps(original)
    def _offload_tensor(self, x, memo, non_blocking=False):
        if not isinstance(x, EmulatedTensor):
            return original(self, x, memo, non_blocking)
        staged = original(self, x._inner, memo, non_blocking)
        memo[id(x)] = staged
        return staged
    _offload_tensor.course_emulated = True
    return _offload_tensor


def patches() -> list:
    """(StateDictStager, replacements) once DCP's stager is imported and not yet patched, else nothing."""
    stager = getattr(sys.modules.get(STAGER_MODULE), "StateDictStager", None)
    if stager is None or getattr(stager._offload_tensor, "course_emulated", False):
        return []
    return [(stager, {"_offload_tensor": _stage_inner(stager._offload_tensor)})]
