"""Adaptive input embedding and adaptive softmax with projections, for word-level vocabularies.

The vocabulary, sorted by frequency, is cut into clusters at ``cutoffs`` (WikiText-103 in the
Transformer-XL paper: 20000/40000/200000 of 267,735 words). Cluster i has width
``d_embed // div_val**i`` (``d_embed`` is ``d_model`` unless set; Baevski & Auli, 2019, adaptive input;
Grave et al., 2017, adaptive softmax) and a projection to ``d_model`` where the width differs, or on
every cluster with ``proj_all`` (the original Transformer-XL's layout, which projects even a cluster
already ``d_model`` wide when ``div_val > 1``). With ``div_val = 1`` every cluster has the same width
and the input side has one projection, shared by all clusters (one table, one projection, as in the
original); the softmax keeps one projection per cluster. The softmax's head scores the
first cluster's words plus one entry per tail cluster; a word of tail cluster i has
``log p = log p_head(cluster i) + log p_i(word)``, so probabilities are exact and sum to one.

``torch.nn.AdaptiveLogSoftmaxWithLoss`` has no output biases per word and cannot share its
weights with an adaptive input (its head mixes words and clusters in one matrix and its tail
projections are transposed), which the paper's tied WT103 models need: hence these two modules.
With ``tie_weights`` the softmax's word vectors are the embedding's, and ``tie_projs`` (one flag for
every cluster, or one per cluster) says which of its projections are the embedding's too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from xl.model.config import XLConfig


def cluster_bounds(vocab_size: int, cutoffs: Sequence[int]) -> list[int]:
    """``[0, *cutoffs, vocab_size]``: cluster i holds ids ``bounds[i] <= id < bounds[i+1]``."""
    return [0, *cutoffs, vocab_size]


def cluster_widths(d_model: int, n_clusters: int, div_val: int) -> list[int]:
    return [d_model // div_val**i for i in range(n_clusters)]


def projections(d_model: int, widths: Sequence[int], proj_all: bool) -> list[nn.Module]:
    """One ``nn.Linear(width, d_model)`` per cluster, or ``nn.Identity`` where a cluster is ``d_model`` wide and
    ``proj_all`` is off."""
    return [nn.Linear(w, d_model, bias=False) if proj_all or w != d_model else nn.Identity() for w in widths]


def tied_clusters(tie_projs: bool | Sequence[bool], n_clusters: int) -> list[bool]:
    """``tie_projs`` as one flag per cluster (a single flag holds for every cluster)."""
    if isinstance(tie_projs, bool):
        return [tie_projs] * n_clusters
    return [bool(t) for t in tie_projs]


def widen(x: Tensor) -> Tensor:
    """Low-precision scores upcast to float32 for the softmax; float32/float64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class AdaptiveEmbedding(nn.Module):
    """Token embedding whose width shrinks by ``div_val`` per frequency cluster, projected to ``d_model``."""

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int], div_val: int,
                 d_embed: int | None = None, proj_all: bool = False) -> None:
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        widths = cluster_widths(d_model if d_embed is None else d_embed, len(self.bounds) - 1, div_val)
        self.tables = nn.ModuleList(
            nn.Embedding(hi - lo, w) for lo, hi, w in zip(self.bounds, self.bounds[1:], widths, strict=False)
        )
        # div_val 1: the clusters are one table cut in pieces of one width, projected by one shared projection
        # (stored under every cluster's name), after the pieces are summed.
        self.shared = div_val == 1
        projs = projections(d_model, widths[:1], proj_all) * len(widths) if self.shared else \
            projections(d_model, widths, proj_all)
        self.projs = nn.ModuleList(projs)

    @classmethod
    def of(cls, config: XLConfig) -> AdaptiveEmbedding:
        """The embedding of a model config."""
        return cls(config.vocab_size, config.d_model, config.cutoffs, config.div_val, config.d_embed, config.proj_all)

    def forward(self, ids: Tensor) -> Tensor:
        # Every cluster is looked up for every token (ids clamped into range) and masked, rather than
        # gathering each cluster's tokens: no data-dependent shapes, so no host-device sync. The extra
        # work is one small projection per cluster (one in all with div_val 1), far below one transformer layer.
        out = None
        for lo, hi, table, proj in zip(self.bounds, self.bounds[1:], self.tables, self.projs, strict=False):
            part = table((ids - lo).clamp(0, hi - lo - 1))
            part = part if self.shared else proj(part)
            part = part.masked_fill(((ids < lo) | (ids >= hi))[..., None], 0.0)
            out = part if out is None else out + part
        return self.projs[0](out) if self.shared else out


