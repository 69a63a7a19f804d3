"""Document boundaries inside the token streams: where each row's documents begin, and what a query may see.

Corpora are collections of documents, and a stream row runs through many of them. With
``memory.doc_boundaries=reset`` a token attends only to earlier tokens of its own document: keys of the memory
and of the segment that lie before the start of the query's document are masked. Masking alone is exact: the
relative distances inside a document are unchanged and the keys of other documents get zero weight, so a
document packed mid-row after others gets the same per-token losses as the same document read alone from an
empty memory. A row's memory thereby restarts where its new document starts, while the other rows keep theirs.
``ignore`` reads every row as one endless text, as Dai et al. (2019) do.

A segment's documents are described by :class:`Documents`: each token's position in its document (0 where one
begins), and one host-side number that tells the model, without reading the device, whether any key must be
hidden at all (a batch that hides nothing uses the plain [L, M+L] mask at the plain cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

MODES = ("reset", "ignore")
BUCKETS = (32, 128, 512)  # position-in-document buckets of the per-document report: 0-31, 32-127, 128-511, 512+


@dataclass
class Documents:
    """Where each row's documents begin in one segment of ``L`` inputs.

    ``pos`` [B, L] int64: each input's position in its document (0: a document begins there).
    ``latest_start``: the largest ``i - pos[b, i]`` over rows and inputs, i.e. the segment index (negative: that
    many tokens before the segment) of the latest document start that an input belongs to. Kept on the host, so
    the model decides without a device read whether its memory and segment hold keys of another document.
    ``target_pos`` [B, L]: the targets' positions in their documents (the loader gives it; the per-document
    evaluation report reads it), or None.

    A plain (not frozen) dataclass, so that Lightning moves its tensors to the device with the batch.
    """

    pos: Tensor
    latest_start: int
    target_pos: Tensor | None = None

    @classmethod
    def from_positions(cls, pos: Tensor, target_pos: Tensor | None = None) -> Documents:
        """From positions alone (reads ``latest_start`` from the device once: not for a training hot path)."""
        if pos.dim() != 2:
            raise ValueError(f"document positions must be [B, L], got shape {tuple(pos.shape)}")
        index = torch.arange(pos.size(1), device=pos.device)
        return cls(pos, int((index - pos).max()), target_pos)


def split_batch(batch: tuple | list) -> tuple[Tensor, Tensor | None, Documents | None]:
    """``(x, y)`` or ``(x, y, documents)`` (what :class:`xl.data.SegmentLoader` yields), each maybe followed by the
    targets' UTF-8 lengths (:func:`target_bytes`), as ``(x, y, documents)``."""
    rest = batch[2:-1] if target_bytes(batch) is not None else batch[2:]
    if len(batch) < 2 or len(rest) > 1 or (rest and not isinstance(rest[0], Documents)):
        raise ValueError("a segment batch is (x, y) or (x, y, Documents), either followed by the targets' bytes")
    return batch[0], batch[1], rest[0] if rest else None


def target_bytes(batch: tuple | list) -> Tensor | None:
    """The targets' UTF-8 lengths ``[B, L]`` that end a batch of a split where the tokenizer met text its vocabulary
    lacks (an ``<unk>`` target: the text it stands for), or None: the tokenizer's per-id table counts the targets
    (:class:`xl.data.metrics.LMMetrics`, which also charges the spelling of each ``<unk>`` of such a split)."""
    return batch[-1] if len(batch) > 2 and isinstance(batch[-1], Tensor) else None


def positions(starts: Tensor, before: Tensor | None = None) -> Tensor:
    """Each token's position in its document, [B, T] int64, from flags [B, T] that say where documents begin.

    ``before`` [B]: tokens of each row's current document read before these; None: zero (a document begins at
    the first token).
    """
    index = torch.arange(starts.size(1), device=starts.device)
    origin = torch.zeros(starts.size(0), dtype=torch.long, device=starts.device) if before is None else -before
    start = torch.where(starts.bool(), index, origin[:, None]).cummax(dim=1).values
    return index - start


def stream_positions(doc_starts: np.ndarray | None, flat: np.ndarray) -> np.ndarray:
    """Positions in their documents of the tokens at ``flat`` indices of a split whose documents begin at the
    sorted offsets ``doc_starts`` (None or empty: one document from offset 0)."""
    if doc_starts is None or not len(doc_starts):
        return flat.astype(np.int64)
    latest = np.searchsorted(doc_starts, flat, side="right") - 1
    return flat - np.where(latest >= 0, doc_starts[np.maximum(latest, 0)], 0)


def key_offsets(m_len: int, q_len: int, device: torch.device, spans: tuple[tuple[int, int], ...] = ()) -> Tensor:
    """Per key of the [memory ∘ segment] context (``m_len`` memory keys), the offset from the segment's first token
    of the oldest position it holds: -m_len … -1 for a memory of single states, 0 … L-1 for the segment. The first
    memory keys may each stand for several positions (``spans``: runs ``(keys, positions per key)``, oldest first,
    as :class:`xl.model.memory.Context` gives them): a run's k-th key from its newest begins k·width positions before
    what follows the run (the compressive memory's slots each summarise a whole group of ``cmem_rate`` states)."""
    offsets = torch.arange(-m_len, q_len, device=device)
    begin = m_len - sum(keys for keys, _ in spans)  # the single states: offsets -begin … -1
    end = begin
    for keys, width in reversed(spans):  # newest run first
        first = m_len - end - keys  # the run's keys' indices: first … first+keys-1
        offsets[first:first + keys] = -begin - width * torch.arange(keys, 0, -1, device=device)
        begin, end = begin + keys * width, end + keys
    return offsets


