"""The text tutorials' idioms: a chatbot-style seq2seq (packed bidirectional GRU encoder given CPU lengths, attention
decoder with teacher forcing and greedy steps read back with `torch.LongTensor([[topi[i][0] ...]])`, masked NLL),
packed LSTMs with unsorted lengths, the char-RNN classifier's hand-made cell and legacy-type checks, and the
text-classification EmbeddingBag with offsets, fixed-length bags and per-sample weights."""
import json
import string

import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
on_gpu = device.type == "cuda"
torch.manual_seed(0)
V, H, B, T = 12, 8, 3, 4
out = {}


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.gru = nn.Embedding(V, H), nn.GRU(H, H, 2, bidirectional=True)

    def forward(self, seq, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(seq), lengths)
        outputs, hidden = self.gru(packed)
        outputs, _ = nn.utils.rnn.pad_packed_sequence(outputs)
        return outputs[:, :, :H] + outputs[:, :, H:], hidden


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.gru = nn.Embedding(V, H), nn.GRU(H, H, 2)
        self.concat, self.out = nn.Linear(2 * H, H), nn.Linear(H, V)

    def forward(self, step, hidden, encoder_outputs):
        output, hidden = self.gru(self.embedding(step), hidden)
        weights = F.softmax(torch.sum(output * encoder_outputs, dim=2).t(), dim=1).unsqueeze(1)
        context = weights.bmm(encoder_outputs.transpose(0, 1)).squeeze(1)
        mixed = torch.tanh(self.concat(torch.cat((output.squeeze(0), context), 1)))
        return F.softmax(self.out(mixed), dim=1), hidden


def mask_nll(probs, target, mask):
    cross_entropy = -torch.log(torch.gather(probs, 1, target.view(-1, 1)).squeeze(1))
    return cross_entropy.masked_select(mask).mean().to(device), mask.sum().item()


encoder, decoder = Encoder().to(device), Decoder().to(device)
optimizers = [torch.optim.Adam(encoder.parameters(), 1e-3), torch.optim.Adam(decoder.parameters(), 5e-3)]
lengths = torch.tensor([4, 3, 2])  # on the CPU, as CUDA requires
inputs, targets = torch.randint(1, V, (T, B)).to(device), torch.randint(1, V, (T, B)).to(device)
mask = (torch.arange(T).unsqueeze(1) < torch.tensor([4, 2, 3]).unsqueeze(0)).to(device)
out["seq2seq"] = []
for iteration in range(2):
    for optimizer in optimizers:
        optimizer.zero_grad()
    encoder_outputs, encoder_hidden = encoder(inputs, lengths)
    step, hidden, loss, tokens = torch.LongTensor([[1 for _ in range(B)]]).to(device), encoder_hidden[:2], 0, 0
    for t in range(T):
        probs, hidden = decoder(step, hidden, encoder_outputs)
        if iteration == 0:  # teacher forcing
            step = targets[t].view(1, -1)
        else:
            _, topi = probs.topk(1)
            step = torch.LongTensor([[topi[i][0] for i in range(B)]]).to(device)
        step_loss, n = mask_nll(probs, targets[t], mask[t])
        loss, tokens = loss + step_loss, tokens + n
    loss.backward()
    norms = [nn.utils.clip_grad_norm_(m.parameters(), 50.0) for m in (encoder, decoder)]
    for optimizer in optimizers:
        optimizer.step()
    out["seq2seq"].append([loss.item() / T, tokens] + [n.item() for n in norms])
out["greedy_tokens"] = step.tolist()
out["step_losses_on_host"] = torch.tensor([loss.detach(), step_loss.detach()]).tolist()

sequences = [torch.randn(n, 3).to(device) for n in (2, 5, 3)]
packed = nn.utils.rnn.pack_sequence(sequences, enforce_sorted=False)
lstm = nn.LSTM(3, 4, bidirectional=True).to(device)
y, (h, c) = lstm(packed)
padded, padded_lengths = nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=6)
(padded.pow(2).sum() + h.sum()).backward()
left = nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=-1.0, padding_side="left")
out["packed_lstm"] = [padded.sum().item(), lstm.weight_ih_l0_reverse.grad.sum().item(), left.sum().item(),
                      padded_lengths.tolist(), list(padded.shape)]
