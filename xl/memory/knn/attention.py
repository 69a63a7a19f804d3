"""The gated retrieval attention of Memorizing Transformers (Wu et al., 2022, section 3.1), and where it goes.

In a chosen layer, each query attends over the k entries it retrieved from the store (:mod:`xl.memory.knn.search`)
with a softmax of its own, and the result ``V_m`` is mixed per head with the local attention's output ``V_c``::

    out = g ⊙ V_m + (1 - g) ⊙ V_c,    g = sigmoid(b_g),  one learned b_g per head

The scores are ``scale_h · q̂ · k̂``: unit query against unit key (the keys are stored normalised; the query is the
local attention's content query ``q + u`` normalised here), times a learned per-head scale, the way the authors'
code scales attention over normalised keys. Retrieved keys carry no position: no relative term is added, as in the
paper ("We don't use a position bias for the retrieved memories"). With ``memory.knn_recency=true`` (not in the paper)
they carry their order instead: each entry's score gets a learned bias of its head for its rank by age among the
query's retrieved entries (0 the newest; a table of :data:`RECENCY_RANKS` ranks, whatever ``knn_top_k``, the older
ranks taking its last bias), so that a head can prefer the newest of several entries that match alike. With
``memory.knn_age=true`` (not in the paper either) each score gets ``a_h · log(1 + age)``, a learned slope per head
times the log of the entry's age (the entries written after it): a bias by how far back, the same at any ratio of
ages whatever the context's length, that entries of other sources retrieved between them do not shift. A query
that retrieved no entry (an empty store, the first segment of a document) keeps the local output unchanged: with
nothing to retrieve the layer is the plain one. Nothing flows back into the retrieved keys and values: the store
takes no gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from xl.memory.knn.search import recency_ranks

# Ranks by age with a recency bias of their own; older ranks share the last one. Fixed, not knn_top_k: evaluation may
# retrieve another number of entries with the weights trained.
RECENCY_RANKS = 32


def default_layers(n_layer: int) -> tuple[int, ...]:
    """The layer that retrieves by default, counted from 0: the one three quarters of the way up, as the paper's
    9th of 12 (index 8); the 3rd of 4 (index 2) at config S."""
    if n_layer < 1:
        raise ValueError(f"a model has at least 1 layer, got n_layer={n_layer}")
    return (math.ceil(3 * n_layer / 4) - 1,)


def initial_scale(top_k: int) -> float:
    """The per-head scale's initial value: ``log2(k² - k)`` over k attended keys, the initial scale Henry et al.
    (2020) give attention over normalised queries and keys (9.95 for k = 32); 1 for k = 1."""
    return math.log2(top_k * top_k - top_k) if top_k > 1 else 1.0


def gated_retrieval(queries: Tensor, local: Tensor, keys: Tensor, values: Tensor, valid: Tensor, gate: Tensor,
                    scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The heads' combined output [B, H, L, D] (see the module docstring).

    ``queries`` [B, H, L, D]: the content queries of the local attention (before any scaling); ``local`` [B, H, L, D]:
    its heads' outputs; ``keys``/``values`` [B, H, L, k, D]: the retrieved entries (unit keys); ``valid`` [B, H, L, k]:
    which are entries; ``gate`` [H]: the gate's logits b_g; ``scale`` [H]: the scores' scale; ``bias`` [B, H, L, k] or
None: added to the scaled scores (the recency bias, :meth:`RetrievalGate.recency_bias`). Computes in the queries'
    dtype (the layer's, or autocast's) and returns the local output's dtype.
    """
    B, H, L, D = queries.shape
    if local.shape != queries.shape or keys.shape[:3] != (B, H, L) or keys.size(-1) != D:
        raise ValueError(f"gated retrieval needs queries and local outputs [B, H, L, D] and retrieved entries "
                         f"[B, H, L, k, D]; got {tuple(queries.shape)}, {tuple(local.shape)}, {tuple(keys.shape)}")
    if values.shape != keys.shape or valid.shape != keys.shape[:-1] or gate.shape != (H,) or scale.shape != (H,):
        raise ValueError(f"gated retrieval needs values {tuple(keys.shape)}, valid {tuple(keys.shape[:-1])}, gate "
                         f"and scale ({H},); got {tuple(values.shape)}, {tuple(valid.shape)}, {tuple(gate.shape)}, "
                         f"{tuple(scale.shape)}")
    q = F.normalize(queries, dim=-1)
    keys, values = keys.detach().to(q.dtype), values.detach().to(q.dtype)
    # [B·H·L, 1, D] × [B·H·L, D, k]: each query against its own k entries.
    scores = torch.matmul(q.unsqueeze(-2), keys.transpose(-1, -2)).squeeze(-2) * scale.view(H, 1, 1).to(q.dtype)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    found = valid.any(-1, keepdim=True)  # [B, H, L, 1]
    # A query with no entry gets finite scores (so no NaN reaches the gradient) and its local output below.
    scores = scores.masked_fill(~valid, float("-inf")).masked_fill(~found, 0.0)
    weights = scores.softmax(-1)
    retrieved = torch.matmul(weights.unsqueeze(-2).to(values.dtype), values).squeeze(-2)  # V_m
    g = torch.sigmoid(gate).view(H, 1, 1).to(retrieved.dtype)
    mixed = g * retrieved + (1 - g) * local.to(retrieved.dtype)
    return torch.where(found, mixed, local.to(mixed.dtype)).to(local.dtype)


