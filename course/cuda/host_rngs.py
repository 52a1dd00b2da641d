"""Python's `random` and NumPy's legacy `numpy.random` functions, each rank thread with its own state.

A rank process has its own Python interpreter, so its own `random` module state (`random.seed`, `random.random`,
`random.shuffle`: bound methods of one hidden `random.Random`) and its own NumPy global `RandomState`
(`np.random.seed`, `np.random.rand`, `np.random.permutation`: bound methods of `numpy.random.mtrand._rand`). Rank
threads share one interpreter, so a program that seeds them per rank and then draws would get numbers that depend on
how the threads interleave. While rank threads run, those module functions are stand-ins that act on the calling
rank's own `random.Random` and `RandomState` (the process's own outside rank threads), put back when the last rank
ends; course/cuda/rank_rng.py does the same for torch's generators, and says why a rank starts from a copy of its
starter's state. Generators a program makes itself (`random.Random(0)`, `np.random.default_rng(0)`) are its own
already.

A function imported by name before ranks start (`from random import shuffle, seed`) is a bound method of the hidden
instance itself. Its Python methods (seed, getstate, setstate, shuffle, choice, randint, uniform, gauss...) end in
`super().seed()`, `self.random()` or `self.getrandbits()` (Lib/random.py), so while rank threads run the instance's
class is one with `_RankState` between `random.Random` and the C generator, which sends those to the calling
rank's generator. `random` and `getrandbits` themselves are C methods bound to the instance's own state: imported by
name before ranks start (`from random import random`), they still draw from the process's. So do NumPy's functions
imported by name (`from numpy.random import rand`: methods of a Cython RandomState drawing from its own bit
generator's C state), and libraries that read `numpy.random.mtrand._rand` itself.
"""
from __future__ import annotations

import _random
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


def _rank_generator():
    return getattr(_local, "random", None)


class _RankState(_random.Random):
    """Under random.Random's Python methods in the hidden instance's class: the C generator's calls, sent to the
    calling rank's generator (the instance's own outside rank threads)."""

    def seed(self, *args):
        return _random.Random.seed(_rank_generator() or self, *args)

    def random(self):
        return _random.Random.random(_rank_generator() or self)

    def getrandbits(self, k):
        return _random.Random.getrandbits(_rank_generator() or self, k)

    def getstate(self):
        return _random.Random.getstate(_rank_generator() or self)

    def setstate(self, state):
        return _random.Random.setstate(_rank_generator() or self, state)


def _gauss_next(self):
    rank = _rank_generator()
    return rank.gauss_next if rank is not None else vars(self).get("gauss_next")


def _set_gauss_next(self, value):
    vars(_rank_generator() or self)["gauss_next"] = value


class _SharedRandom(random.Random, _RankState):
    """`random._inst`'s class while rank threads run; `gauss()` keeps its second value in the rank's generator."""

    gauss_next = property(_gauss_next, _set_gauss_next)


# numpy/random/mtrand.pyx's module functions that are not bound methods of `_rand` but call it: `seed` (its
# `_rand.seed(seed)` for the legacy MT19937), and `sample` and `ranf`, aliases of `random_sample`.
_NUMPY_FUNCTIONS = {"seed": "seed", "sample": "random_sample", "ranf": "random_sample"}


def stand_ins() -> list[tuple[object, str, object]]:
    """(module, name, stand-in) for every module function that draws from or seeds a process-wide generator, and
    the hidden `random.Random`'s class."""
    found = [(random._inst, "__class__", _SharedRandom)] if type(random._inst) is random.Random else []
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
