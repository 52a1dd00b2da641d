"""CUDA graphs the way the PyTorch docs and fast-decoding scripts use them: warm up on a side stream, capture a
whole training step (forward, backward, optimizer step, batch norm) and replay it on refilled static inputs; then
capture one decode step with a static KV cache written by index_copy_ and replay it per token. Without GPUs the
same steps run eagerly, and the numbers must agree.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"


def warm_up(fn, *args):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)


def training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 2))
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    static_x, static_y = torch.randn(4, 3, 8, 8, device=device), torch.randint(0, 2, (4,), device=device)

    def step():
        loss = F.cross_entropy(model(static_x), static_y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        warm_up(step) if cuda else step()
    if cuda:
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = step()
    losses = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        static_x.copy_(torch.randn(4, 3, 8, 8, generator=g))
        static_y.copy_(torch.randint(0, 2, (4,), generator=g))
        if cuda:
            graph.replay()
            losses.append(static_loss.item())
        else:
            opt.zero_grad(set_to_none=True)
            losses.append(step().item())
    bn = model[1]
    return {"losses": losses, "running_mean": bn.running_mean.tolist(), "batches": int(bn.num_batches_tracked),
            "weight": model[4].weight.sum().item()}


def decoding():
    torch.manual_seed(0)
    vocab, width, length = 30, 16, 24
    emb, pos_emb = nn.Embedding(vocab, width).to(device), nn.Embedding(length, width).to(device)
    qkv, head = nn.Linear(width, 3 * width).to(device), nn.Linear(width, vocab).to(device)
    k_cache, v_cache = torch.zeros(1, length, width, device=device), torch.zeros(1, length, width, device=device)
    static_tok = torch.zeros(1, 1, dtype=torch.long, device=device)
    static_pos = torch.zeros(1, dtype=torch.long, device=device)
    positions = torch.arange(length, device=device)

    @torch.no_grad()
    def step(tok, pos):
        q, k, v = qkv(emb(tok) + pos_emb(pos)).chunk(3, -1)
        k_cache.index_copy_(1, pos, k)
        v_cache.index_copy_(1, pos, v)
        attention = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=(positions <= pos).view(1, 1, length))
        return head(attention).argmax(-1)

    if cuda:
        warm_up(step, static_tok, static_pos)
        k_cache.zero_()
        v_cache.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_next = step(static_tok, static_pos)
    tokens = [3]
    for t in range(12):
        static_tok.fill_(tokens[-1])
        static_pos.fill_(t)
        if cuda:
            graph.replay()
            tokens.append(int(static_next.item()))
        else:
            tokens.append(int(step(static_tok, static_pos).item()))
    return {"tokens": tokens, "k_cache": k_cache.sum().item(), "v_norm": v_cache.norm().item()}


if __name__ == "__main__":
    print("RESULT " + json.dumps({"training": training(), "decoding": decoding()}))