class RetrievalGate(nn.Module):
    """One retrieval layer's learned parameters, the gate's logits ``gate`` [H] (0 at first: g = 0.5, as the authors'
    code starts) and the scores' ``scale`` [H] (:func:`initial_scale` at first), applied by :func:`gated_retrieval`;
    with ``recency``, the bias ``order`` [H, RECENCY_RANKS] of each rank by age; with ``age``, the slope ``age`` [H]
    of the bias by log age (each 0 at first: no preference)."""

    def __init__(self, n_head: int, top_k: int, recency: bool = False, age: bool = False) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(n_head))
        self.scale = nn.Parameter(torch.full((n_head,), initial_scale(top_k)))
        self.order = nn.Parameter(torch.zeros(n_head, RECENCY_RANKS)) if recency else None
        self.age = nn.Parameter(torch.zeros(n_head)) if age else None

    @property
    def ordered(self) -> bool:
        """Whether the entries' ages bias their scores (a rank table or a slope)."""
        return self.order is not None or self.age is not None

    def untouched(self, local: Tensor) -> Tensor:
        """``local`` as it is, with the parameters in its graph (a zero gradient for each), for a segment where no
        query retrieves: what :func:`gated_retrieval` gives then, without the search. Distributed training (DDP)
        refuses a step in which a parameter takes no part."""
        return local + sum(p.sum() for p in self.parameters()).to(local.dtype) * 0

    def recency_bias(self, ranks: Tensor) -> Tensor:
        """The bias [B, H, L, k] of entries whose ranks by age are ``ranks`` [B, H, L, k] (0 the newest retrieved),
        a rank past the table's last taking its last bias."""
        B, H, L, k = ranks.shape
        table = self.order.view(1, H, 1, -1).expand(B, H, L, -1)
        return table.gather(-1, ranks.clamp(max=self.order.size(1) - 1))

    def age_bias(self, ages: Tensor) -> Tensor:
        """The bias [B, H, L, k] of entries of ``ages`` [B, H, L, k]: each head's slope times ``log(1 + age)``."""
        return self.age.view(1, -1, 1, 1) * torch.log1p(ages.to(self.age.dtype))

    def forward(self, queries: Tensor, local: Tensor, keys: Tensor, values: Tensor, valid: Tensor,
                ages: Tensor | None = None) -> Tensor:
        """``ages`` [B, H, L, k] (:func:`xl.memory.knn.search.entry_ages`): needed where :attr:`ordered`."""
        if self.ordered and ages is None:
            raise ValueError("a retrieval gate with a recency or age bias needs the retrieved entries' ages")
        bias = None if self.order is None else self.recency_bias(recency_ranks(ages))
        if self.age is not None:
            bias = self.age_bias(ages) if bias is None else bias + self.age_bias(ages)
        return gated_retrieval(queries, local, keys, values, valid, self.gate, self.scale, bias)
