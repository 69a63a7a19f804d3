"""The ordered loader: contiguous streams cut into consecutive segments, never shuffled.

Transformer-XL carries memory from segment t to segment t+1, so row b of batch t+1 must continue exactly where
row b of batch t ended. The loader is the object ``train_dataloader()`` returns, because Lightning saves and
restores ``state_dict()`` only of that object; it is not a ``DataLoader``, so Lightning cannot slip a
``DistributedSampler`` in or read ahead with workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from xl.data.errors import DataError
from xl.data.metrics import IGNORE_INDEX
from xl.model.documents import Documents, stream_positions

# (x, y), with the rows' Documents where the loader knows them, then the targets' UTF-8 lengths where it has them
Batch = tuple[torch.Tensor | Documents, ...]


def split_streams(ids: np.ndarray, batch_size: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
    """This rank's ``[batch_size, T]`` view of ``ids`` cut into ``batch_size * world_size`` equal contiguous rows.

    The tail that does not fill a whole row is dropped; rank r owns rows ``r*batch_size … (r+1)*batch_size - 1``,
    so every kept token lies in exactly one row of one rank.
    """
    assert batch_size >= 1, "data.batch_size is checked where it is set"
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world size {world_size}; check trainer.devices and trainer.num_nodes")
    if ids.ndim != 1:
        raise DataError(f"token ids must be one-dimensional, got shape {ids.shape}; rebuild the data cache")
    n_rows = batch_size * world_size
    row_len = len(ids) // n_rows
    rows = ids[: n_rows * row_len].reshape(n_rows, row_len)
    return rows[rank * batch_size : (rank + 1) * batch_size]


class SegmentLoader:
    """Yields ``(x, y)`` int64 tensors ``[B, L]``: ``x = rows[:, tL : tL+L]`` and ``y`` the same shifted by one; given
    ``doc_starts`` (the sorted offsets in ``ids`` where documents begin), ``(x, y, documents)`` with the
    :class:`xl.model.documents.Documents` of every row (positions of the inputs and targets in their documents); given
    ``target_bytes`` (each position's UTF-8 length, aligned with ``ids``), the batch ends with the targets' lengths
    ``[B, L]`` (int64), read by :func:`xl.model.documents.target_bytes`; given ``scored`` (sorted ``[start, end)`` spans
    of offsets in ``ids``), the targets outside them are ``IGNORE_INDEX``, which the loss and the metrics leave out.

    Every token but the last of each row is an input once; the last segment may be shorter than ``tgt_len``.
    The position (the next segment to yield) is reset by each ``iter()`` - Lightning stops a sized loader after
    ``len()`` batches without exhausting it - unless ``load_state_dict`` has just set it.
    """

    def __init__(
        self, ids: np.ndarray, batch_size: int, tgt_len: int, rank: int = 0, world_size: int = 1, name: str = "train",
        epoch_length: Callable[[], int | None] | None = None, doc_starts: np.ndarray | None = None,
        target_bytes: np.ndarray | None = None, scored: np.ndarray | None = None,
    ) -> None:
        """``epoch_length``: how many segments the trainer reads per epoch (``limit_train_batches``), if fewer."""
        if tgt_len < 1:
            raise DataError(f"data.tgt_len must be at least 1, got {tgt_len}")
        self.ids = ids
        self.rows = split_streams(ids, batch_size, rank, world_size)
        if self.rows.shape[1] < 2:
            raise DataError(
                f"the {name} split has {len(ids)} tokens, too few for {batch_size * world_size} rows of at least 2 "
                f"(batch size {batch_size} x {world_size} devices); reduce data.batch_size/data.eval_batch_size "
                "or use a bigger corpus"
            )
        self.batch_size, self.tgt_len, self.rank, self.world_size = batch_size, tgt_len, rank, world_size
        self.epoch_length = epoch_length
        self.doc_starts = None if doc_starts is None else np.asarray(doc_starts, dtype=np.int64)
        if target_bytes is not None and target_bytes.shape != ids.shape:
            raise DataError(f"the {name} split has {len(ids)} tokens but {len(target_bytes)} byte counts; rebuild the "
                            "data cache (delete its folder)")
        self.byte_rows = None if target_bytes is None else split_streams(target_bytes, batch_size, rank, world_size)
        self.row_starts = (rank * batch_size + np.arange(batch_size)) * self.rows.shape[1]  # offsets in ids
        self.scored = None if scored is None else np.asarray(scored, dtype=np.int64).reshape(-1, 2)
        self._position = 0
        self._resuming = False

    def __len__(self) -> int:
        return math.ceil((self.rows.shape[1] - 1) / self.tgt_len)

    def segment(self, t: int) -> Batch:
        """Segment ``t`` as contiguous int64 copies (safe to pin, independent of the memory map)."""
        start = t * self.tgt_len
        end = min(start + self.tgt_len, self.rows.shape[1] - 1)
        x = torch.from_numpy(np.array(self.rows[:, start:end], dtype=np.int64))
        y = torch.from_numpy(np.array(self.rows[:, start + 1 : end + 1], dtype=np.int64))
        if self.scored is not None:
            y[~torch.from_numpy(self.in_spans(self.row_starts[:, None] + np.arange(start + 1, end + 1)))] = IGNORE_INDEX
        extra: tuple[torch.Tensor, ...] = ()
        if self.byte_rows is not None:
            extra = (torch.from_numpy(np.array(self.byte_rows[:, start + 1 : end + 1], dtype=np.int64)),)
        if self.doc_starts is None:
            return x, y, *extra
        pos = stream_positions(self.doc_starts, self.row_starts[:, None] + np.arange(start, end + 1))
        latest = int((np.arange(end - start) - pos[:, :-1]).max())
        pos = torch.from_numpy(pos)
        return x, y, Documents(pos[:, :-1].contiguous(), latest, pos[:, 1:].contiguous()), *extra

    def in_spans(self, flat: np.ndarray) -> np.ndarray:
        """Whether each offset of ``flat`` lies inside one of the ``scored`` spans."""
        span = np.searchsorted(self.scored[:, 0], flat, side="right") - 1
        return (span >= 0) & (flat < self.scored[np.maximum(span, 0), 1])

    def __iter__(self) -> Iterator[Batch]:
        if not self._resuming:
            self._position = 0
        self._resuming = False
        return self._segments(self._position)

    def _segments(self, start: int) -> Iterator[Batch]:
        for t in range(start, len(self)):
            self._position = t + 1
            yield self.segment(t)

    def state_dict(self) -> dict[str, Any]:
        """The next segment to read; at the end of an epoch that is the next epoch's first (Lightning starts a new
        epoch when it resumes from a checkpoint taken at an epoch's last batch, and reads this loader from there)."""
        limit = (self.epoch_length and self.epoch_length()) or len(self)
        return {
            "position": 0 if self._position >= min(limit, len(self)) else self._position,
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` start at the saved position; the rank is not compared (rank 0's state is saved)."""
        settings = {
            "batch_size": "data.batch_size",
            "tgt_len": "data.tgt_len",
            "world_size": "number of devices (trainer.devices x trainer.num_nodes)",
        }
        for key, setting in settings.items():
            if state[key] != getattr(self, key):
                raise DataError(
                    f"the checkpoint's data position was saved with {key}={state[key]} but this run has "
                    f"{getattr(self, key)}; resume with the same {setting} or start without the checkpoint"
                )
        if not 0 <= state["position"] <= len(self):
            raise DataError(
                f"the checkpoint's data position {state['position']} is outside this corpus's {len(self)} segments; "
                "resume with the same data settings and corpus or start without the checkpoint"
            )
        self._position = state["position"]
        self._resuming = True