out["packed_devices"] = [packed.data.device.type == device.type, packed.batch_sizes.device.type,
                         padded_lengths.device.type, padded.device.type == device.type,
                         left.device.type == device.type]

letters = string.ascii_letters + " .,;'"


def line_to_tensor(line):
    tensor = torch.zeros(len(line), 1, len(letters))
    for i, letter in enumerate(line):
        tensor[i][0][letters.find(letter)] = 1
    return tensor


class CharRNN(nn.Module):
    def __init__(self, n_in, n_hidden, n_out):
        super().__init__()
        self.n_hidden, self.i2h, self.h2o = n_hidden, nn.Linear(n_in + n_hidden, n_hidden), nn.Linear(n_hidden, n_out)

    def forward(self, x, hidden):
        hidden = torch.tanh(self.i2h(torch.cat((x, hidden), 1)))
        return F.log_softmax(self.h2o(hidden), dim=1), hidden


rnn = CharRNN(len(letters), 16, 3).to(device)
out["char_rnn"] = []
for name, category in [("Alice", 0), ("Bob", 1), ("Chen", 2)]:
    hidden, line = torch.zeros(1, 16, device=device), line_to_tensor(name).to(device)
    rnn.zero_grad()
    for i in range(line.size()[0]):
        output, hidden = rnn(line[i], hidden)
    loss = F.nll_loss(output, torch.tensor([category], device=device))
    loss.backward()
    for p in rnn.parameters():
        p.data.add_(p.grad.data, alpha=-0.05)
    out["char_rnn"].append([loss.item(), output.topk(1)[1].item()])
# type checks as older code writes them: each legacy type answers for its own device only
out["legacy_types"] = [isinstance(hidden, torch.FloatTensor) != on_gpu,
                       isinstance(hidden, torch.cuda.FloatTensor) == on_gpu,
                       isinstance(hidden.cpu(), torch.FloatTensor),
                       hidden.type() == ("torch.cuda.FloatTensor" if on_gpu else "torch.FloatTensor"),
                       hidden.untyped_storage().device.type == device.type, hidden.untyped_storage().nbytes()]

g = torch.Generator().manual_seed(0)
texts = [torch.randint(0, 50, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(6)]
labels = torch.tensor([0, 1, 2, 1, 0, 2]).to(device)
offsets = torch.tensor([0] + [len(t) for t in texts[:-1]]).cumsum(dim=0).to(device)
embedding, fc = nn.EmbeddingBag(50, 8).to(device), nn.Linear(8, 3).to(device)
optimizer = torch.optim.SGD(list(embedding.parameters()) + list(fc.parameters()), lr=5)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1.0, gamma=0.1)
out["text_classification"] = []
for epoch in range(2):
    optimizer.zero_grad()
    logits = fc(embedding(torch.cat(texts).to(device), offsets))
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    nn.utils.clip_grad_norm_(list(embedding.parameters()) + list(fc.parameters()), 0.1)
    optimizer.step()
    scheduler.step()
    out["text_classification"].append([loss.item(), (logits.argmax(1) == labels).sum().item()])
fixed = torch.tensor([[1, 2, 4], [5, 4, 3]], device=device)
for mode in ("sum", "max"):
    bag = nn.EmbeddingBag(10, 3, mode=mode).to(device)
    result = bag(fixed)
    result.sum().backward()
    out[f"bag_{mode}"] = [result.sum().item(), bag.weight.grad.sum().item()]
weighted = nn.EmbeddingBag(10, 3, mode="sum").to(device)
sample_weights = torch.tensor([[0.5, 1.0, 2.0], [2.0, 0.1, 1.0]], device=device)
out["bag_weighted"] = weighted(fixed, per_sample_weights=sample_weights).sum().item()
out["unravel_index"] = [t.tolist() for t in torch.unravel_index(torch.tensor([5, 11], device=device), (3, 4))]
print("RESULT", json.dumps(out))
