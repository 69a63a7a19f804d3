"""One-token decoding of a model with a retrieval memory (:mod:`xl.memory.knn.memory`): the generic decoder
(:class:`xl.model.decoding.IncrementalDecoder`), whose fed tokens also attend over the stores, and which writes the
stores as positions leave its window.

The forward pass writes a store with the keys and values of the positions that leave the window, at the end of the
segment that pushed them out; the decoder writes the same keys and values (those it holds for its window) when the
same positions leave it, one token at a time. The store after a text is therefore the same, and each fed token gets
the logits of the forward pass read in segments of any length. Documents: :meth:`KnnDecoder.reset_rows` forgets the
rows' entries at once, and the old document's positions that leave the window afterwards are not written (the
store's rule, :func:`xl.memory.knn.store.write`). Needs a window (``mem_len >= 1``), as the generic decoder does.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from xl.memory.knn import store
from xl.model.decoding import IncrementalDecoder

if TYPE_CHECKING:
    from xl.model.attention import Extension
    from xl.model.transformer import TransformerXL


class KnnDecoder(IncrementalDecoder):
    """The generic decoder and the memory's stores (one ``[keys, values, count]`` per retrieval layer)."""

    def __init__(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int, same_length: bool) -> None:
        super().__init__(model, batch_size, window, clamp_len, same_length)
        self.memory = model.memory
        state = self.memory.init(batch_size, model.device, model.config.memory_dtype(model.dtype))
        self.prefilled(state)

    def prefilled(self, mems: list[Tensor]) -> None:
        n = self.model.config.n_layer
        self.state = list(mems[n:])  # the stores, written from here on
        self.stores = self.memory.stores(mems[:n] + self.state)

    def extensions(self) -> list[Extension | None]:
        return [None if e is None else functools.partial(e, documents=None)
                for e in self.memory.extensions([None] * self.model.config.n_layer + self.state)]

    def _reset_rows(self, rows: Tensor) -> None:
        super()._reset_rows(rows)
        for entries in self.stores:
            store.reset_rows(entries, rows.to(entries[store.COUNT].device))
        self._sync()

    def _leave(self, gone: int) -> None:
        if gone:
            # Per row, where its current document begins among the leaving positions (negative: before them).
            doc_start = torch.from_numpy(self.doc_start - self.start).to(self.model.device)
            leaving = slice(self.start, self.start + gone)
            for layer, entries in zip(self.memory.layers, self.stores, strict=True):
                store.write(entries, self.k_buf[layer][:, :, leaving], self.v_buf[layer][:, :, leaving], doc_start)
            self._sync()
        super()._leave(gone)

    def _sync(self) -> None:
        """The state's tensors from the stores (a write replaces a store's count)."""
        self.state = [t for entries in self.stores for t in entries]
