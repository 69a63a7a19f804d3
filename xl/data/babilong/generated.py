"""``data.train_samples=stream``: a training split of ``data=babilong`` made while training, never the same twice.

Each row of the training batches (``data.batch_size`` per device, devices after one another: rank r holds rows
``r·B … r·B + B − 1``) reads its own endless stream of samples. The j-th sample of row g is a pure function of
``(data.seed, g, j)`` and the data settings: its story, the place of its facts and its background are drawn from a
random generator seeded with them alone, so any sample can be made again without the ones before it, on any machine.
A sample's story is drawn, as the cached train split's are, until its hash puts it in the train split
(:func:`xl.data.babilong.samples.split_of`), so no story of the val or test split is ever trained on (and, with
``data.train_support``, until its answer follows from the kinds of facts asked for). The tasks take
turns along a row, each row starting at another task. A sample is hidden in its background with
:func:`xl.data.babilong.samples.hide`, the background read from a random sentence of the pool (:class:`Pool`) on.

Each sample is tokenised as the token cache tokenises a document (its prompt, then its answer, a piece marked as the
answer), and a row is its samples end to end, cut into segments as :class:`xl.data.stream.SegmentLoader` cuts the
rows of a cached split: the same inputs and targets, document positions and answer-only targets
(:class:`GeneratedLoader`). The loader's state is the next segment and, for each of its rows, the sample that holds
that segment's first token and where that sample begins; a rank whose rows the state lacks (Lightning keeps rank 0's
state) finds them by making its rows' samples again from the first.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xl.data.babilong.background import MAX_UNIT_TOKENS, Sentences, units
from xl.data.babilong.samples import MAX_DRAWS, Sample, hide, split_of
from xl.data.babilong.tasks import GENERATORS, QUESTIONS_PER_STORY, kept
from xl.data.errors import DataError
from xl.data.metrics import IGNORE_INDEX
from xl.data.sources import Source
from xl.data.stream import Batch
from xl.data.tokenizers import Tokenizer
from xl.model.documents import Documents

STREAM = "stream"  # the value of data.train_samples that turns it on
POOL_TOKENS = 1 << 20  # the background pool holds at least this many tokens (and eight samples' worth)
VOCABULARY_SAMPLES = 2000  # samples of row VOCABULARY_ROW that, with the pool, a char or word vocabulary is fitted on
VOCABULARY_ROW = -1  # a row no loader reads
SEGMENTS_PER_EPOCH = 1 << 40  # the loader's length: an epoch that never ends (trainer.limit_train_batches makes one)


class Pool:
    """The background a stream draws from: the sentences of the background source's train split in order (those
    :class:`~xl.data.babilong.background.Sentences` reads) until they hold ``tokens`` tokens, or all of them."""

    def __init__(self, source: Source, count: Callable[[str], int], tokens: int) -> None:
        self.units: list[tuple[str, int]] = []
        total = 0
        for text in source.texts("train"):
            for unit in units(text):
                n = count(unit)
                if 0 < n <= MAX_UNIT_TOKENS:
                    self.units.append((unit, n))
                    total += n
                    if total >= tokens:
                        return
        if not self.units:
            Sentences(source, "train", count).peek()  # its sentence about a split without any

    def reader(self, start: int) -> PoolReader:
        return PoolReader(self.units, start)


class PoolReader:
    """The pool's sentences from ``start`` on, round and round: what :func:`hide` reads (``peek``, ``take``)."""

    def __init__(self, units: list[tuple[str, int]], start: int) -> None:
        self.units, self.next = units, start

    def peek(self) -> tuple[str, int]:
        return self.units[self.next]

    def take(self) -> tuple[str, int]:
        unit = self.units[self.next]
        self.next = (self.next + 1) % len(self.units)
        return unit


