"""Each rank thread draws from its own generator, as each rank process does.

Rank threads (`course.run_threads`, PyTorch's `MultiThreadedTestCase` under the emulator) share one process, and
PyTorch has one default CPU generator per process; an emulated GPU draws from it too (course/cuda/rng.py). Ranks
that seed and then initialise a model or use dropout would draw from it in racy turn, so their numbers could
change from run to run. Here each rank thread owns a CPU generator that stands for its process's default one:

- every draw: PyTorch tags every op that draws (`torch.Tag.nondeterministic_seeded`); those that take a
  `generator` get a kernel at a dispatch key that only rank threads include (thread-local), which passes the rank's
  generator when none is given. Composite ops that draw (dropout, LSTM's dropout, `randn`, attention's dropout)
  reach the dispatcher again for the op that draws, so C++-level draws are caught as well as Python-level ones,
  with no lock; other threads never include the key, so they pay nothing per op.
- the Python API: while rank threads run, `torch.default_generator` (also as `torch.random` sees it) and
  `torch.cuda.default_generators` are a stand-in that acts on the calling rank's generator (the process's own in
  any other thread), so `torch.manual_seed`, `torch.cuda.manual_seed(_all)`, `get/set_rng_state`, `seed`,
  `initial_seed` and `fork_rng` act on the rank's state; passed as `generator=`, the stand-in or the process's own
  default generator (`random_split`'s default) is the rank's too.
- Python's `random` and NumPy's legacy global `numpy.random` functions: stand-ins that act on the rank's own
  `random.Random` and `RandomState` while rank threads run (course/cuda/host_rngs.py).

A rank thread starts from a copy of its starter's state, as a forked process does (`mp.Process` with Linux's
default start method, `MultiProcessTestCase._fork_processes`): threads, like a fork, begin from their parent's
memory. A spawned rank process (torchrun, `mp.spawn`, `run_processes`) starts instead from a seed PyTorch draws
from the OS (aten/src/ATen/CPUGeneratorImpl.cpp, `getDefaultCPUGenerator`), so an unseeded program's numbers
differ from run to run there and no choice here could match them; inheriting keeps a notebook that seeds once at
the top reproducible. A program that seeds in each rank gives, rank by rank, the numbers it gives as rank
processes. A thread a rank thread starts while the emulator runs (a prefetching thread, DataParallel's workers;
course/cuda/emulator.py starts every thread) shares the rank's generator, as a process's threads share its
generators; without the emulator such a thread draws from the process's. The starter's own generator is never
advanced by its ranks.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch
import torch.random

from course.cuda import host_rngs

RealGenerator = torch._C.Generator  # PyTorch's own class (the emulator puts a wrapper at torch.Generator)
KEY = "TESTING_ONLY_GenericMode"  # a mode key nothing in PyTorch uses outside its C++ tests
THREADED_PG = "torch.testing._internal.distributed.multi_threaded_pg"

_local = threading.local()
# The registrations last as long as their Library objects; `ranks` rank threads run; `saved` is what the stand-ins
# replaced. (An object, not a dict: the grading guard clears its CACHES before test cells.)
_world = types.SimpleNamespace(libraries=(), ranks=0, saved=[])
_world_lock = threading.Lock()


def current() -> torch.Generator | None:
    """The calling rank thread's torch generator; None outside rank threads."""
    return getattr(_local, "generator", None)


def _draw_with_rank_generator(op, position: int | None):
    """A kernel for `op` (which takes `generator`) that gives it the rank's generator when it was given none."""
    exclude = torch._C.DispatchKeySet(KEY)

    def kernel(*args, **kwargs):
        positional = position is not None and position < len(args)
        given = args[position] if positional else kwargs.get("generator")
        # In a rank process, the default generator, `torch.default_generator` and the stand-in are all one: its own.
        # (A generator reaches a kernel as a new Python object; `_cdata` is the C++ generator's address.)
        if given is None or given._cdata in _DEFAULTS:
            if positional:
                args = args[:position] + (current(),) + args[position + 1:]
            else:
                kwargs["generator"] = current()
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return op(*args, **kwargs)
    return kernel