def document_mask(mask: Tensor, pos: Tensor, m_len: int, spans: tuple[tuple[int, int], ...] = ()) -> Tensor:
    """The additive mask [B, 1, L, M+L] (broadcast over heads): ``mask`` [L, M+L] with every key that begins
    before its query's document start also hidden (:func:`key_offsets`: a key that stands for several positions is
    seen only if all of them lie in the query's document). A query always keeps itself (its document begins at or
    before it)."""
    q_len = mask.size(0)
    first = torch.arange(q_len, device=pos.device) - pos  # offset of each query's document start, [B, L]
    hidden = key_offsets(m_len, q_len, pos.device, spans) < first[..., None]  # [B, L, K]
    return torch.where(hidden, float("-inf"), mask)[:, None]


def needs_mask(documents: Documents | None, reach: int) -> bool:
    """Whether any key of a context that reaches ``reach`` positions before the segment (the memory's length; a key
    that stands for several positions counts them) lies in another document than some query's."""
    return documents is not None and reach + documents.latest_start > 0


class DocumentStats:
    """Scored per-token NLLs grouped by document and by position in document, accumulated on the device.

    A row's document is cut at each target that begins a new one (position 0); the piece that runs on past a
    segment is carried to the next. ``finish`` closes the open pieces. A document split over two rows (or cut
    by the start of scoring) counts as two.
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        self.edges = torch.tensor(BUCKETS, device=device)
        zeros = torch.zeros(len(BUCKETS) + 1, dtype=torch.float64, device=device)
        self.bucket_sum, self.bucket_count = zeros, zeros.clone()
        self.open_sum = torch.zeros(rows, dtype=torch.float64, device=device)
        self.open_count = torch.zeros(rows, dtype=torch.float64, device=device)
        self.docs = torch.zeros((), dtype=torch.float64, device=device)  # closed pieces
        self.doc_mean_sum = torch.zeros((), dtype=torch.float64, device=device)  # sum of their mean NLLs

    def update(self, nll: Tensor, target_pos: Tensor) -> None:
        """``nll`` [B, L]: per-token NLL of the targets; ``target_pos`` [B, L]: their positions in their documents."""
        nll = nll.double()
        bucket = torch.bucketize(target_pos, self.edges, right=True)
        self.bucket_sum.index_add_(0, bucket.flatten(), nll.flatten())
        self.bucket_count.index_add_(0, bucket.flatten(), torch.ones_like(nll).flatten())
        piece = (target_pos == 0).long().cumsum(1)  # 0: continues the open piece
        sums = nll.new_zeros(nll.size(0), nll.size(1) + 1).scatter_add_(1, piece, nll)
        counts = nll.new_zeros(sums.shape).scatter_add_(1, piece, torch.ones_like(nll))
        sums[:, 0] += self.open_sum
        counts[:, 0] += self.open_count
        last = piece[:, -1:]
        closed = (torch.arange(sums.size(1), device=nll.device) < last) & (counts > 0)
        self._close(sums, counts, closed)
        self.open_sum, self.open_count = sums.gather(1, last)[:, 0], counts.gather(1, last)[:, 0]

    def _close(self, sums: Tensor, counts: Tensor, closed: Tensor) -> None:
        self.docs += closed.sum()
        self.doc_mean_sum += torch.where(closed, sums / counts.clamp(min=1), 0.0).sum()

    def finish(self) -> dict[str, Tensor]:
        """Close the open pieces; sums and counts (reduce them across ranks before :func:`summary`)."""
        self._close(self.open_sum, self.open_count, self.open_count > 0)
        self.open_sum.zero_()
        self.open_count.zero_()
        return {"docs": self.docs, "doc_mean_sum": self.doc_mean_sum, "bucket_sum": self.bucket_sum,
                "bucket_count": self.bucket_count}


def bucket_names() -> list[str]:
    """``0-31``, ``32-127``, …, ``512+``: the position ranges of the buckets."""
    return [f"{lo}-{hi - 1}" for lo, hi in zip((0, *BUCKETS), BUCKETS, strict=False)] + [f"{BUCKETS[-1]}+"]


def summary(totals: dict[str, Tensor]) -> dict[str, float]:
    """Mean NLLs (nats) from :meth:`DocumentStats.finish`'s sums: ``docs``, ``doc_mean`` (each document weighs
    the same) and ``pos_<range>`` per bucket (NaN for an empty bucket)."""
    docs = float(totals["docs"])
    out = {"docs": docs, "doc_mean": float(totals["doc_mean_sum"]) / docs if docs else math.nan}
    for name, s, n in zip(bucket_names(), totals["bucket_sum"].tolist(), totals["bucket_count"].tolist(), strict=True):
        out[f"pos_{name}"] = s / n if n else math.nan
    return out
