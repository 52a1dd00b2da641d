"""`dist.split_group` on emulated NCCL: the sub-groups are made as `new_group` makes them.

NCCL splits a communicator (`ncclCommSplit`) when the default group is bound to a device
(`init_process_group(device_id=...)`); an emulated NCCL group has no communicator to split and leaves
`bound_device_id` unset (course/cuda/nccl.py says why), so torch's split_group would refuse with "No device
associated with the default pg". Here every rank makes each listed group with `new_group`, in the listed order, and
keeps its own: the same members, ranks and results as the split. The device binding is remembered apart, so a program
that gave no device_id still gets torch's refusal, as on a GPU box.
"""
from __future__ import annotations

import functools

import torch.distributed as dist
from torch.distributed import distributed_c10d

from course.cuda.nccl import EmulatedNCCL

_split_group = distributed_c10d.split_group
_new_process_group_helper = distributed_c10d._new_process_group_helper


@functools.wraps(_new_process_group_helper)
def new_process_group_helper(*args, **kwargs):
    pg, store = _new_process_group_helper(*args, **kwargs)
    device_id = kwargs.get("device_id")
    if isinstance(pg, EmulatedNCCL) and device_id is not None:
        pg._split_device = device_id
    return pg, store


@functools.wraps(_split_group)
def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None):
    default = distributed_c10d._get_default_group()
    if not isinstance(default, EmulatedNCCL):
        return _split_group(parent_pg, split_ranks, timeout, pg_options, group_desc, backend)
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    if getattr(default, "_split_device", None) is None:
        raise RuntimeError("No device associated with the default pg, not safe to split any process groups")
    if parent_pg is not None and parent_pg is not default:
        raise NotImplementedError("split_group of a group other than the default one is not modelled by the GPU "
                                  "emulator; make the sub-groups with dist.new_group(ranks) on every rank instead.")
    mine = None
    for ranks in split_ranks:
        group = dist.new_group(sorted(ranks), timeout=timeout, backend=backend, group_desc=group_desc)
        if default.rank() in ranks:
            mine = group
    return mine


PATCHES = [(distributed_c10d, {"split_group": split_group, "_new_process_group_helper": new_process_group_helper}),
           (dist, {"split_group": split_group})]
