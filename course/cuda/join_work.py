"""DDP under `Join` with emulated NCCL: the forward pass's work handle outlives the Python object torch drops.

With a joinable (DDP) in a `Join` context, each forward all-reduces a count of the ranks still training and hands
the work to the C++ reducer (`reducer._set_forward_pass_work_handle`), which, with
`divide_by_initial_world_size=False`, waits on it in the next backward for the gradient divisor. An emulated NCCL
work is a Python subclass of `dist.Work`; once DDP's `_pre_forward` returns, nothing in Python holds it, and the
C++ side's `wait()` no longer reaches the Python override: it waits on a base Work that never completes, and the
backward hangs. Keeping each joinable's latest work alive, as the reducer keeps its handle until the next
forward, lets the reducer's wait and `result()` reach it.
"""
from __future__ import annotations

import weakref

from torch.distributed.algorithms.join import Join

_notify_join_context = Join.notify_join_context
_latest_work: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def notify_join_context(joinable):
    work = _notify_join_context(joinable)
    if work is not None:
        _latest_work[joinable] = work
    return work


PATCHES = [(Join, {"notify_join_context": staticmethod(notify_join_context)})]
