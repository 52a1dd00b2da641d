"""A ring of mailboxes: runs a ring all-reduce written against `exchange(send_chunk, receive_into)` in threads.

The threaded process group of `course.lessons.ranks.run_threads` has collectives only, no point-to-point
send/recv, so the DDP notebook's ring all-reduce takes its messaging as an argument. `run_ring` gives each
rank-thread an `exchange` built on queues and logs how many numbers every message carried; the notebook
shows it, and its exercise (and the exercise's tests) run rings with it. On real processes the same
function runs with an `exchange` built from `dist.send` / `dist.recv`.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback

__all__ = ["run_ring"]


class _Stopped(BaseException):
    """Raised in a rank waiting for a message once another rank has failed: it ends quietly."""


def _learner_frames(error: BaseException) -> str:
    """The traceback of a rank's error without this module's own frames: the learner's lines, numbered."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
    return "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(error))


def run_ring(fn, tensors, timeout_s=10.0):
    """Run fn(tensors[rank], rank, n, exchange) in one thread per rank; return each rank's message sizes.

    When a rank raises, the others stop waiting at once and the error is raised here with that rank's
    traceback (the learner's code and line numbers), not after a timeout in the ranks left waiting.
    """
    world_size = len(tensors)
    mailboxes = [queue.Queue() for _ in range(world_size)]
    sent = [[] for _ in range(world_size)]
    errors = []
    failed = threading.Event()

    def rank_main(rank):
        def exchange(send_chunk, receive_into):
            sent[rank].append(send_chunk.numel())
            mailboxes[(rank + 1) % world_size].put(send_chunk.detach().clone())
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    message = mailboxes[rank].get(timeout=min(0.05, timeout_s))
                    break
                except queue.Empty:
                    if failed.is_set():
                        raise _Stopped() from None
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"rank {rank} waited {timeout_s} s for a message from rank "
                                           f"{(rank - 1) % world_size}: does every rank call exchange equally "
                                           "often?") from None
            if message.shape != receive_into.shape:
                raise ValueError(f"rank {rank} received a chunk of shape {tuple(message.shape)} into a buffer "
                                 f"of shape {tuple(receive_into.shape)}: do both ranks agree on the chunk index?")
            receive_into.copy_(message)

        try:
            fn(tensors[rank], rank, world_size, exchange)
        except _Stopped:
            pass
        except Exception as error:
            errors.append((rank, error))
            failed.set()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        rank, error = errors[0]
        raise RuntimeError(f"rank {rank}: {type(error).__name__}: {error}\n\nTraceback in rank {rank}:\n"
                           f"{_learner_frames(error)}") from None
    return sent
