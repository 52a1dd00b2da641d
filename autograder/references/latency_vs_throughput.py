"""Reference answers for the latency-vs-throughput notebook (chapter 9; hidden from learners, see autograder/README.md)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def serving_metrics(arrival_ms, done_ms) -> dict:
    """Latency of each request is done - arrival; throughput is requests per second over the whole span."""
    latencies = [done - arrival for arrival, done in zip(arrival_ms, done_ms)]
    span_ms = max(done_ms) - min(arrival_ms)
    return {"mean_latency_ms": sum(latencies) / len(latencies), "max_latency_ms": max(latencies),
            "throughput_per_s": len(latencies) / span_ms * 1e3}


def tensor_parallel_forward(x, blocks):
    """MLP blocks gelu(x W1) W2 with W1 split by columns and W2 by rows over GPUs 0..t-1; one all-reduce per block.

    `blocks` is a list of (W1_shards, W2_shards); x starts on cuda:0 and is broadcast once; returns the
    output on cuda:0.
    """
    num_gpus = len(blocks[0][0])
    xs = torch.cuda.comm.broadcast(x, list(range(num_gpus)))
    for W1_shards, W2_shards in blocks:
        partials = [F.gelu(xi @ w1) @ w2 for xi, w1, w2 in zip(xs, W1_shards, W2_shards)]
        torch.cuda.nccl.all_reduce(partials)
        xs = partials
    return xs[0]


def best_serving_config(latency_ms, target_ms, batch_sizes, tp_degrees, total_gpus):
    """(batch, tp) with the highest throughput whose latency meets the target, or None.

    `total_gpus // tp` replicas each serve `batch` requests per `latency_ms(batch, tp)`. Ties go to the
    smaller tp, then the smaller batch. Degrees that do not divide total_gpus use only the whole replicas.
    """
    best, best_key = None, None
    for tp in sorted(tp_degrees):
        if tp > total_gpus:
            continue
        for batch in sorted(batch_sizes):
            latency = latency_ms(batch, tp)
            if latency > target_ms:
                continue
            throughput = (total_gpus // tp) * batch / latency
            if best_key is None or throughput > best_key:
                best, best_key = (batch, tp), throughput
    return best


def dynamic_batching(arrival_ms, pass_ms, max_batch) -> list[float]:
    """Answer times of requests served by one GPU: a pass starts as soon as the GPU is free and a request waits,
    with the oldest requests arrived by then, at most max_batch; it ends pass_ms(batch) later."""
    done, free_at, first = [0.0] * len(arrival_ms), 0.0, 0
    while first < len(arrival_ms):
        start = max(free_at, arrival_ms[first])
        last = first
        while last < len(arrival_ms) and last - first < max_batch and arrival_ms[last] <= start:
            last += 1
        free_at = start + pass_ms(last - first)
        done[first:last] = [free_at] * (last - first)
        first = last
    return done


def diagnose_serving(arrival_ms, start_ms, done_ms, pass_ms, batch_limit) -> tuple[str, str]:
    """(cause, change) for a served run's p99 latency: "queue" or "pass", then the cheapest change that fixes it.

    The requests at or above the p99 latency are split into waiting (arrival to start of their pass) and their
    pass. A pass problem only shrinks with a shorter pass: tensor parallelism. A queue problem is a lack of
    throughput: free if a pass of batch_limit requests serves more per second than arrive, else more replicas.
    """
    latencies = [done - arrival for arrival, done in zip(arrival_ms, done_ms)]
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    slow = [i for i, latency in enumerate(latencies) if latency >= p99]
    waiting = sum(start_ms[i] - arrival_ms[i] for i in slow)
    in_pass = sum(done_ms[i] - start_ms[i] for i in slow)
    if waiting <= in_pass:
        return ("pass", "tensor parallelism")
    arrivals_per_ms = len(arrival_ms) / (max(arrival_ms) - min(arrival_ms))
    if batch_limit / pass_ms(batch_limit) > arrivals_per_ms:
        return ("queue", "larger batches")
    return ("queue", "more replicas")
