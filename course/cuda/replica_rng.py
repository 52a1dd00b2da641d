"""DataParallel's replicas draw random numbers reproducibly, each from its own GPU's stand-in generator.

`parallel_apply` runs each replica in a thread of its own. On a GPU box replica i's dropout draws from cuda:i's
generator, which `torch.manual_seed` seeds as it seeds cuda:0, so a seeded program gives the same masks every run.
Here every emulated GPU's generator is the calling thread's CPU one (course/cuda/rng.py), so the replicas would draw
from it in whatever turn the threads take and the numbers would change from run to run. Instead each replica thread
draws from its own copy of the starter's state (course/cuda/rank_rng.py's per-thread generators), as the GPUs'
generators stand at one seed and offset when their replicas have drawn alike; afterwards the starter's generator
stands where replica 0's ended, as cuda:0's does.
"""
from __future__ import annotations

import importlib

import torch

from course.cuda import rank_rng

# The modules: `torch.nn.parallel.parallel_apply` and `.data_parallel` name the functions the package imports from
# them over their names.
_DATA_PARALLEL = importlib.import_module("torch.nn.parallel.data_parallel")
_parallel_apply = importlib.import_module("torch.nn.parallel.parallel_apply").parallel_apply


def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """PyTorch's `parallel_apply`, its replica threads each on a copy of the caller's random state."""
    if len(modules) < 2:  # one replica runs in the calling thread, on its generators
        return _parallel_apply(modules, inputs, kwargs_tup, devices)
    states = [rank_rng.fork() for _ in modules]
    with rank_rng.states_for_new_threads(states):
        outputs = _parallel_apply(modules, inputs, kwargs_tup, devices)
    (rank_rng.current() or torch._C.default_generator).set_state(states[0].torch.get_state())
    return outputs


PATCHES = [(_DATA_PARALLEL, {"parallel_apply": parallel_apply}),
           (torch.nn.parallel, {"parallel_apply": parallel_apply})]
