"""Reference answers for the sharded-matmul notebook's exercises (hidden from learners; see autograder/README.md)."""
from __future__ import annotations

import math

import torch


def sharded_matmul_forward(A_shards, B):
    """A @ B on cuda:0, where A_shards[i] (rows of A, any count) lives on GPU i and B on cuda:0.

    B travels once to every other GPU, each GPU multiplies its rows, and only the C rows come back.
    """
    C_shards = [shard @ B.to(shard.device) for shard in A_shards]
    return torch.cat([c.to("cuda:0") for c in C_shards], dim=0)


def column_sharded_matmul(A, B, num_gpus):
    """Seed 003's split done right: B's columns split with tensor_split, A whole on every GPU,
    the C column blocks joined along columns on cuda:0."""
    B_shards = torch.tensor_split(B, num_gpus, dim=1)
    C_shards = [A.to(f"cuda:{i}") @ b.to(f"cuda:{i}") for i, b in enumerate(B_shards)]
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
    partials = [torch.relu(x.to(w1.device) @ w1) @ w2 for w1, w2 in zip(W1_shards, W2_shards)]
    out = partials[0].to("cuda:0")
    for partial in partials[1:]:
        out = out + partial.to("cuda:0")
    return out