class AdaptiveLogSoftmax(nn.Module):
    """Exact log-probabilities over a clustered vocabulary; the loss touches only each target's cluster.

    ``forward(hidden)`` gives the full ``[..., vocab]`` log-probabilities (generation, scoring a few
    positions). ``nll(hidden, targets)`` is what training uses: it builds the head's scores for every
    position (``N × (cutoffs[0] + n_tail_clusters)``) and, per tail cluster, scores only for the positions
    whose target lies in it, so ``N × vocab`` is never materialised.
    """

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int], div_val: int,
                 d_embed: int | None = None, proj_all: bool = False) -> None:
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        n_clusters = len(self.bounds) - 1
        widths = cluster_widths(d_model if d_embed is None else d_embed, n_clusters, div_val)
        # Projection i is stored as the input side's nn.Linear(width, d_model) so that it can be tied to
        # the adaptive embedding's; the output side applies its transpose.
        self.projs = nn.ModuleList(projections(d_model, widths, proj_all))
        self.tables = nn.ModuleList(
            nn.Linear(w, hi - lo) for lo, hi, w in zip(self.bounds, self.bounds[1:], widths, strict=False)
        )
        self.cluster = nn.Linear(widths[0], n_clusters - 1) if n_clusters > 1 else None
        # Where each tail cluster starts, kept on the model's device (not rebuilt from a list every step).
        self.register_buffer("tail_starts", torch.tensor(self.bounds[1:-1], dtype=torch.long), persistent=False)

    @classmethod
    def of(cls, config: XLConfig) -> AdaptiveLogSoftmax:
        """The softmax of a model config."""
        return cls(config.vocab_size, config.d_model, config.cutoffs, config.div_val, config.d_embed, config.proj_all)

    def tie_to(self, embedding: AdaptiveEmbedding, projections: bool | Sequence[bool]) -> None:
        """Share the word vectors with the adaptive input, and the projections of the clusters ``projections`` says
        (one flag for all, or one per cluster)."""
        for out_table, in_table in zip(self.tables, embedding.tables, strict=True):
            out_table.weight = in_table.weight
        for i, tied in enumerate(tied_clusters(projections, len(self.projs))):
            if tied:
                self.projs[i] = embedding.projs[i]

    def _scores(self, hidden: Tensor, i: int) -> Tensor:
        """Scores of cluster i's words (for i = 0 followed by the tail clusters' entries)."""
        proj = self.projs[i]
        h = hidden if isinstance(proj, nn.Identity) else hidden @ proj.weight
        scores = self.tables[i](h)
        if i == 0 and self.cluster is not None:
            scores = torch.cat([scores, self.cluster(h)], dim=-1)
        return widen(scores)

    def forward(self, hidden: Tensor) -> Tensor:
        """Log-probabilities ``[..., vocab]`` of every word."""
        head = self._scores(hidden, 0).log_softmax(-1)
        head_size = self.bounds[1]
        parts = [head[..., :head_size]]
        for i in range(1, len(self.tables)):
            cluster_logp = head[..., head_size + i - 1, None]
            parts.append(cluster_logp + self._scores(hidden, i).log_softmax(-1))
        return torch.cat(parts, dim=-1)

    def nll(self, hidden: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
        """Token-mean negative log-likelihood over ``targets != ignore_index`` (0 when there are none)."""
        hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        valid = targets != ignore_index
        targets = targets.masked_fill(~valid, 0)
        cluster = torch.bucketize(targets, self.tail_starts, right=True)  # 0 for the head, i for tail cluster i
        head_size = self.bounds[1]
        head_index = torch.where(cluster == 0, targets, head_size + cluster - 1)
        logp = self._scores(hidden, 0).log_softmax(-1).gather(1, head_index[:, None]).squeeze(1)
        for i in range(1, len(self.tables)):
            # Only this cluster's positions: a data-dependent shape, hence one host sync per tail cluster.
            # Run even with no positions: every parameter then gets a (zero) gradient, which DDP requires.
            rows = ((cluster == i) & valid).nonzero().squeeze(1)
            tail = self._scores(hidden[rows], i).log_softmax(-1)
            word = (targets[rows] - self.bounds[i])[:, None]
            logp = logp.index_add(0, rows, tail.gather(1, word).squeeze(1))
        return -(logp * valid).sum() / valid.sum().clamp(min=1)
