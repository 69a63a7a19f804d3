"""The retrieval store of one layer: per batch row and per head, the keys and values of the positions that left the
layer's local window, oldest overwritten first once it is full.

State (rows first, so that a generic store can move, pack and checkpoint it): ``[keys, values, count]``

- ``keys`` [B, H, N, D]: unit-length keys (normalised on writing, Wu et al., 2022, section 3.2), in the store's dtype;
- ``values`` [B, H, N, D]: the values as the layer projected them;
- ``count`` [B] int64: entries written to the row since its document began. The row's entries sit in slots
  ``0 … min(count, N) - 1``; the entry written m-th (from 0) sits in slot ``m % N`` (a ring buffer: a write touches
  only the slots it fills, however large the store).

What enters, and when (:func:`write`): the entries that leave the local window, oldest first, at the end of the
segment that pushed them out (the cache's rule, :func:`xl.model.eviction.leaving`); without a cache (``mem_len = 0``)
that is the whole segment after each step, as in the paper. A store therefore never holds a position the local
attention still sees, and the same text read in segments of any lengths (one token at a time included) writes the
same entries to the same slots.

Documents: a row holds only entries of its current document. When a row's document begins at or after the first
entry of a write, the row forgets its entries and keeps only the new ones of the new document (those of the old one
that leave later are dropped: no later query of the row may see them). The other rows keep theirs. A query sees its
row's entries only if its own document began before its segment (:func:`sees_store`); the first queries of a
document that begins inside the segment see none (the whole document is still in the local window).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

KEYS, VALUES, COUNT = range(3)


def empty(batch: int, n_head: int, size: int, d_head: int, *, dtype: torch.dtype,
          device: torch.device | str = "cpu") -> list[Tensor]:
    """The state of an empty store of ``size`` entries per row and head."""
    if size < 1:
        raise ValueError(f"a retrieval store holds at least 1 entry per row, got size {size}")
    shape = (batch, n_head, size, d_head)
    return [torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(batch, dtype=torch.long, device=device)]


def fill(state: list[Tensor]) -> Tensor:
    """Entries each row holds, [B] int64 (they sit in slots 0 … fill - 1)."""
    return state[COUNT].clamp(max=state[KEYS].size(2))


def nbytes_per_row(n_head: int, d_head: int, size: int, dtype: torch.dtype) -> int:
    """Bytes one row's store takes in one layer: keys and values, and the row's count."""
    return 2 * n_head * size * d_head * torch.empty((), dtype=dtype).element_size() + 8


def write(state: list[Tensor], keys: Tensor, values: Tensor, doc_start: Tensor | None = None) -> list[Tensor]:
    """Append the entries ``keys``/``values`` [B, H, n, D] (the positions that left the window, oldest first) to every
    row, in place (a store is too large to copy every segment), and return the state.

    ``doc_start`` [B] int64: per row, the index among the n entries where the row's current document begins; a row
    with ``doc_start >= 0`` forgets its entries and keeps the new ones from that index on (none if it is ``>= n``).
    Negative, or None for every row: the document began before these entries, which are appended. Beyond the store's
    size only the newest entries are kept. Keys are stored normalised, both in the store's dtype; nothing written
    carries a gradient.
    """
    store_k, store_v, count = state
    B, H, N, D = store_k.shape
    if keys.shape[:2] != (B, H) or keys.size(3) != D or values.shape != keys.shape:
        raise ValueError(f"entries to write must be [{B}, {H}, n, {D}] keys and values like the store, got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    n = keys.size(2)  # may be 0 (nothing left the window yet): a row whose document began still forgets
    trim = max(0, n - N)  # more entries than the store holds: the oldest are overwritten at once, so never stored
    with torch.no_grad():
        if doc_start is None:
            skip = torch.zeros_like(count)
        else:
            reset = doc_start >= 0
            skip = torch.where(reset, doc_start.clamp(0, n), 0)  # leading entries of the old document
            count = torch.where(reset, 0, count)
        # Entry j is the row's (count + j - skip)-th: slot (count + j - skip) % N. The stored ones (j >= trim) are at
        # most N consecutive entries, so their slots differ; those of an old document land beyond the row's fill.
        slots = (count - skip)[:, None] + torch.arange(trim, n, device=count.device)
        new_k = F.normalize(keys[:, :, trim:].detach().to(store_k.dtype), dim=-1)
        new_v = values[:, :, trim:].detach().to(store_v.dtype)
        if store_k.is_contiguous() and store_v.is_contiguous():
            # Whole rows of D values into the flat [B·H·N, D] views: what torch's CPU kernels write fastest, in
            # every dtype (scatter_ into a bfloat16 store costs more than the segment's search; python -m
            # xl.bench.knn --only segment --dtype bfloat16 times the write).
            rows = flat_rows(B, H, N, (slots % N)[:, None])
            store_k.view(B * H * N, D).index_copy_(0, rows, new_k.reshape(-1, D))
            store_v.view(B * H * N, D).index_copy_(0, rows, new_v.reshape(-1, D))
        else:
            index = (slots % N)[:, None, :, None].expand(B, H, n - trim, D)
            store_k.scatter_(2, index, new_k)
            store_v.scatter_(2, index, new_v)
        state[COUNT] = count + n - skip
    return state


def flat_rows(B: int, H: int, N: int, slots: Tensor) -> Tensor:
    """The rows of a store's flat ``[B·H·N, D]`` view that hold ``slots`` [B, H or 1, ...] of each row and head,
    flattened (slots given once per row stand for every head)."""
    heads = torch.arange(B * H, device=slots.device).view(B, H, *[1] * (slots.dim() - 2))
    return (heads * N + slots).flatten()


def reset_rows(state: list[Tensor], rows: Tensor) -> list[Tensor]:
    """Forget every entry of the rows ``rows`` ([B] bool), in place; the other rows keep theirs."""
    state[COUNT] = torch.where(rows, 0, state[COUNT])
    return state


def doc_start_of_leaving(pos: Tensor | None, held: int) -> Tensor | None:
    """For :func:`write`: where each row's current document begins among the entries leaving after a segment whose
    inputs have the positions ``pos`` [B, L] in their documents (:class:`xl.model.documents.Documents`), over a local
    window that held ``held`` positions before the segment (the leaving entries begin with its oldest). None: the
    rows are endless texts."""
    if pos is None:
        return None
    last = pos.size(1) - 1
    return (last - pos[:, last]) + held


def sees_store(pos: Tensor | None) -> Tensor | None:
    """Which queries [B, L] may see their row's store: those whose document began before the segment (positions
    ``pos`` [B, L] in their documents). None: all of them."""
    if pos is None:
        return None
    return pos > torch.arange(pos.size(1), device=pos.device)
