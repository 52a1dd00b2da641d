"""Python's `random` and NumPy's legacy `numpy.random` functions, each rank thread with its own state.

A rank process has its own Python interpreter, so its own `random` module state (`random.seed`, `random.random`,
`random.shuffle`: bound methods of one hidden `random.Random`) and its own NumPy global `RandomState`
(`np.random.seed`, `np.random.rand`, `np.random.permutation`: bound methods of `numpy.random.mtrand._rand`). Rank
threads share one interpreter, so a program that seeds them per rank and then draws would get numbers that depend on
how the threads interleave. While rank threads run, those module functions are stand-ins that act on the calling
rank's own `random.Random` and `RandomState` (the process's own outside rank threads), put back when the last rank
ends; course/cuda/rank_rng.py does the same for torch's generators, and says why a rank starts from a copy of its
starter's state. Generators a program makes itself (`random.Random(0)`, `np.random.default_rng(0)`) are its own
already; a function imported by name before ranks start (`from random import shuffle`), and libraries that read
`numpy.random.mtrand._rand` itself, still reach the process's state.
"""
from __future__ import annotations

import importlib
import random
import sys
import threading
import types

_local = threading.local()


def _numpy_random():
    """NumPy's random module if the program uses NumPy (torch imports NumPy, and NumPy loads `random` lazily)."""
    return importlib.import_module("numpy.random") if "numpy" in sys.modules else None


def _owners():
    """(module, the process's own generator, the rank's attribute in `_local`) for each module with global state."""
    owners = [(random, random._inst, "random")]
    numpy_random = _numpy_random()
    if numpy_random is not None:
        owners.append((numpy_random, numpy_random.mtrand._rand, "numpy"))
    return owners


def fork() -> types.SimpleNamespace:
    """New `random` and NumPy states, copies of the calling thread's current ones (its rank's, else the process's)."""
    states = {}
    for module, own, attribute in _owners():
        current = getattr(_local, attribute, None) or own
        fresh = random.Random() if module is random else module.RandomState()
        fresh.setstate(current.getstate()) if module is random else fresh.set_state(current.get_state())
        states[attribute] = fresh
    return types.SimpleNamespace(**states)


def _stand_in(own, attribute: str, method: str):
    """A module function that calls `method` of the calling rank's generator, or of the process's own `own`."""
    def draw(*args, **kwargs):
        return getattr(getattr(_local, attribute, None) or own, method)(*args, **kwargs)
    draw.__name__ = draw.__qualname__ = method
    draw.__doc__ = getattr(own, method).__doc__
    return draw


# numpy/random/mtrand.pyx's module functions that are not bound methods of `_rand` but call it: `seed` (its
# `_rand.seed(seed)` for the legacy MT19937), and `sample` and `ranf`, aliases of `random_sample`.
_NUMPY_FUNCTIONS = {"seed": "seed", "sample": "random_sample", "ranf": "random_sample"}


def stand_ins() -> list[tuple[object, str, object]]:
    """(module, name, stand-in) for every module function that draws from or seeds a process-wide generator."""
    found = []
    for module, own, attribute in _owners():
        for name, value in vars(module).items():
            if getattr(value, "__self__", None) is own:
                found.append((module, name, _stand_in(own, attribute, name)))
        if module is not random:
            found += [(module, name, _stand_in(own, attribute, method)) for name, method in _NUMPY_FUNCTIONS.items()]
    return found


def enter(states: types.SimpleNamespace) -> None:
    """The calling thread draws from `states` (from `fork`) from now on."""
    _local.random, _local.numpy = states.random, getattr(states, "numpy", None)


def leave() -> None:
    _local.random = _local.numpy = None
