"""Two eager LLM decoders, op for op and module for module as the published measurements ran them.

Batch-1 decode on a fast GPU is bound by the host issuing ops, so how many ops and module calls a token costs
is part of the work: these replicas follow the code that was measured, not an idealised decoder.
- `HFQwen2`: Hugging Face transformers' Qwen2 (src/transformers/models/qwen2/modeling_qwen2.py: Qwen2RMSNorm,
  Qwen2MLP, Qwen2Attention with `sdpa_attention_forward`, a DynamicCache grown by `torch.cat`, rotary cos/sin
  computed once per forward by Qwen2RotaryEmbedding) and one step of `generate`'s greedy loop
  (src/transformers/generation/utils.py `_sample`).
- `GptFast`: gpt-fast's model.py (https://github.com/pytorch-labs/gpt-fast: fused wqkv, rotary on (re, im)
  pairs in fp32, a static KVCache written with index_put, SDPA over the whole cache with a causal mask) and
  generate.py's `decode_one_token` (top-k sampling), whose decode loop asks for the math SDPA backend.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class HFRMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + 1e-6)
        return self.weight * hidden_states.to(input_dtype)


class HFMLP(nn.Module):
    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, ffn, bias=False)
        self.up_proj = nn.Linear(width, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, width, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class HFAttention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim, self.groups = width // heads, heads // kv_heads
        self.q_proj = nn.Linear(width, width, bias=True)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, hidden_states, cos, sin, cache: "DynamicCache", layer_idx: int):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        k, v = cache.update(k, v, layer_idx)
        # sdpa_attention_forward: no mask at batch-1 decode, so GQA runs inside SDPA (enable_gqa)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=self.head_dim ** -0.5,
                                           is_causal=False, enable_gqa=self.groups > 1)
        y = y.transpose(1, 2).contiguous()
        return self.o_proj(y.reshape(*input_shape, -1).contiguous())


class DynamicCache:
    """Keys and values per layer, each step concatenated onto the past (transformers' cache_utils.DynamicCache)."""

    def __init__(self, layers, kv_heads, context, head_dim):
        self.keys = [torch.empty(1, kv_heads, context, head_dim) for _ in range(layers)]
        self.values = [torch.empty(1, kv_heads, context, head_dim) for _ in range(layers)]

    def update(self, key_states, value_states, layer_idx):
        self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key_states], dim=-2)
        self.values[layer_idx] = torch.cat([self.values[layer_idx], value_states], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]


class HFDecoderLayer(nn.Module):
    def __init__(self, width, heads, kv_heads, ffn, layer_idx):
        super().__init__()
        self.self_attn = HFAttention(width, heads, kv_heads)
        self.mlp = HFMLP(width, ffn)
        self.input_layernorm, self.post_attention_layernorm = HFRMSNorm(width), HFRMSNorm(width)
        self.layer_idx = layer_idx

    def forward(self, hidden_states, cos, sin, cache):
        residual = hidden_states
        hidden_states = residual + self.self_attn(self.input_layernorm(hidden_states), cos, sin, cache,
                                                  self.layer_idx)
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class HFRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * 1.0).to(dtype=x.dtype), (emb.sin() * 1.0).to(dtype=x.dtype)


class HFQwen2(nn.Module):
    """Qwen2ForCausalLM at batch 1, and `step()`: one token of greedy `generate` after `context` tokens."""

    def __init__(self, layers, width, heads, kv_heads, ffn, vocab, context):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(HFDecoderLayer(width, heads, kv_heads, ffn, i) for i in range(layers))
        self.cache = DynamicCache(layers, kv_heads, context, width // heads)
        self.norm = HFRMSNorm(width)
        self.rotary_emb = HFRotaryEmbedding(width // heads)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.input_ids = torch.zeros(1, context, dtype=torch.long)
        self.attention_mask = torch.ones(1, context, dtype=torch.long)
        self.cache_position = torch.tensor([context - 1])
        self.unfinished = torch.ones(1, dtype=torch.long)
        self.eos = torch.tensor([151643, 151645])

    def forward(self, input_ids, cache_position):
        hidden_states = self.embed_tokens(input_ids)
        position_ids = cache_position.unsqueeze(0)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, self.cache)
        hidden_states = self.norm(hidden_states)
        return self.lm_head(hidden_states[:, -1:, :])  # logits_to_keep=1

    def step(self):
        """prepare_inputs_for_generation, the forward, greedy choice, stopping criteria, kwargs update."""
        input_ids = self.input_ids[:, self.cache_position]
        logits = self(input_ids, self.cache_position)
        scores = logits[:, -1, :].to(copy=True, dtype=torch.float32)
        next_tokens = torch.argmax(scores, dim=-1)
        next_tokens = next_tokens * self.unfinished + 151643 * (1 - self.unfinished)
        self.input_ids = torch.cat([self.input_ids, next_tokens[:, None]], dim=-1)
        is_done = torch.isin(self.input_ids[:, -1], self.eos)  # EosTokenCriteria
        self.unfinished = self.unfinished & ~is_done
        this_peer_finished = self.unfinished.max() == 0  # `generate` reads it on the host: the timer's sync
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones((1, 1))], dim=-1)
        self.cache_position = self.cache_position[-1:] + 1
        return this_peer_finished


class GptFastRMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def _gpt_fast_rotary(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack([xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
                          xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1]], -1)
    return x_out2.flatten(3).type_as(x)


class GptFastKVCache(nn.Module):
    def __init__(self, heads, max_seq, head_dim):
        super().__init__()
        self.register_buffer("k_cache", torch.empty(1, heads, max_seq, head_dim))
        self.register_buffer("v_cache", torch.empty(1, heads, max_seq, head_dim))

    def update(self, input_pos, k_val, v_val):
        self.k_cache[:, :, input_pos] = k_val
        self.v_cache[:, :, input_pos] = v_val
        return self.k_cache, self.v_cache


class GptFastAttention(nn.Module):
    def __init__(self, width, heads, kv_heads, max_seq):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.width = heads, kv_heads, width // heads, width
        self.wqkv = nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        self.kv_cache = GptFastKVCache(kv_heads, max_seq, self.head_dim)

    def forward(self, x, freqs_cis, mask, input_pos):
        bsz, seqlen, _ = x.shape
        kv_size = self.kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.width, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.heads, self.head_dim)
        k = k.view(bsz, seqlen, self.kv_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.kv_heads, self.head_dim)
        q, k = _gpt_fast_rotary(q, freqs_cis), _gpt_fast_rotary(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.width))


class GptFastFeedForward(nn.Module):
    def __init__(self, width, ffn):
        super().__init__()
        self.w1, self.w3 = nn.Linear(width, ffn, bias=False), nn.Linear(width, ffn, bias=False)
        self.w2 = nn.Linear(ffn, width, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GptFastBlock(nn.Module):
    def __init__(self, width, heads, kv_heads, ffn, max_seq):
        super().__init__()
        self.attention = GptFastAttention(width, heads, kv_heads, max_seq)
        self.feed_forward = GptFastFeedForward(width, ffn)
        self.ffn_norm, self.attention_norm = GptFastRMSNorm(width), GptFastRMSNorm(width)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class GptFast(nn.Module):
    """gpt-fast's Transformer with caches for `max_seq` tokens, and `step()`: decode_one_token at `position`."""

    def __init__(self, layers, width, heads, kv_heads, ffn, vocab, max_seq, position):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(GptFastBlock(width, heads, kv_heads, ffn, max_seq) for _ in range(layers))
        self.norm = GptFastRMSNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)
        self.register_buffer("freqs_cis", torch.empty(max_seq, width // heads // 2, 2))
        self.register_buffer("causal_mask", torch.ones(max_seq, max_seq, dtype=torch.bool))
        self.cur_token = torch.zeros(1, 1, dtype=torch.int)
        self.input_pos = torch.tensor([position], dtype=torch.int)

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))

    def step(self, temperature=0.8, top_k=200):
        """decode_one_token with gpt-fast's default sampling (temperature 0.8, top_k 200), under its math SDPA."""
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            logits = self(self.cur_token, self.input_pos)
        logits = logits[0, -1] / max(temperature, 1e-5)
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        probs = F.softmax(torch.where(logits < pivot, -float("Inf"), logits), dim=-1)
        q = torch.empty_like(probs).exponential_(1)
        next_token = torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)
        self.input_pos += 1
        self.cur_token = next_token.clone().view(1, -1)
        return next_token.clone()
