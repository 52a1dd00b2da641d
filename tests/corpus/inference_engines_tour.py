"""Inference engines in miniature, as serving code writes them: a paged KV cache (a block pool on the GPU, block
tables, writes with index_put_ / scatter_ into slot mappings, reads with index_select, copy-on-write of a shared
partial block with index_copy_), beam search with topk over beam x vocab, // and % index arithmetic and
index_select reordering of a GRU's state, and speculative decoding with the draft (the target with layers
skipped) on cuda:1 and the target on cuda:0, timed with CUDA events; its output must equal greedy decoding."""
import copy
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= 2
DEV = torch.device("cuda" if CUDA else "cpu")
TARGET, DRAFT = (torch.device("cuda:0"), torch.device("cuda:1")) if CUDA else (torch.device("cpu"),) * 2
BLOCK, NBLOCKS, H, D = 4, 12, 2, 8
V = 13


class PagedCache:
    def __init__(self):
        self.k = torch.zeros(NBLOCKS, BLOCK, H, D, device=DEV)
        self.v = torch.zeros(NBLOCKS, BLOCK, H, D, device=DEV)
        self.free, self.tables, self.lens = list(range(NBLOCKS))[::-1], {}, {}

    def append(self, seq, k, v):
        n, table = self.lens.get(seq, 0), self.tables.setdefault(seq, [])
        slots = []
        for i in range(k.shape[0]):
            if (n + i) // BLOCK >= len(table):
                table.append(self.free.pop())
            slots.append(table[(n + i) // BLOCK] * BLOCK + (n + i) % BLOCK)
        slots = torch.tensor(slots, device=DEV)
        self.k.view(-1, H, D).index_put_((slots,), k)
        self.v.view(-1, H, D).scatter_(0, slots[:, None, None].expand(-1, H, D), v)
        self.lens[seq] = n + k.shape[0]

    def gather(self, seq):
        table = torch.tensor(self.tables[seq], device=DEV)
        n = self.lens[seq]
        return self.k.index_select(0, table).flatten(0, 1)[:n], self.v.index_select(0, table).flatten(0, 1)[:n]

    def fork(self, parent, child):
        table = list(self.tables[parent])
        new, src = torch.tensor([self.free.pop()], device=DEV), torch.tensor([table[-1]], device=DEV)
        self.k.index_copy_(0, new, self.k.index_select(0, src))
        self.v.index_copy_(0, new, self.v.index_select(0, src))
        self.tables[child], self.lens[child] = table[:-1] + [new.item()], self.lens[parent]


def attend(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)


def paged():
    torch.manual_seed(0)
    cache, full, outs = PagedCache(), {}, []
    for step, (seq, n) in enumerate([(0, 6), (1, 3), (0, 3), (2, 9), (1, 5)]):
        k, v = torch.randn(n, H, D, device=DEV), torch.randn(n, H, D, device=DEV)
        cache.append(seq, k, v)
        fk, fv = full.get(seq, (torch.empty(0, H, D, device=DEV),) * 2)
        full[seq] = (torch.cat([fk, k]), torch.cat([fv, v]))
        q = torch.randn(1, H, D, device=DEV)
        out = attend(q, *cache.gather(seq))
        outs.append([out.sum().item(), torch.allclose(out, attend(q, *full[seq]), atol=1e-6)])
        if step == 2:
            cache.fork(0, 3)
    return {"outputs": outs, "fork_equal": torch.equal(cache.gather(3)[0], full[0][0]), "tables": cache.tables}


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.gru, self.out = nn.Embedding(V, 16), nn.GRU(16, 16, batch_first=True), nn.Linear(16, V)

    def step(self, tokens, h):
        o, h = self.gru(self.emb(tokens)[:, None], h)
        return torch.log_softmax(self.out(o[:, 0]), -1), h


@torch.no_grad()
def beam_search(beam=3, steps=5):
    torch.manual_seed(0)
    dec = Decoder().to(DEV).eval()
    batch = 2
    h = torch.randn(1, batch, 16, device=DEV).repeat_interleave(beam, 1)
    tokens = torch.ones(batch * beam, dtype=torch.long, device=DEV)
    scores = torch.zeros(batch, beam, device=DEV)
    scores[:, 1:] = float("-inf")
    history = torch.empty(batch * beam, 0, dtype=torch.long, device=DEV)
    for _ in range(steps):
        logp, h = dec.step(tokens, h)
        top, idx = (scores.view(-1, 1) + logp).view(batch, beam * V).topk(beam, dim=-1)
        base = ((idx // V) + torch.arange(batch, device=DEV)[:, None] * beam).view(-1)
        h = h.index_select(1, base)
        history = torch.cat([history.index_select(0, base), (idx % V).view(-1, 1)], 1)
        tokens, scores = (idx % V).view(-1), top
    return {"best": history.view(batch, beam, -1).cpu().tolist(), "scores": scores.cpu().tolist()}


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(V, 32), nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, V)

    @torch.no_grad()
    def forward(self, ids):
        n = ids.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=ids.device), 1)
        return self.head(self.blocks(self.emb(ids) + self.pos(torch.arange(n, device=ids.device)), mask=mask,
                                     is_causal=True))


def greedy(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def speculative(k=3, n=8):
    target = LM().to(TARGET).eval()
    draft = copy.deepcopy(target).to(DRAFT)
    draft.blocks.layers, draft.blocks.num_layers = draft.blocks.layers[:1], 1
    torch.manual_seed(5)
    prompt = torch.randint(0, V, (1, 4), device=TARGET)
    ids, accepted, times = prompt, [], []
    while ids.shape[1] < prompt.shape[1] + n:
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        proposal = greedy(draft, ids.to(DRAFT), k)[:, ids.shape[1]:].to(TARGET)
        choice = target(torch.cat([ids, proposal], 1))[:, ids.shape[1] - 1:].argmax(-1)
        agree = (choice[:, :k] == proposal).int().cumprod(1).sum().item()
        ids = torch.cat([ids, proposal[:, :agree], choice[:, agree:agree + 1]], 1)
        accepted.append(agree)
        if CUDA:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) > 0)
    plain = greedy(target, prompt, n)
    return {"greedy": plain.cpu().tolist(), "equal": torch.equal(ids[:, :plain.shape[1]], plain),
            "accepted": accepted, "timed": all(times)}


def main():
    print("RESULT " + json.dumps({"paged": paged(), "beam": beam_search(), "speculative": speculative()}))


if __name__ == "__main__":
    main()
