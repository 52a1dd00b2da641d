"""A ring of mailboxes: runs a ring all-reduce written against `exchange(send_chunk, receive_into)` in threads.

The threaded process group of `course.ranks.run_threads` has collectives only, no point-to-point
send/recv, so the DDP notebook's ring all-reduce takes its messaging as an argument. `run_ring` gives each
rank-thread an `exchange` built on queues and logs how many numbers every message carried; the notebook
shows it, and its exercise (and the exercise's tests) run rings with it. On real processes the same
function runs with an `exchange` built from `dist.send` / `dist.recv`.
"""
from __future__ import annotations

import queue
import threading

__all__ = ["run_ring"]


def run_ring(fn, tensors, timeout_s=10.0):
    """Run fn(tensors[rank], rank, n, exchange) in one thread per rank; return each rank's message sizes."""
    world_size = len(tensors)
    mailboxes = [queue.Queue() for _ in range(world_size)]
    sent = [[] for _ in range(world_size)]
    errors = []

    def rank_main(rank):
        def exchange(send_chunk, receive_into):
            sent[rank].append(send_chunk.numel())
            mailboxes[(rank + 1) % world_size].put(send_chunk.detach().clone())
            try:
                message = mailboxes[rank].get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"rank {rank} waited {timeout_s} s for a message from rank "
                                   f"{(rank - 1) % world_size}: does every rank call exchange equally often?") from None
            if message.shape != receive_into.shape:
                raise ValueError(f"rank {rank} received a chunk of shape {tuple(message.shape)} into a buffer "
                                 f"of shape {tuple(receive_into.shape)}: do both ranks agree on the chunk index?")
            receive_into.copy_(message)

        try:
            fn(tensors[rank], rank, world_size, exchange)
        except Exception as error:
            errors.append(f"rank {rank}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return sent