class SampleStream:
    """Sample ``(row, j)`` of ``tasks`` at ``length`` tokens (counted by ``count``), for ``seed``."""

    def __init__(self, background: Source, tasks: Sequence[str], length: int, seed: int,
                 count: Callable[[str], int], pool_tokens: int = POOL_TOKENS, questions: str = "last",
                 most: int = QUESTIONS_PER_STORY, supports: Mapping[str, Sequence[str]] | None = None) -> None:
        self.background, self.tasks, self.length, self.seed = background, list(tasks), length, seed
        self.questions, self.most, self.supports = questions, most, supports
        self.count, self.pool_tokens = count, max(pool_tokens, 8 * length)

    @functools.cached_property
    def pool(self) -> Pool | None:
        """The background's sentences (None at length 0, which has none); read on first use."""
        return Pool(self.background, self.count, self.pool_tokens) if self.length else None

    def pool_texts(self) -> list[str]:
        return [] if self.pool is None else [unit for unit, _ in self.pool.units]

    def task(self, row: int, j: int) -> str:
        return self.tasks[(row + j) % len(self.tasks)]

    def sample(self, row: int, j: int) -> Sample:
        task = self.task(row, j)
        rng = random.Random(f"babilong:{self.seed}:stream:{task}:{self.length}:{row}:{j}")
        for _ in range(MAX_DRAWS):
            story = GENERATORS[task](rng, self.questions, self.most)
            if split_of(story) != "train" or not kept(story, self.supports):
                continue
            background = None if self.pool is None else self.pool.reader(rng.randrange(len(self.pool.units)))
            sample = hide(story, self.length, background, self.count, rng)
            if sample is not None:
                return sample
        raise DataError(f"length {self.length} is too short for the facts of {task}'s stories ({MAX_DRAWS} in a row "
                        "did not fit); ask for a longer one, or 0 for the facts alone")


@dataclass(frozen=True)
class Encoded:
    """A sample as the token cache holds a document: its ids, the ``[start, end)`` of each answer's ids, and each
    position's UTF-8 length where the tokenizer can give ``<unk>`` (else None)."""

    ids: np.ndarray
    answers: tuple[tuple[int, int], ...]
    n_bytes: np.ndarray | None

    def answer_mask(self) -> np.ndarray:
        """Whether each position lies in an answer."""
        mask = np.zeros(len(self.ids), dtype=bool)
        for start, end in self.answers:
            mask[start:end] = True
        return mask


def encode_sample(sample: Sample, tokenizer: Tokenizer) -> Encoded:
    """The sample's pieces (the prompt, the answer; a training story's earlier questions and answers before them)
    encoded apart, as :func:`xl.data.cache.encode_documents` encodes pieces."""
    unknown_bytes = getattr(tokenizer, "unknown_bytes", None)
    parts, lengths, answers, at = [], [], [], 0
    for text, is_answer in sample.pieces():
        missing: Counter[str] = Counter()
        ids = np.asarray(tokenizer.encode(text, missing), dtype=np.int64)
        parts.append(ids)
        if unknown_bytes is not None:
            n = tokenizer.token_bytes()[ids].astype(np.int64)
            if missing:
                n[ids == tokenizer.unk_id] = unknown_bytes(text, ids)
            lengths.append(n)
        if is_answer:
            answers.append((at, at + len(ids)))
        at += len(ids)
    ids = np.concatenate(parts)
    return Encoded(ids, tuple(answers), np.concatenate(lengths) if lengths else None)


