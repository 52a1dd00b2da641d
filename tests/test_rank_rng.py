"""Each rank thread owns its random-number state, as each rank process does (course/cuda/rank_rng.py)."""
import random
import threading
from random import choice, gauss, getstate, randint, sample, seed, setstate, shuffle, uniform

import numpy as np
import pytest

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import course
from course.cuda import rank_rng
from course.lessons.ranks import run_processes, run_threads


def seeded_training_draws(rank, world_size):
    """What a DDP-style rank draws after seeding: model init, dropout (also inside LSTM and attention), the
    factories, the GPU's seed and state, fork_rng, a saved state put back, and the default generator by name."""
    torch.manual_seed(100 + rank)
    dist.all_reduce(torch.zeros(1))  # every rank has seeded before any draws
    device = f"cuda:{rank}"
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)).to(device)
    lstm = nn.LSTM(4, 4, num_layers=2, dropout=0.5).to(device)
    hidden = model(torch.randn(5, 8, device=device))
    out, _ = lstm(hidden.unsqueeze(1))
    attention = F.scaled_dot_product_attention(*(torch.randn(1, 2, 4, 8, device=device) for _ in range(3)),
                                               dropout_p=0.3)
    torch.cuda.manual_seed(7 + rank)
    on_gpu = torch.randn(3, device=device)
    state = torch.cuda.get_rng_state()
    first = torch.rand(2, device=device)
    torch.cuda.set_rng_state(state)
    again = torch.rand(2, device=device)
    with torch.random.fork_rng(devices=[]):
        torch.rand(3)
    others = [torch.randperm(7), torch.multinomial(torch.ones(5), 3), torch.rand(3).bernoulli(),
              torch.randint(0, 9, (4,)), torch.empty(3).normal_(), nn.init.kaiming_uniform_(torch.empty(2, 2)),
              torch.rand(2, generator=torch.default_generator)]
    torch.default_generator.manual_seed(11 + rank)
    split = torch.utils.data.random_split(range(6), [3, 3])  # its default generator= is torch's default generator
    tensors = [*model.state_dict().values(), *lstm.state_dict().values(), hidden, out, attention, on_gpu, first,
               again, *others]
    return [t.detach().cpu().tolist() for t in tensors] + [torch.initial_seed(), [list(part) for part in split]]


def test_seeded_rank_threads_give_the_same_numbers_every_run_and_as_rank_processes(as_processes):
    with course.emulate(gpus=2):
        process_state = torch.get_rng_state()
        runs = [run_threads(seeded_training_draws, 2) for _ in range(5)]
        assert torch.equal(torch.get_rng_state(), process_state), "a rank thread drew from the process's generator"
    assert all(run == runs[0] for run in runs[1:])
    assert runs[0][0] != runs[0][1]  # each rank its own seed
    assert runs[0] == [draws[seeded_training_draws.__name__] for draws in as_processes]


def unseeded_draws(rank, world_size):
    return [torch.rand(3).tolist(), nn.Linear(2, 2).weight.tolist()]


def test_unseeded_ranks_start_from_their_starters_state_as_a_fork_and_leave_it_alone():
    torch.manual_seed(5)
    draws = run_threads(unseeded_draws, 2)
    torch.manual_seed(5)
    assert draws[0] == draws[1] == [torch.rand(3).tolist(), nn.Linear(2, 2).weight.tolist()]


def rank_and_helper_thread(rank, world_size):
    """A rank seeds, then a thread it starts draws: that thread shares the rank's generator, as in a process."""
    torch.manual_seed(rank)
    drawn = []
    helper = threading.Thread(target=lambda: drawn.append(torch.rand(2).tolist()))
    helper.start()
    helper.join()
    return drawn[0]


def test_a_thread_a_rank_starts_shares_the_ranks_generator():
    with course.emulate(gpus=2):
        draws = run_threads(rank_and_helper_thread, 2)
    assert draws == [torch.rand(2, generator=torch.Generator().manual_seed(r)).tolist() for r in range(2)]


