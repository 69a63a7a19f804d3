"""Relative multi-head attention of Transformer-XL (Dai et al., 2019, section 3.3).

For a query at absolute position i and a key at position j the score is

    (q_i + u) . k_j  +  (q_i + v) . W_r R_{i-j}

term (a)+(c) is content, (b)+(d) is position. Keys and values carry no position at all, so cached
states stay valid wherever they sit. The content term runs inside
``scaled_dot_product_attention``; the position term is computed once per layer as a [L, M+L]
matrix, shifted so that each query sees its distance to every key, and handed to SDPA as an
additive mask together with the causal mask. Training on CPU, where SDPA has no kernel that returns
that mask's gradient, runs the same math through :class:`TrainingAttentionCPU` instead.

A memory may extend a layer's attention (:attr:`xl.model.memory.Context.extend`): a function ``(queries, local) ->
heads``, all [B, H, L, D], called with the content queries before Transformer-XL's biases and the local attention's
heads, whose result replaces those heads before the output projection. It runs after the local attention in every
path (the CPU training attention, SDPA, :meth:`RelMultiHeadAttention.decode_one`), under autograd.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xl.model.dropout import Dropout, keep_mask


def rel_shift(scores: Tensor) -> Tensor:
    """Turn position scores indexed by distance into scores indexed by key: a view, no copy.

    ``scores[..., i, k]`` is query i against the relative embedding of distance ``K-1-k`` (embeddings
    ordered from the farthest distance to 0). Query i sits at key position ``K-L+i``, so key j is at
    distance ``K-L+i-j``, found at ``k = j + L-1-i``: row i moves left by ``L-1-i``, which is the same
    storage read with a row step one less than the rows' stride. Entries with ``j > K-L+i`` (keys after the
    query) read on into the row's padding and then the next row. Rows may be longer than K (the last dim must
    be contiguous); with at least one spare element per row, no two entries of the view share an element, so
    it can be written through (:func:`shifted_grad`). The attention's rows have one spare element, 0: a key
    after the query then gets 0 for the next key and, beyond it, the next query's score of distance
    ``K+M+i-j+1`` (M = K-L), what the padded shift of Transformer-XL's code (``_rel_shift``) gives, and what a
    layout that shows a query later keys (memory=lmrmt) reproduces; the causal mask hides them otherwise.
    """
    *lead, q_len, k_len = scores.shape
    *lead_stride, row, col = scores.stride()
    if col != 1 or row < k_len or k_len < q_len:
        raise ValueError(f"rel_shift needs [..., L, K] scores with contiguous rows and K >= L, got {scores.shape}")
    return scores.as_strided(scores.shape, (*lead_stride, row - 1, 1), scores.storage_offset() + q_len - 1)


def shifted_grad(grad: Tensor, scale: float, stride: tuple[int, ...]) -> Tensor:
    """The gradient of ``scale · rel_shift(scores)`` for ``scores`` with this stride (contiguous rows).

    One pass, into rows one element longer than the scores' so that the shift's entries land on distinct
    elements, in the scores' order of dimensions (the layout the matmul that made them wants back);
    returned as the [..., L, K] view of it. Autograd through the views would instead build zeros of the
    scores' shape, scatter into them and copy again into that layout. Entries of ``grad`` that the mask
    hides are zero (softmax gives them no weight), so writing them is harmless.
    """
    *lead, q_len, k_len = grad.shape
    order = sorted(range(len(lead)), key=lambda d: stride[d], reverse=True)  # the scores' dims, outermost first
    padded = grad.new_empty([lead[d] for d in order] + [q_len, k_len + 1])
    rows = padded.permute(*(order.index(d) for d in range(len(lead))), -2, -1)[..., :k_len]
    rows[..., 0, : q_len - 1].zero_()  # distances beyond the first query's reach: no entry of the shift lands there
    torch.mul(grad, scale, out=rel_shift(rows))
    return rows


class PositionBias(torch.autograd.Function):
    """``mask + scale · rel_shift(pos_scores)``: the additive bias handed to SDPA."""

    @staticmethod
    def forward(ctx, pos_scores: Tensor, mask: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.stride = scale, pos_scores.stride()
        return torch.add(mask.to(pos_scores.dtype), rel_shift(pos_scores), alpha=scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return shifted_grad(grad, ctx.scale, ctx.stride), None, None


class TrainingAttentionCPU(torch.autograd.Function):
    """``softmax(scale · (q_w kᵀ + rel_shift(pos_scores)) + mask) · v``, backward written by hand.

    SDPA has no CPU kernel that returns the additive mask's gradient, so for training on CPU it runs its
    math fallback: a scaled copy of q and k, the bias added as one more tensor, then three passes over
    the [B, H, L, K] scores looking for fully hidden rows (none here: every query sees itself), and their
    backward. This is the same math with the position term and the mask added in place and the
    scores' gradient written once, into the layout of the position product. ``drop`` is the attention
    dropout's mask (0 or 1/(1-p)) or None.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, q_w: Tensor, k: Tensor, v: Tensor, pos_scores: Tensor, mask: Tensor, scale: float,
                drop: Tensor | None) -> Tensor:
        scores = torch.matmul(q_w, k.transpose(-1, -2)).add_(rel_shift(pos_scores))
        scores = torch.add(mask.to(scores.dtype), scores, alpha=scale, out=scores)
        probs = scores.softmax(-1)
        ctx.save_for_backward(q_w, k, v, scores, drop)  # the backward recomputes probs from the scores
        ctx.scale, ctx.stride = scale, pos_scores.stride()
        return torch.matmul(probs if drop is None else probs * drop, v)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q_w, k, v, scores, drop = ctx.saved_tensors
        # The softmax again, from the scores kept instead of its output (the same size), so that its gradient is
        # torch's own softmax backward, reached through autograd (before the scale).
        with torch.enable_grad():
            scores = scores.detach().requires_grad_()
            probs = scores.softmax(-1)
        grad_weights = torch.matmul(grad, v.transpose(-1, -2))
        weights = probs.detach() if drop is None else probs.detach() * drop
        if drop is not None:
            grad_weights.mul_(drop)
        grad_v = torch.matmul(weights.transpose(-1, -2), grad)
        (grad_scores,) = torch.autograd.grad(probs, scores, grad_weights)
        grad_q = torch.matmul(grad_scores, k).mul_(ctx.scale)
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q_w).mul_(ctx.scale)
        grad_pos = shifted_grad(grad_scores, ctx.scale, ctx.stride)
        return grad_q, grad_k, grad_v, grad_pos, None, None, None

