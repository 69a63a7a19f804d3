"""Slow, obviously-correct Transformer-XL written with loops, to check the fast code against.

Nothing here is clever: every score is computed for one (query, key) pair from the paper's
formula, and every layer's extended context is built by hand from an explicit history of hidden
states. It reuses the model's weights, not its code paths (rel_shift, masks, SDPA, memory update).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from xl.model.attention import RelMultiHeadAttention
from xl.model.transformer import TransformerXL


def position_embedding(distance: int, d_model: int, dtype: torch.dtype) -> Tensor:
    """Sinusoid of one distance: [sin(d·f_0), …, sin(d·f_{k-1}), cos(d·f_0), …, cos(d·f_{k-1})]."""
    freqs = [1.0 / 10000 ** (2 * k / d_model) for k in range(d_model // 2)]
    return torch.tensor([math.sin(distance * f) for f in freqs] + [math.cos(distance * f) for f in freqs], dtype=dtype)


def context_and_queries(attn: RelMultiHeadAttention, h: Tensor, mem: Tensor) -> tuple[Tensor, Tensor]:
    """``memory ∘ segment`` (normed first with pre-LN) and the segment's queries [B, L, H, D]."""
    M = mem.size(1)
    cat = torch.cat([mem, h], 1)
    if attn.pre_lnorm:
        cat = attn.layer_norm(cat)
    return cat, attn.q_net(cat[:, M:]).view(h.size(0), h.size(1), attn.n_head, attn.d_head)


def naive_position_scores(attn: RelMultiHeadAttention, h: Tensor, mem: Tensor, clamp_len: int) -> Tensor:
    """(q_i + v) · W_r R_{dist(i, j)} for every query i and key j it may see; NaN where it may not."""
    B, L, d = h.shape
    M = mem.size(1)
    H, D = attn.n_head, attn.d_head
    _, q = context_and_queries(attn, h, mem)
    out = torch.full((B, H, L, M + L), float("nan"), dtype=h.dtype)
    for i in range(L):
        for j in range(M + i + 1):
            dist = M + i - j
            if clamp_len > 0:
                dist = min(dist, clamp_len)
            r = attn.r_net(position_embedding(dist, d, h.dtype)).view(H, D)
            for head in range(H):
                out[:, head, i, j] = (q[:, i, head] + attn.r_r_bias[head]) @ r[head]
    return out


def reference_attention(
    attn: RelMultiHeadAttention, h: Tensor, mem: Tensor, clamp_len: int = -1, window: int | None = None
) -> Tensor:
    """One attention sublayer (eval mode), score by score."""
    B, L, d = h.shape
    M = mem.size(1)
    H, D = attn.n_head, attn.d_head
    cat, q = context_and_queries(attn, h, mem)
    k, v = attn.kv_net(cat).view(B, M + L, 2, H, D).unbind(2)
    pos = naive_position_scores(attn, h, mem, clamp_len)
    out = torch.zeros(B, L, H, D, dtype=h.dtype)
    for b in range(B):
        for head in range(H):
            for i in range(L):
                keys = [j for j in range(M + i + 1) if window is None or j > M + i - window]
                scores = torch.stack([
                    ((q[b, i, head] + attn.r_w_bias[head]) @ k[b, j, head] + pos[b, head, i, j]) / math.sqrt(D)
                    for j in keys
                ])
                weights = torch.softmax(scores, 0)
                out[b, i, head] = sum(w * v[b, j, head] for w, j in zip(weights, keys, strict=True))
    out = attn.o_net(out.reshape(B, L, H * D))
    return h + out if attn.pre_lnorm else attn.layer_norm(h + out)


@torch.no_grad()
def reference_logits(model: TransformerXL, tokens: Tensor, seg_len: int, mem_len: int,
                     clamp_len: int = -1, same_length: bool = False) -> Tensor:
    """Logits for a whole token stream read segment by segment with memory ``mem_len``.

    Keeps the full history of every layer's inputs and, for each segment, hands layer n the last
    ``mem_len`` of its own history before the segment start: the mechanism by definition.
    """
    model.eval()
    n_layer = model.config.n_layer
    history = [tokens.new_zeros(tokens.size(0), 0, model.config.d_model, dtype=model.dtype)
               for _ in range(n_layer)]
    logits = []
    for start in range(0, tokens.size(1), seg_len):
        h = model.embed(tokens[:, start:start + seg_len]) * model.emb_scale
        for n, layer in enumerate(model.layers):
            past = history[n]
            mem = past[:, max(0, past.size(1) - mem_len):] if mem_len else past[:, :0]
            history[n] = torch.cat([past, h], 1)
            h = reference_attention(layer.attn, h, mem, clamp_len, mem_len if same_length else None)
            h = layer.ff(h)
        logits.append(model.head(model.final_norm(h)))
    return torch.cat(logits, 1)
