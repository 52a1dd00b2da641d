"""Reference answers for the sharded-matmul notebook's exercises (hidden from learners; see autograder/README.md)."""
from __future__ import annotations

import math

import torch

import course
from course.lessons import sharding


def sharded_matmul_forward(A_shards, B):
    """A @ B on cuda:0, where A_shards[i] (rows of A, any count) lives on GPU i and B on cuda:0.

    B travels once to every other GPU, each GPU multiplies its rows, and only the C rows come back.
    """
    B_copies = [B.to(shard.device) for shard in A_shards]  # first: a copy out of cuda:0 queues behind its matmul
    C_shards = [shard @ b for shard, b in zip(A_shards, B_copies)]
    return torch.cat([c.to("cuda:0") for c in C_shards], dim=0)


def column_sharded_matmul(A, B, num_gpus):
    """Seed 003's split done right: B's columns split with tensor_split, A whole on every GPU,
    the C column blocks joined along columns on cuda:0."""
    pieces = [(A.to(f"cuda:{i}"), b.to(f"cuda:{i}")) for i, b in enumerate(torch.tensor_split(B, num_gpus, dim=1))]
    C_shards = [a @ b for a, b in pieces]
    return torch.cat([c.to("cuda:0") for c in C_shards], dim=1)


def bytes_moved(scheme, N, M, K, num_gpus, element_size=4):
    """Bytes between GPUs for C = A @ B (N x M times M x K), A and B starting on cuda:0, C ending there.

    "row": A's rows split with tensor_split, B copied whole to every other GPU, C rows back.
    "column": B's columns split, A copied whole to every other GPU, C columns back.
    Shard 0 stays on cuda:0; tensor_split gives it ceil(size / num_gpus) rows or columns.
    """
    if scheme == "row":
        rows_away = N - math.ceil(N / num_gpus)
        elements = rows_away * M + (num_gpus - 1) * M * K + rows_away * K
    elif scheme == "column":
        cols_away = K - math.ceil(K / num_gpus)
        elements = (num_gpus - 1) * N * M + M * cols_away + N * cols_away
    else:
        raise ValueError(f"scheme must be 'row' or 'column', got {scheme!r}")
    return elements * element_size


def tensor_parallel_mlp(x, W1_shards, W2_shards):
    """relu(x @ W1) @ W2 on cuda:0 with W1 split by columns and W2 by rows, shard i on GPU i.

    relu acts on each column of the hidden layer alone, so every GPU finishes its slice without
    talking to the others; one reduction (the sum of the partial outputs) ends the block.
    """
    inputs = [x.to(w1.device) for w1 in W1_shards]
    partials = [torch.relu(x_i @ w1) @ w2 for x_i, w1, w2 in zip(inputs, W1_shards, W2_shards)]
    out = partials[0].to("cuda:0")
    for partial in partials[1:]:
        out = out + partial.to("cuda:0")
    return out


PROBLEMS = ("crashes", "wrong shape", "wrong values", "not on cuda:0", "no gradient", "copies B more than once",
            "matmuls do not overlap")


def _small_runs(matmul_fn, num_gpus, shapes) -> set[str]:
    """The problems matmul_fn shows on small N x M by M x K products with real values on num_gpus emulated GPUs."""
    problems = set()
    with course.emulate(gpus=num_gpus, force=True) as emu:
        for N, M, K in shapes:
            generator = torch.Generator().manual_seed(1000 * num_gpus + 100 * N + 10 * M + K)
            A_cpu, B_cpu = torch.randn(N, M, generator=generator), torch.randn(M, K, generator=generator)
            shards = [a.to(f"cuda:{i}").requires_grad_() for i, a in enumerate(torch.tensor_split(A_cpu, num_gpus))]
            B = B_cpu.to("cuda:0").requires_grad_()
            torch.cuda.synchronize()
            start_ms = emu.now_ms()
            try:
                C = matmul_fn(shards, B)
            except Exception:
                problems.add("crashes")
                continue
            forward = sharding.since(emu.trace, start_ms)
            if tuple(C.shape) != (N, K):
                problems.add("wrong shape")
            elif not torch.allclose(C.detach().cpu(), A_cpu @ B_cpu, atol=1e-4):
                problems.add("wrong values")
            if C.device != torch.device("cuda", 0):
                problems.add("not on cuda:0")
            for i in range(1, num_gpus):
                if sum(e.bytes == M * K * 4 for e in sharding.copies(forward, "cuda:0", f"cuda:{i}")) > 1:
                    problems.add("copies B more than once")
            if not C.requires_grad:
                problems.add("no gradient")
                continue
            try:
                C.sum().backward()
            except Exception:
                problems.add("crashes")
                continue
            if any(t.grad is None for t in shards + [B]):
                problems.add("no gradient")
    return problems


def _lonely_matmul(matmul_fn, num_gpus, size=8192) -> set[str]:
    """The problems matmul_fn shows at size^3 in shape-only mode: a crash, or a GPU whose matmul overlaps no
    other GPU's in time (the GPUs took turns instead of working together)."""
    with course.emulate(gpus=num_gpus, materialize=False, force=True) as emu:
        shards = [torch.empty(rows, size, device=f"cuda:{i}")
                  for i, rows in enumerate(len(a) for a in torch.tensor_split(torch.arange(size), num_gpus))]
        B = torch.empty(size, size, device="cuda:0")
        torch.cuda.synchronize()
        start_ms = emu.now_ms()
        try:
            matmul_fn(shards, B)
        except Exception:
            return {"crashes"}
        torch.cuda.synchronize()
        matmuls = [[(e.start_ns, e.end_ns) for e in sharding.since(emu.trace, start_ms)
                    if e.kind == "kernel" and e.flops > 0 and e.device == f"cuda:{i}"] for i in range(num_gpus)]

    def overlaps_another(i):
        return any(start < other_end and other_start < end for j in range(num_gpus) if j != i
                   for start, end in matmuls[i] for other_start, other_end in matmuls[j])

    return set() if all(overlaps_another(i) for i in range(num_gpus)) else {"matmuls do not overlap"}


def find_bugs(matmul_fn) -> set[str]:
    """The problems (from PROBLEMS) a sharded matmul with the forum thread's interface shows on 1 to 4 GPUs.

    Small products with values, some sizes dividing evenly and some not (several bugs show only then), against
    A @ B on the CPU and the trace; then a product big enough that the GPUs' matmuls must overlap, shape-only.
    """
    problems = set()
    for num_gpus in (1, 2, 3, 4):
        problems |= _small_runs(matmul_fn, num_gpus, ((8, 5, 8), (7, 3, 10), (13, 6, 5)))
    for num_gpus in (2, 3, 4):
        problems |= _lonely_matmul(matmul_fn, num_gpus)
    return problems