#: A memory's extension of a layer's attention: (queries [B, H, L, D], local heads [B, H, L, D]) -> heads.
Extension = Callable[[Tensor, Tensor], Tensor]


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
        self.drop = Dropout(dropout)
        self.dropatt = dropatt
        self.pre_lnorm = pre_lnorm
        self.scale = 1.0 / math.sqrt(d_head)

    def forward(
        self, h: Tensor, mem: Tensor | list[Tensor], pos_emb: Tensor, mask: Tensor,
        mem_kv: tuple[Tensor, Tensor] | None = None, extend: Extension | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """h: [B, L, d] layer input; mem: [B, M, d] cached layer inputs (detached, or attached inside a window of
        memory.grad_segments), or a list of such pieces attended as one memory, oldest first (projected apart and
        joined with the segment's keys in one copy);
        pos_emb: [M+L, d] embeddings of distances M+L-1 .. 0; mask: additive (0 / -inf), [L, M+L] shared by
        every row, or [B, 1, L, M+L] per row (document boundaries, :mod:`xl.model.documents`), broadcast over heads;
        mem_kv: the memory's keys and values [B, H, M, D] if already projected (evaluation: the weights
        are fixed, and keys carry no position, so those of the previous segment stay valid); extend: the memory's
        extension of this layer's attention, or None (the module docstring).

        Returns the layer output and the keys and values [B, H, M+L, D] over memory ∘ segment.
        """
        B, L, _ = h.shape
        H, D = self.n_head, self.d_head
        # Queries come from h itself, not from a slice of the concatenation (which would be copied).
        # Layer norm acts per position, so norming memory and segment apart equals norming the concatenation.
        x = self.layer_norm(h) if self.pre_lnorm else h
        k, v = self._project_kv(x)
        # Projected apart from the segment: a detached memory then costs no input gradient (an attached one, inside a
        # window of memory.grad_segments, gets it through this projection), and in evaluation its keys/values may
        # come already projected.
        if mem_kv is not None:
            if mem_kv[0].size(2):
                k, v = torch.cat([mem_kv[0], k], dim=2), torch.cat([mem_kv[1], v], dim=2)
        else:
            pieces = [self.project_memory(m) for m in ([mem] if isinstance(mem, Tensor) else mem) if m.size(1)]
            if pieces:
                k = torch.cat([*(k_m for k_m, _ in pieces), k], dim=2)
                v = torch.cat([*(v_m for _, v_m in pieces), v], dim=2)
        K = k.size(2)
        q = self.q_net(x).view(B, L, H, D)
        # Batching over heads with the B·L queries as rows shares r across the batch.
        # A zero column after distance 0 (r_net has no bias: the score of a zero embedding), so that the shift reads
        # 0 and then the next row for the keys after a query, as Transformer-XL's padded shift does (rel_shift).
        r = F.pad(self.project_positions(pos_emb), (0, 1))  # [H, D, K + 1]
        qv = (q + self.r_r_bias).view(B * L, H, D).transpose(0, 1)  # [H, B·L, D], a view
        # [B, H, L, K], rows of K + 1: shifted inside
        pos_scores = torch.bmm(qv, r).view(H, B, L, K + 1).transpose(0, 1)[..., :K]
        q_w, dropatt = (q + self.r_w_bias).transpose(1, 2), self.dropatt if self.training else 0.0
        if pos_scores.requires_grad and h.device.type == "cpu":
            drop = keep_mask(pos_scores.shape[:-1] + (K,), dropatt, pos_scores.dtype, h.device) if dropatt else None
            out = TrainingAttentionCPU.apply(q_w, k, v, pos_scores, mask, self.scale, drop)
        else:
            bias = PositionBias.apply(pos_scores, mask, self.scale)
            out = F.scaled_dot_product_attention(q_w, k, v, attn_mask=bias, dropout_p=dropatt, scale=self.scale)
        if extend is not None:
            out = extend(q.transpose(1, 2), out)
        out = self.drop(self.o_net(out.transpose(1, 2).reshape(B, L, H * D)))
        return (h + out if self.pre_lnorm else self.layer_norm(h + out)), (k, v)

    def _project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [B, H, T, D] of (already normed) positions [B, T, d]: views of one projection."""
        B, T, _ = x.shape
        k, v = self.kv_net(x).view(B, T, 2, self.n_head, self.d_head).permute(2, 0, 3, 1, 4)
        return k, v

    def decode_one(self, h: Tensor, keys: Tensor, values: Tensor, r: Tensor, qkv_weight: Tensor,
                   masked_keys: Tensor | None = None, extend: Extension | None = None) -> Tensor:
        """One new position per row against cached projections (incremental decoding): the forward with L = 1.

        h: [B, 1, d] layer input; keys, values: [B, H, M+1, D] views of the cache whose last slot is free:
        this writes h's key and value there (cached ones carry no position, so they stay valid as the
        window slides); r: [H, D, M+1] :meth:`project_positions` of distances M .. 0, already multiplied by
        ``self.scale``; qkv_weight: :meth:`qkv_weight` (one product for query, key and value: with a few
        rows a step is bound by reading weights, and one larger product reads them faster than two).
        The query may see every key it is given (no shift), except those ``masked_keys`` [B, M+1] (True: a key of
        another document than the row's new token; never the new token itself); ``extend`` as in the forward.
        """
        B = h.size(0)
        H, D = self.n_head, self.d_head
        x = self.layer_norm(h) if self.pre_lnorm else h
        qkv = F.linear(x.view(B, -1), qkv_weight).view(B, 3, H, D)
        q = qkv[:, 0]
        keys[:, :, -1], values[:, :, -1] = qkv[:, 1], qkv[:, 2]
        # Heads as the batch of one bmm, r shared by every row (a broadcast matmul would copy r B times).
        pos_scores = torch.bmm((q + self.r_r_bias).transpose(0, 1), r).transpose(0, 1)  # [B, H, M+1]
        if masked_keys is not None:
            pos_scores = pos_scores.masked_fill(masked_keys[:, None], float("-inf"))
        out = F.scaled_dot_product_attention((q + self.r_w_bias)[:, :, None], keys, values,
                                             attn_mask=pos_scores[:, :, None], scale=self.scale)
        if extend is not None:
            out = extend(q[:, :, None], out)
        out = self.o_net(out.reshape(B, 1, H * D))
        return h + out if self.pre_lnorm else self.layer_norm(h + out)

    def project_positions(self, pos_emb: Tensor) -> Tensor:
        """W_r R of relative embeddings [K, d] as [H, D, K] (a view): heads as the batch of the position product."""
        return self.r_net(pos_emb).view(-1, self.n_head, self.d_head).permute(1, 2, 0)

    def qkv_weight(self) -> Tensor:
        """The query projection's weight stacked on the key/value projection's: [3·H·D, d], a copy."""
        return torch.cat([self.q_net.weight, self.kv_net.weight]).detach()

    def content_attention(self, x: Tensor, mem: Tensor) -> Tensor:
        """Heads' outputs [B, H, L, D] of the content attention (no position term) of queries from ``x`` [B, L, d]
        over keys/values from ``mem`` [B, T, d], with the layer's projections held fixed (detached): what a memory
        that summarises states asks of the layer (the compressive memory's reconstruction loss)."""
        B, L, _ = x.shape
        H, D = self.n_head, self.d_head
        if self.pre_lnorm:
            ln = self.layer_norm
            x, mem = (F.layer_norm(t, ln.normalized_shape, ln.weight.detach(), ln.bias.detach(), ln.eps)
                      for t in (x, mem))
        q = F.linear(x, self.q_net.weight.detach()).view(B, L, H, D) + self.r_w_bias.detach()
        k, v = F.linear(mem, self.kv_net.weight.detach()).view(B, mem.size(1), 2, H, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, scale=self.scale)

    def project_memory(self, mem: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [B, H, M, D] of cached layer inputs (layer norm is per position, so norming the
        memory apart from the segment equals norming their concatenation)."""
        mem = mem.to(self.kv_net.weight.dtype)  # a cache stored in lower precision computes in the layer's
        return self._project_kv(self.layer_norm(mem) if self.pre_lnorm else mem)

