"""Run a function as every rank of a real torch.distributed job: as threads (notebook-friendly) or processes.

`run_threads` keeps all ranks in this process, so a function defined in a notebook cell works as is;
`run_processes` starts one Python process per rank with gloo, as `torchrun` would. Both create the
process group before calling `fn(rank, world_size, *args)`, destroy it afterwards, return the results
in rank order, and turn a failing or stuck rank into one error that names it.
"""
from __future__ import annotations

import datetime
import gc
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from course.cuda import rank_rng


class RankFailed(RuntimeError):
    """A rank raised an exception or died; the message names the rank and carries its traceback."""


def default_backend() -> str:
    """NCCL when this machine has real CUDA GPUs, otherwise gloo (CPU, and the course's emulated GPUs)."""
    from course.cuda import devices

    if devices.active is None and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def free_port() -> int:
    """A TCP port nobody listens on right now: ask the OS for one instead of hard-coding 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- ranks as threads ---------------------------------------------------------------------------------
# All use of torch's testing-only threaded process group is in this section; tests/test_ranks.py
# checks it still works after a torch upgrade.
_threads_lock = threading.Lock()


def _threaded_pg():
    """The testing module, after touching every name run_threads uses: a torch upgrade that renames one
    fails here with advice, not halfway through a run."""
    try:
        from torch.testing._internal.distributed import multi_threaded_pg
        multi_threaded_pg._install_threaded_pg, multi_threaded_pg._uninstall_threaded_pg
        multi_threaded_pg.ProcessLocalGroup.exception_handle, multi_threaded_pg.ProcessLocalGroup.reset
        torch._C._distributed_c10d._set_thread_isolation_mode
    except (ImportError, AttributeError) as error:
        raise RuntimeError(
            f"run_threads relies on torch's testing-only threaded process group, which this torch "
            f"{torch.__version__} no longer provides as expected ({error}). Use run_processes instead, "
            "with the rank function defined in a .py module."
        ) from error
    return multi_threaded_pg


def run_threads(fn, world_size: int, *args, timeout_s: float = 60, backend: str = "threaded",
                pg_timeout_s: float | list[float] | None = None):
    """Run `fn(rank, world_size, *args)` in one thread per rank, on torch's "threaded" process group.

    Collectives are real torch.distributed calls (DistributedDataParallel works), but the threaded
    group has no point-to-point send/recv. Inside `course.emulate(...)`, `backend="nccl"` gives the
    ranks the emulated NCCL instead (send/recv included, every collective on the simulated clock), and
    each rank thread runs on the emulated GPUs. A rank that raises wakes the others out of their
    collectives, and its exception is raised here as RankFailed. `pg_timeout_s` (default `timeout_s`) is
    the process group's own timeout, `init_process_group(timeout=...)`: set it shorter than `timeout_s` to
    see the error a collective raises when a peer never joins it (gloo and NCCL honour it; "threaded" does not);
    a list gives each rank its own, so which rank gives up first does not depend on the machine's load.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be 1 or more; got {world_size}")
    if not _threads_lock.acquire(blocking=False):
        raise RuntimeError("run_threads is already running in this process; wait for it to return first.")
    mtpg = _threaded_pg()
    freezing = gc.get_freeze_count() == 0  # unless the program froze objects itself
    if freezing:
        gc.freeze()  # what lives now is not the ranks' garbage: the collection below need not scan it (see there)
    results: list = [None] * world_size
    failures: list[tuple[int, BaseException, str]] = []
    store = dist.HashStore()
    generators = [rank_rng.fork() for _ in range(world_size)]  # each starts where this thread's is, as a fork does

    def rank_main(rank: int) -> None:
        try:
            seconds = pg_timeout_s[rank] if isinstance(pg_timeout_s, (list, tuple)) else pg_timeout_s or timeout_s
            dist.init_process_group(backend, rank=rank, world_size=world_size, store=store,
                                    timeout=datetime.timedelta(seconds=seconds))
            with rank_rng.rank_thread(generators[rank]):  # its own generators (torch, random, NumPy), as a process has
                results[rank] = fn(rank, world_size, *args)
        except SystemExit:  # woken out of a collective because another rank failed
            pass
        except BaseException as error:
            failures.append((rank, error, traceback.format_exc()))
            mtpg.ProcessLocalGroup.exception_handle(error)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    try:
        threads = [_rank_thread(rank_main, r) for r in range(world_size)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
        if stuck:
            mtpg.ProcessLocalGroup.exception_handle(TimeoutError())
            for thread in threads:
                thread.join(5)
    finally:
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        # The ranks' process groups sit in reference cycles (DeviceMesh, FSDP's state, DDP's reducer) that only the
        # cycle collector frees; each holds gloo threads. A notebook calling run_threads a few times would pile up
        # hundreds of them, and their stacks exhaust a memory-limited kernel (the grading sandbox) long before RAM.
        # Only what was made during the run is scanned: a full collection of a kernel that has imported torch and
        # matplotlib takes about 0.2 s, which was most of the time of a cell calling run_threads a dozen times.
        gc.collect()
        if freezing:
            gc.unfreeze()
        _threads_lock.release()
    if failures:
        rank, error, trace = failures[0]
        hint = ""
        if "No backend type associated" in str(error):
            hint = ("\nThe threaded process group has collectives only, no point-to-point send/recv: "
                    "run this with run_processes (the function in a .py module).\n")
        raise RankFailed(f"rank {rank} of {world_size} failed with {type(error).__name__}: {error}\n{hint}\n"
                         f"Traceback in rank {rank}:\n{trace}") from error
    if stuck:
        raise TimeoutError(
            f"rank(s) {stuck} of {world_size} did not finish within timeout_s={timeout_s} s. Usually one "
            "rank waits in a collective (all_reduce, DDP backward, ...) that another rank never calls.")
    return results


def _rank_thread(target, rank: int) -> threading.Thread:
    """A rank's thread; started while an emulator runs, it runs inside it (course/cuda/emulator.py, THREAD_PATCHES),
    so the rank can use its GPUs, starting on device 0 as a fresh process does."""
    return threading.Thread(target=target, args=(rank,), name=f"rank {rank}", daemon=True)


# -- ranks as processes ---------------------------------------------------------------------------
def _check_importable(fn, args) -> None:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or "<" in name:
        raise ValueError(
            f"run_processes starts fresh Python processes, which can only import functions defined at "
            f"the top level of a .py module; {name or fn!r} is defined in {module or 'no module'} "
            "(a notebook cell, a script's __main__ or inside another function). Move it into a .py file "
            "next to the notebook and import it from there, or use run_threads, which accepts it as is.")
    try:
        pickle.dumps((fn, args))
    except Exception as error:
        raise ValueError(f"run_processes must send fn and its arguments to each rank by pickle, and "
                         f"pickling failed: {error}. Pass tensors, numbers, lists and module-level "
                         "functions or classes only.") from error


def _stream(pipe, rank: int, out, tail: list[str]) -> None:
    """Copy one rank's output line by line to ours with a [rank i] prefix, keeping the last lines."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        tail.append(line)
        del tail[:-40]
        print(f"[rank {rank}] {line}", file=out, flush=True)
    pipe.close()


def run_processes(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120):
    """Run `fn(rank, world_size, *args)` in one new Python process per rank, like torchrun does.

    Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT; its
    stdout and stderr appear here prefixed with [rank i]. When one rank fails the others are stopped.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be 1 or more; got {world_size}")
    _check_importable(fn, args)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="course-ranks-") as tmp:
        job = Path(tmp) / "job.pkl"
        job.write_bytes(pickle.dumps((fn, args, backend, timeout_s)))
        python_path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        procs, streams, tails = [], [], []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PYTHONPATH=python_path, PYTHONUNBUFFERED="1")
            command = [sys.executable, "-c", "import sys; from course.lessons.ranks import _child_main; "
                       "_child_main(*sys.argv[1:])", str(job), str(Path(tmp) / f"{rank}.pkl")]
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            tails.append([])
            for pipe, out in ((procs[-1].stdout, sys.stdout), (procs[-1].stderr, sys.stderr)):
                streams.append(threading.Thread(target=_stream, args=(pipe, rank, out, tails[-1]), daemon=True))
                streams[-1].start()
        timed_out = _wait_all(procs, timeout_s)
        for thread in streams:
            thread.join(5)
        outcomes = [_outcome(Path(tmp) / f"{rank}.pkl", proc) for rank, proc in enumerate(procs)]
    errors = sorted((o[1], rank, o[2]) for rank, o in enumerate(outcomes) if o[0] == "error")
    if errors:
        _, rank, trace = errors[0]
        raise RankFailed(f"rank {rank} of {world_size} failed; the other ranks were stopped.\n\n"
                         f"Traceback in rank {rank}:\n{trace}")
    died = [(rank, proc.returncode) for rank, proc in enumerate(procs) if outcomes[rank][0] != "ok"]
    if died and not timed_out:
        rank, code = died[0]
        raise RankFailed(f"rank {rank} of {world_size} died with exit code {code} before returning; its last "
                         "output:\n" + "\n".join(tails[rank]))
    if died:
        raise TimeoutError(
            f"rank(s) {[r for r, _ in died]} of {world_size} did not finish within timeout_s={timeout_s} s "
            "and were stopped. Usually one rank waits in a collective that another rank never calls.")
    return [o[1] for o in outcomes]


def _outcome(path: Path, proc):
    """("ok", result) or ("error", time it failed, traceback) as the rank saved it, or ("none",)."""
    return pickle.loads(path.read_bytes()) if proc.returncode in (0, 1) and path.exists() else ("none",)


def _wait_all(procs, timeout_s: float) -> bool:
    """Wait for every process; stop them all on the first failure or at the deadline. True if it timed out."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    timed_out = time.monotonic() > deadline
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return timed_out


def _child_main(job_path: str, result_path: str) -> None:
    """One rank of run_processes: join the process group, run fn, save its result or its traceback."""
    fn, args, backend, timeout_s = pickle.loads(Path(job_path).read_bytes())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        outcome = ("ok", fn(rank, world_size, *args))
    except Exception:
        outcome = ("error", time.time(), traceback.format_exc())
        traceback.print_exc()
    Path(result_path).write_bytes(pickle.dumps(outcome))
    if outcome[0] == "error":
        os._exit(1)  # skip destroy_process_group: it could block on peers that are still running
    dist.destroy_process_group()
