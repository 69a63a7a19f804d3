"""Relative multi-head attention of Transformer-XL (Dai et al., 2019, section 3.3).

For a query at absolute position i and a key at position j the score is

    (q_i + u) . k_j  +  (q_i + v) . W_r R_{i-j}

term (a)+(c) is content, (b)+(d) is position. Keys and values carry no position at all, so cached
states stay valid wherever they sit. The content term runs inside
``scaled_dot_product_attention``; the position term is computed once per layer as a [L, M+L]
matrix, shifted so that each query sees its distance to every key, and handed to SDPA as an
additive mask together with the causal mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rel_shift(scores: Tensor) -> Tensor:
    """Turn position scores indexed by distance into scores indexed by key.

    ``scores[..., i, k]`` is query i against the relative embedding of distance ``K-1-k``
    (embeddings ordered from the farthest distance to 0). Query i sits at key position
    ``K-L+i``, so key j is at distance ``K-L+i-j``, found at ``k = j + L-1-i``: row i moves
    left by ``L-1-i``. Zero-pad one column, reinterpret the rows, drop the first: one copy,
    no gather. Entries with ``j > K-L+i`` (the future) hold junk and must be masked.
    """
    *lead, q_len, k_len = scores.shape
    padded = F.pad(scores, (1, 0))  # [..., L, K+1]
    padded = padded.view(*lead, k_len + 1, q_len)
    return padded[..., 1:, :].reshape(*lead, q_len, k_len)


class RelMultiHeadAttention(nn.Module):
    """Queries from the current segment; keys and values over ``[memory ∘ current]``."""

    def __init__(
        self, d_model: int, n_head: int, d_head: int, dropout: float, dropatt: float, pre_lnorm: bool
    ) -> None:
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        inner = n_head * d_head
        self.q_net = nn.Linear(d_model, inner, bias=False)
        self.kv_net = nn.Linear(d_model, 2 * inner, bias=False)
        self.r_net = nn.Linear(d_model, inner, bias=False)
        self.o_net = nn.Linear(inner, d_model, bias=False)
        # u and v of the paper, one pair per layer (the paper's released enwik8/WT103 setups untie them).
        self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.r_r_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.layer_norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.dropatt = dropatt
        self.pre_lnorm = pre_lnorm
        self.scale = 1.0 / math.sqrt(d_head)

    def forward(self, h: Tensor, mem: Tensor, pos_emb: Tensor, mask: Tensor) -> Tensor:
        """h: [B, L, d] layer input; mem: [B, M, d] cached layer inputs (already detached);
        pos_emb: [M+L, d] embeddings of distances M+L-1 .. 0; mask: [L, M+L] additive (0 / -inf)."""
        B, L, _ = h.shape
        H, D = self.n_head, self.d_head
        cat = torch.cat([mem, h], dim=1) if mem.size(1) else h
        if self.pre_lnorm:
            cat = self.layer_norm(cat)
        K = cat.size(1)
        q = self.q_net(cat[:, -L:]).view(B, L, H, D)
        k, v = self.kv_net(cat).view(B, K, 2, H, D).permute(2, 0, 3, 1, 4)  # 2 × [B, H, K, D]
        r = self.r_net(pos_emb).view(K, H, D).permute(1, 2, 0)  # [H, D, K]

        pos_scores = torch.matmul((q + self.r_r_bias).transpose(1, 2), r)  # [B, H, L, K]
        bias = torch.add(mask.to(pos_scores.dtype), rel_shift(pos_scores), alpha=self.scale)  # no-op cast outside autocast
        out = F.scaled_dot_product_attention(
            (q + self.r_w_bias).transpose(1, 2),
            k,
            v,
            attn_mask=bias,
            dropout_p=self.dropatt if self.training else 0.0,
            scale=self.scale,
        )  # [B, H, L, D]
        out = self.drop(self.o_net(out.transpose(1, 2).reshape(B, L, H * D)))
        return h + out if self.pre_lnorm else self.layer_norm(h + out)
