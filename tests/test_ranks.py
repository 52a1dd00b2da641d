"""Running ranks: threads on torch's threaded process group, processes on gloo, and their failures."""
import gc
import threading
import weakref
import time

import pytest
import torch
import torch.distributed as dist

import course
from course.lessons.ranks import RankFailed, default_backend, run_processes, run_threads


def all_reduce_rank_plus_one(rank, world_size):
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    print(f"hello from rank {rank} of {world_size}")
    return value.item()


def rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one cannot continue")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that has failed


def test_threaded_process_group_still_works_on_this_torch():
    """run_threads relies on torch's testing-only threaded process group: fail loudly if an upgrade broke it."""
    try:
        results = run_threads(all_reduce_rank_plus_one, 2, timeout_s=20)
    except Exception as error:
        pytest.fail(f"torch {torch.__version__} broke the threaded process group that course/lessons/ranks.py "
                    f"uses (torch.testing._internal.distributed.multi_threaded_pg): {error!r}. Fix "
                    "run_threads there; notebooks can fall back to run_processes meanwhile.")
    assert results == [3.0, 3.0]


def test_run_threads_returns_results_in_rank_order_and_can_run_again():
    expected = float(sum(range(1, 4)))
    assert run_threads(all_reduce_rank_plus_one, 3, timeout_s=20) == [expected] * 3
    assert run_threads(lambda rank, world_size: (rank, world_size), 3, timeout_s=20) == [(0, 3), (1, 3), (2, 3)]


class _Cycle:
    """An object in a reference cycle: only the cycle collector frees it, as it frees a rank's DDP reducer."""
    def __init__(self):
        self.me = self


def _make_cycles(rank, world_size, weak, before):
    weak.append(weakref.ref(_Cycle()))
    weak.append(weakref.ref(before))  # a cycle made before the run, still referenced by the caller


def test_run_threads_frees_the_ranks_cycles_and_leaves_the_collector_as_it_was():
    """The cycles the ranks made are freed when run_threads returns (only those made during the run are scanned);
    objects frozen by the program itself stay frozen."""
    collecting = gc.isenabled()
    gc.disable()  # no automatic collection may free them instead
    try:
        weak, before = [], _Cycle()
        run_threads(_make_cycles, 2, weak, before)
        assert [ref() is None for ref in weak] == [True, False, True, False]
        assert gc.get_freeze_count() == 0
        gc.freeze()
        run_threads(_make_cycles, 2, [], before)
        assert gc.get_freeze_count() > 0  # not unfrozen by run_threads
    finally:
        gc.unfreeze()
        if collecting:
            gc.enable()


def test_run_threads_failing_rank_is_named_and_the_others_do_not_hang():
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed with ValueError: rank one cannot continue"):
        run_threads(rank_one_raises, 2, timeout_s=30)
    assert time.monotonic() - started < 10
    assert run_threads(all_reduce_rank_plus_one, 2, timeout_s=20) == [3.0, 3.0]


def test_run_threads_times_out_on_a_collective_one_rank_never_calls():
    def only_rank_zero_reduces(rank, world_size):
        if rank == 0:
            dist.all_reduce(torch.ones(1))

    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] of 2 did not finish within timeout_s=1"):
        run_threads(only_rank_zero_reduces, 2, timeout_s=1)
    assert run_threads(all_reduce_rank_plus_one, 2, timeout_s=20) == [3.0, 3.0]


def test_run_threads_pg_timeout_is_the_process_groups_own():
    """pg_timeout_s reaches init_process_group: on gloo, a collective one rank skips fails after it, well before
    run_threads' own deadline, with gloo's timeout error instead of run_threads' TimeoutError. One per rank fixes
    which rank gives up first: its timeout closes the connection, and the other rank sees that instead of its own
    (with equal timeouts, which one it is depends on the machine's load)."""
    both_failed = threading.Barrier(2)

    def rank_one_skips_the_all_reduce(rank, world_size):
        try:
            if rank == 0:
                dist.all_reduce(torch.ones(1))
            else:
                dist.barrier()
        except RuntimeError as error:
            both_failed.wait()  # neither rank tears its group down before the other has its error
            return str(error)

    started = time.monotonic()
    endings = run_threads(rank_one_skips_the_all_reduce, 2, backend="gloo", pg_timeout_s=[1, 4], timeout_s=30)
    assert "Timed out waiting 1000ms" in endings[0] and "Connection closed by peer" in endings[1], endings
    assert time.monotonic() - started < 10
    assert run_threads(all_reduce_rank_plus_one, 2, backend="gloo", timeout_s=20) == [3.0, 3.0]


def test_run_threads_explains_that_send_and_recv_need_processes():
    def send_to_rank_one(rank, world_size):
        if rank == 0:
            dist.send(torch.ones(1), 1)

    with pytest.raises(RankFailed, match="run_processes"):
        run_threads(send_to_rank_one, 2, timeout_s=10)