class Row:
    """One row's samples, from the one that holds a given offset on (offsets count the row's tokens from 0)."""

    def __init__(self, make: Callable[[int], Encoded], j: int, start: int) -> None:
        self.make = make
        self.held: list[tuple[int, int, Encoded]] = []  # (j, the offset where it begins, the sample)
        self.next_j, self.next_start = j, start

    def cover(self, end: int) -> None:
        """Make samples until the row reaches offset ``end``."""
        while self.next_start < end:
            sample = self.make(self.next_j)
            if not len(sample.ids):
                raise DataError(f"sample {self.next_j} of a training row gives no tokens; check data.tokenizer")
            self.held.append((self.next_j, self.next_start, sample))
            self.next_j, self.next_start = self.next_j + 1, self.next_start + len(sample.ids)

    def forget(self, before: int) -> None:
        """Drop the samples that end at or before offset ``before``."""
        while self.held and self.held[0][1] + len(self.held[0][2].ids) <= before:
            self.held.pop(0)

    def head(self) -> tuple[int, int]:
        """(j, where it begins) of the first sample held, or of the next to make."""
        return self.held[0][:2] if self.held else (self.next_j, self.next_start)

    def window(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """Offsets ``[start, end)``: their ids, their UTF-8 lengths (or None), each one's position in its sample, and
        whether it lies in its sample's answer."""
        self.cover(end)
        self.forget(start)
        first = self.held[0][1]
        ids = np.concatenate([s.ids for _, _, s in self.held])[start - first : end - first]
        n_bytes = None
        if self.held[0][2].n_bytes is not None:
            n_bytes = np.concatenate([s.n_bytes for _, _, s in self.held])[start - first : end - first]
        pos = np.concatenate([np.arange(len(s.ids)) for _, _, s in self.held])[start - first : end - first]
        answer = np.concatenate([s.answer_mask() for _, _, s in self.held])[start - first : end - first]
        return ids, n_bytes, pos, answer


class GeneratedLoader:
    """Yields the segments of ``batch_size`` rows of samples (``make(row, j)``, row counted over all ranks) as
    :class:`xl.data.stream.SegmentLoader` does: ``(x, y, documents)``, then the targets' UTF-8 lengths where the
    samples carry them; with ``scored``, the targets outside the answers are ``IGNORE_INDEX``. It never ends and
    never starts again: each ``iter()`` goes on from the next segment."""

    def __init__(self, make: Callable[[int, int], Encoded], batch_size: int, tgt_len: int, rank: int = 0,
                 world_size: int = 1, scored: bool = True) -> None:
        if tgt_len < 1:
            raise DataError(f"data.tgt_len must be at least 1, got {tgt_len}")
        self.make, self.batch_size, self.tgt_len = make, batch_size, tgt_len
        self.rank, self.world_size, self.scored = rank, world_size, scored
        self.rows_of_rank = [rank * batch_size + b for b in range(batch_size)]
        self._position = 0
        self.rows = {g: Row(functools.partial(make, g), 0, 0) for g in self.rows_of_rank}

    def __len__(self) -> int:
        return SEGMENTS_PER_EPOCH

    def segment(self, t: int) -> Batch:
        """Segment ``t``; the rows must hold (or be able to make) its first token's sample."""
        start, end = t * self.tgt_len, (t + 1) * self.tgt_len + 1  # inputs and targets
        windows = [self.rows[g].window(start, end) for g in self.rows_of_rank]
        ids = torch.from_numpy(np.stack([w[0] for w in windows]))
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        if self.scored:
            y[~torch.from_numpy(np.stack([w[3][1:] for w in windows]))] = IGNORE_INDEX
        pos = np.stack([w[2] for w in windows]).astype(np.int64)
        latest = int((np.arange(self.tgt_len) - pos[:, :-1]).max())
        pos = torch.from_numpy(pos)
        documents = Documents(pos[:, :-1].contiguous(), latest, pos[:, 1:].contiguous())
        if windows[0][1] is None:
            return x, y, documents
        return x, y, documents, torch.from_numpy(np.stack([w[1][1:] for w in windows]).astype(np.int64))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            t = self._position
            self._position = t + 1
            yield self.segment(t)

    def state_dict(self) -> dict[str, Any]:
        """The next segment, and for each row of this rank the sample that holds its first token and its offset."""
        start = self._position * self.tgt_len
        for row in self.rows.values():
            row.forget(start)
        return {"position": self._position, "batch_size": self.batch_size, "tgt_len": self.tgt_len,
                "world_size": self.world_size, "rank": self.rank,
                "rows": {str(g): list(row.head()) for g, row in self.rows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from the saved segment; rows the state lacks are found by making their samples again."""
        settings = {"batch_size": "data.batch_size", "tgt_len": "data.tgt_len",
                    "world_size": "number of devices (trainer.devices x trainer.num_nodes)"}
        for key, setting in settings.items():
            if state.get(key) != getattr(self, key):
                raise DataError(f"the checkpoint's data position was saved with {key}={state.get(key)} but this run "
                                f"has {getattr(self, key)}; resume with the same {setting} or start without the "
                                "checkpoint")
        if "rows" not in state:
            raise DataError("the checkpoint's data position was saved from a cached training split, not a stream; "
                            "resume with the same data.train_samples or start without the checkpoint")
        self._position = int(state["position"])
        start = self._position * self.tgt_len
        saved = state["rows"]
        for g in self.rows_of_rank:
            if str(g) in saved:
                j, begins = (int(v) for v in saved[str(g)])
                self.rows[g] = Row(functools.partial(self.make, g), j, begins)
            else:
                j = begins = 0
                while begins + (n := len(self.make(g, j).ids)) <= start:
                    j, begins = j + 1, begins + n
                self.rows[g] = Row(functools.partial(self.make, g), j, begins)
