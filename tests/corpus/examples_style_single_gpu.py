"""Single-GPU idioms of pytorch/examples-style scripts that once went wrong on emulated GPUs: a word-language-model
Transformer trained with dropout and a causal mask, complex tensors with lazy conj() views, one_hot labels, CTC loss
with lengths on the CPU, weights set through `param.data = ...`, a model cast with .half() and back while its
outputs are alive, and sparse embedding gradients with SparseAdam."""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TransformerLM(nn.Module):
    def __init__(self, ntoken=40, d=16):
        super().__init__()
        self.emb = nn.Embedding(ntoken, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.2)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.decoder = nn.Linear(d, ntoken)

    def forward(self, src):
        mask = nn.Transformer.generate_square_subsequent_mask(len(src)).to(src.device)
        hidden = self.encoder(self.emb(src) * math.sqrt(16), mask=mask, is_causal=True)
        return F.log_softmax(self.decoder(hidden), dim=-1)


def language_model():
    torch.manual_seed(1111)
    corpus = torch.randint(0, 40, (200,), generator=torch.Generator().manual_seed(0))
    data = corpus[:192].view(8, -1).t().contiguous().to(device)  # batchify: (seq, batch)
    model = TransformerLM().to(device)
    losses = []
    for i in range(0, data.size(0) - 1, 6):
        src, tgt = data[i:i + 6], data[i + 1:i + 7]
        model.zero_grad()
        loss = F.nll_loss(model(src[:len(tgt)]).view(-1, 40), tgt.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-5.0)
        losses.append(loss.item())
    sdpa = F.scaled_dot_product_attention(*[torch.ones(1, 2, 4, 8, device=device)] * 3, dropout_p=0.5, is_causal=True)
    return {"losses": losses, "sdpa_dropout_causal": sdpa.sum().item()}


def complex_integers_and_ctc():
    g = torch.Generator().manual_seed(2)
    z = torch.complex(torch.randn(6, generator=g), torch.randn(6, generator=g)).to(device)
    w = z.conj()
    labels = torch.tensor([0, 2, 1, 2], device=device)
    log_probs = torch.randn(12, 2, 5, generator=g).log_softmax(2).to(device).requires_grad_()
    ctc = F.ctc_loss(log_probs, torch.tensor([[1, 2, 3], [4, 1, 2]], device=device), torch.tensor([12, 10]),
                     torch.tensor([3, 2]))  # lengths on the CPU, as speech scripts keep them
    ctc.backward()
    return {"ctc": ctc.item(), "ctc_grad": log_probs.grad.abs().sum().item(),
            "power": (z * w).real.sum().item(), "conj_imag": w.imag.sum().item(), "is_conj": w.is_conj(),
            "vdot": torch.vdot(z, z).real.item(), "conj_matmul": (z.unsqueeze(0) @ w.unsqueeze(1)).real.item(),
            "neg_view_times_2": (w.imag * 2).sum().item(),
            "one_hot": F.one_hot(labels, 3).sum(0).tolist(), "one_hot_auto": F.one_hot(labels).shape[1]}


def weights_by_data():
    torch.manual_seed(3)
    layer = nn.Linear(3, 2).to(device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer.weight.data = torch.full((2, 3), 0.5, device=device)  # an init scheme the way older scripts do it
    layer.bias.data = layer.bias.data.double().float() * 0
    x = torch.arange(6.0, device=device).view(2, 3)
    layer(x).pow(2).sum().backward()
    opt.step()
    half = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).to(device).half()
    out = half(torch.ones(2, 4, device=device, dtype=torch.float16))  # its graph keeps the fp16 weights alive
    half.float()
    return {"weight": layer.weight.sum().item(), "bias": layer.bias.tolist(),
            "half_out": out.float().sum().item(), "after_float": str(half[0].weight.dtype),
            "float_out": half(torch.ones(2, 4, device=device)).sum().item()}


def sparse_embedding():
    torch.manual_seed(4)
    emb = nn.Embedding(10, 3, sparse=True).to(device)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        emb(torch.tensor([[1, 2], [2, 7]], device=device)).pow(2).sum().backward()
        opt.step()
    return {"is_sparse": emb.weight.grad.is_sparse, "weight": emb.weight.sum().item(),
            "rows_touched": emb.weight.grad.coalesce().indices().flatten().tolist()}


print("RESULT " + json.dumps({"lm": language_model(), "complex": complex_integers_and_ctc(),
                              "data": weights_by_data(), "sparse": sparse_embedding()}))