def _register() -> None:
    """Kernels at KEY for every op that draws from a generator, and a fallthrough for every other op (once)."""
    if _world.libraries:
        return
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, KEY)
    draws = torch.library.Library("aten", "IMPL")
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload)
            arguments = op._schema.arguments
            slots = [i for i, a in enumerate(arguments) if a.name == "generator"]
            if not slots or torch.Tag.nondeterministic_seeded not in op.tags:
                continue
            position = None if arguments[slots[0]].kwarg_only else slots[0]
            qualified = name if overload == "default" else f"{name}.{overload}"
            draws.impl(qualified, _draw_with_rank_generator(op, position), KEY)
    _world.libraries = (fallthrough, draws)


class _StandIn(RealGenerator):
    """`torch.default_generator` and `torch.cuda.default_generators[i]` while rank threads run: the calling rank's
    generator, or the process's own outside rank threads. (Passed as `generator=` outside rank threads, PyTorch
    would draw from this object's own state: the main thread waits for its ranks meanwhile.)"""

    @staticmethod
    def _target() -> torch.Generator:
        return current() or torch._C.default_generator

    def get_state(self):
        return self._target().get_state()

    def set_state(self, new_state):
        self._target().set_state(new_state)
        return self

    def manual_seed(self, seed):
        self._target().manual_seed(seed)
        return self

    def seed(self):
        return self._target().seed()

    def initial_seed(self):
        return self._target().initial_seed()

    def __repr__(self):
        return "<torch.Generator: the calling rank thread's own (course.cuda.rank_rng)>"


_stand_in = _StandIn()
_DEFAULTS = frozenset({_stand_in._cdata, torch._C.default_generator._cdata})


def _install_stand_ins() -> None:
    saved = _world.saved
    saved.append((torch.random, "default_generator", torch.random.default_generator))
    saved.append((torch, "default_generator", torch.default_generator))
    cuda_generators = torch.cuda.default_generators
    if cuda_generators and all(g is torch._C.default_generator for g in cuda_generators):  # the emulator's
        saved.append((torch.cuda, "default_generators", cuda_generators))
        torch.cuda.default_generators = (_stand_in,) * len(cuda_generators)
    torch.random.default_generator = torch.default_generator = _stand_in
    for module, name, stand_in in host_rngs.stand_ins():
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, stand_in)


def _remove_stand_ins() -> None:
    for module, name, original in reversed(_world.saved):
        setattr(module, name, original)
    _world.saved.clear()


def fork() -> types.SimpleNamespace:
    """A rank's random state, to be: a torch generator, a `random.Random` and a NumPy `RandomState`, each in the
    calling thread's current state (its rank's, else the process's)."""
    generator = RealGenerator()
    generator.set_state((current() or torch._C.default_generator).get_state())
    return types.SimpleNamespace(torch=generator, host=host_rngs.fork())


@contextlib.contextmanager
def rank_thread(state: types.SimpleNamespace):
    """Run the body as a rank whose draws and seeding act on `state` (from `fork`). In a thread that already is a
    rank (or one of a rank's threads), this changes nothing."""
    if current() is not None:
        yield
        return
    with _world_lock:
        _register()
        if _world.ranks == 0:
            _install_stand_ins()
        _world.ranks += 1
    _local.generator, _local.state = state.torch, state
    host_rngs.enter(state.host)
    torch._C._dispatch_tls_set_dispatch_key_included(KEY, True)
    try:
        yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_included(KEY, False)
        host_rngs.leave()
        _local.generator = _local.state = None
        with _world_lock:
            _world.ranks -= 1
            if _world.ranks == 0:
                _remove_stand_ins()


@contextlib.contextmanager
def states_for_new_threads(states: list[types.SimpleNamespace]):
    """The threads the calling thread starts in the body run on `states` (from `fork`), one each, in order
    (DataParallel's replicas, course/cuda/replica_rng.py)."""
    _local.queued = list(states)
    try:
        yield
    finally:
        _local.queued = None


def for_new_thread() -> types.SimpleNamespace | None:
    """The random state a thread being started now should run with: the next one `states_for_new_threads` gave; its
    starter's, if that is a rank; a fork of the process's if PyTorch's threaded world is installed (the starter is
    starting ranks, as MultiThreadedTestCase does); else None (an ordinary thread, on the process's generators)."""
    queued = getattr(_local, "queued", None)
    if queued:
        return queued.pop(0)
    if current() is not None:
        return _local.state
    module = sys.modules.get(THREADED_PG)
    if module is not None and isinstance(torch.distributed.distributed_c10d._world, module.ThreadLocalWorld):
        return fork()
    return None