def test_outside_rank_threads_nothing_changes():
    """No key in this thread's dispatch set, and the default generators are PyTorch's own objects again."""
    run_threads(lambda rank, world_size: dist.get_rank(), 2)
    assert not torch._C._dispatch_tls_is_dispatch_key_included(rank_rng.KEY)
    assert torch.random.default_generator is torch.default_generator is torch._C.default_generator
    with course.emulate(gpus=2):
        run_threads(lambda rank, world_size: dist.get_rank(), 2)
        assert torch.cuda.default_generators == (torch.default_generator,) * 2


def seeded_host_draws(rank, world_size):
    """What a data pipeline's rank draws from Python's `random` and NumPy's global state after seeding them per rank
    (augmentations, shuffles, sampling), interleaved with the other ranks' draws by the collectives between them."""
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    drawn = []
    for _ in range(4):
        dist.all_reduce(torch.zeros(1))  # the ranks take turns drawing in whatever order the threads run
        order = list(range(6))
        random.shuffle(order)
        state = np.random.get_state()
        first = np.random.rand(2).tolist()
        np.random.set_state(state)
        drawn.append([random.random(), random.randint(0, 99), random.choice("abcdef"), order,
                      first, np.random.rand(2).tolist(), np.random.permutation(5).tolist(),
                      np.random.randint(0, 9, size=3).tolist(), float(np.random.normal())])
    return drawn


def test_seeded_python_and_numpy_draws_are_per_rank_as_in_rank_processes(as_processes):
    process_states = random.getstate(), np.random.get_state()[1].tolist()
    module_functions = random.random, np.random.rand
    with course.emulate(gpus=2):
        runs = [run_threads(seeded_host_draws, 2) for _ in range(5)]
    assert all(run == runs[0] for run in runs[1:])
    assert runs[0][0] != runs[0][1]  # each rank its own seed
    assert runs[0] == [draws[seeded_host_draws.__name__] for draws in as_processes]
    assert (random.getstate(), np.random.get_state()[1].tolist()) == process_states  # the process's left alone
    assert (random.random, np.random.rand) == module_functions  # put back when the ranks ended


def seeded_draws_by_imported_names(rank, world_size):
    """`seeded_host_draws` with `random`'s functions imported by name at the top of the module, before any rank
    started: bound methods of `random`'s hidden instance, not the module's attributes the ranks replace."""
    seed(100 + rank)
    drawn = []
    for _ in range(4):
        dist.all_reduce(torch.zeros(1))
        order = list(range(6))
        shuffle(order)
        state = getstate()
        first = randint(0, 99)
        setstate(state)
        drawn.append([order, first, randint(0, 99), choice("abcdef"), uniform(0, 1), gauss(0, 1), gauss(0, 1),
                      sample(range(10), 3)])
    return drawn


def test_random_functions_imported_before_the_ranks_start_are_per_rank_too(as_processes):
    process_state = random.getstate()
    with course.emulate(gpus=2):
        runs = [run_threads(seeded_draws_by_imported_names, 2) for _ in range(5)]
    assert all(run == runs[0] for run in runs[1:])
    assert runs[0][0] != runs[0][1]  # each rank its own seed
    assert runs[0] == [draws[seeded_draws_by_imported_names.__name__] for draws in as_processes]
    assert random.getstate() == process_state and type(random._inst) is random.Random  # put back


SEEDED_DRAWS = (seeded_training_draws, seeded_host_draws, seeded_draws_by_imported_names)


def all_seeded_draws(rank, world_size):
    """One job of rank processes for the three tests (each process costs seconds: it imports torch and the course):
    each draw function seeds every generator it draws from first, so what ran before it in the process is no
    matter."""
    return {draws.__name__: draws(rank, world_size) for draws in SEEDED_DRAWS}


@pytest.fixture(scope="module")
def as_processes():
    """What each rank process of an emulated two-GPU job draws, by draw function."""
    with course.emulate(gpus=2):
        return run_processes(all_seeded_draws, 2)