def test_run_processes_returns_results_and_prefixes_each_rank_output(capsys):
    assert run_processes(all_reduce_rank_plus_one, 2, timeout_s=60) == [3.0, 3.0]
    output = capsys.readouterr().out
    assert "[rank 0] hello from rank 0 of 2" in output
    assert "[rank 1] hello from rank 1 of 2" in output


def test_run_processes_failing_rank_is_named_and_the_others_are_stopped():
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed.*ValueError: rank one cannot continue"):
        run_processes(rank_one_raises, 2, timeout_s=60)
    assert time.monotonic() - started < 30


def test_run_processes_refuses_functions_a_new_process_cannot_import():
    def defined_in_a_cell(rank, world_size):
        return rank

    defined_in_a_cell.__module__ = "__main__"
    defined_in_a_cell.__qualname__ = "defined_in_a_cell"
    with pytest.raises(ValueError, match=r"(?s)\.py file.*run_threads"):
        run_processes(defined_in_a_cell, 2)
    with pytest.raises(ValueError, match="run_threads"):
        run_processes(lambda rank, world_size: rank, 2)


def test_default_backend_is_gloo_without_real_gpus():
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert default_backend() == expected
    with course.emulate(gpus=2, force=True):
        assert default_backend() == "gloo"


def collectives_tour(rank, world_size, device_of):
    """Every collective of torch's threaded group, each rank on its own device (`device_of(rank)`)."""
    dev = device_of(rank)
    base = torch.arange(6.0, device=dev).reshape(2, 3) + 10 * rank
    out = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        t = base.clone()
        dist.all_reduce(t, op=op)
        out[f"all_reduce {op}"] = t
    gathered = [torch.empty(2, 3, device=dev) for _ in range(world_size)]
    dist.all_gather(gathered, base)
    out["all_gather"] = torch.stack(gathered)
    flat = torch.empty(world_size * 2, 3, device=dev)
    dist.all_gather_single(flat, base)
    out["all_gather_single"] = flat
    b = base.clone()
    dist.broadcast(b, src=1)
    out["broadcast"] = b
    rs = torch.empty(3, device=dev)
    dist.reduce_scatter(rs, list(torch.arange(3.0 * world_size, device=dev).add(rank).chunk(world_size)))
    out["reduce_scatter"] = rs
    rst = torch.empty(3, device=dev)
    dist.reduce_scatter_single(rst, torch.arange(3.0 * world_size, device=dev) * (rank + 1))
    out["reduce_scatter_single"] = rst
    a2a = torch.empty(world_size, device=dev)
    dist.all_to_all_single(a2a, torch.arange(float(world_size), device=dev) + 100 * rank)
    out["all_to_all_single"] = a2a
    devices = {name: t.device for name, t in out.items()}
    return {name: t.cpu() for name, t in out.items()}, devices


def test_threaded_group_collectives_on_emulated_gpus_give_the_cpu_values():
    """The threaded group (MultiThreadedTestCase's world) moves emulated GPU tensors with the values it gives CPU
    tensors, and each result stays on its rank's GPU."""
    expected = run_threads(collectives_tour, 3, lambda rank: torch.device("cpu"), timeout_s=60)
    with course.emulate(gpus=3) as emu:
        got = run_threads(collectives_tour, 3, lambda rank: torch.device("cuda", rank), timeout_s=60)
        copies = [e for e in emu.trace if e.kind == "copy" and e.peer is not None]
    for rank, ((values, devices), (want, _)) in enumerate(zip(got, expected)):
        assert set(devices.values()) == {torch.device("cuda", rank)}
        for name in want:
            torch.testing.assert_close(values[name], want[name], msg=name)
    assert copies  # rank 0 gathers the other ranks' tensors onto its GPU: peer copies on the timeline


def test_a_thread_drops_the_objects_torch_stashed_in_its_cpp_thread_locals_before_it_ends():
    """torch._inductor.cudagraph_trees stashes Python objects in the C++ thread-locals of the thread that imports it
    (torch._dynamo.reset() does, from FSDPTestMultiThread's rank threads, once torch.cuda.is_available()). Left to the
    thread's C++ exit, dropping them needs the GIL, and aborted the process 1 run in 12 when the main thread was
    already finalizing; a thread started under the emulator drops them while it still holds the GIL."""
    class Stashed:
        pass

    refs = []

    def stash():
        for key in ("tree_manager_containers", "tree_manager_locks"):
            obj = Stashed()
            refs.append(weakref.ref(obj))
            torch._C._stash_obj_in_tls(key, obj)

    with course.emulate(gpus=1):
        thread = threading.Thread(target=stash)
        thread.start()
        thread.join()
        assert len(refs) == 2 and all(ref() is None for ref in refs)
