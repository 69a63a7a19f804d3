"""The Lightning DataModule: a source and a tokenizer in, ordered segment loaders out.

``prepare_data`` (rank 0 of each node, by Lightning's design) tokenises into the on-disk cache; ``setup`` opens
the memory maps on every rank and cuts this rank's streams. ``train_dataloader`` hands Lightning the
:class:`SegmentLoader` itself so the fit loop checkpoints and restores its position.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import lightning
import numpy as np
import torch

from xl.data.cache import TokenCache, open_cache
from xl.data.errors import DataError
from xl.data.sources import SPLITS, SeparatedSource, Source, TextFilesSource
from xl.data.stream import SegmentLoader
from xl.data.tokenizers import Tokenizer, default_cutoffs, fingerprint, make_tokenizer

STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ()}


class SegmentDataModule(lightning.LightningDataModule):
    """Never-shuffled Transformer-XL segments of one corpus; ``eval_*`` default to the training values."""

    scored = "every token"  # which targets the loss and the metrics count, in words (results.json's "scored")

    def __init__(
        self,
        source: Source,
        tokenizer: str = "byte",
        batch_size: int = 8,
        tgt_len: int = 128,
        eval_batch_size: int | None = None,
        eval_tgt_len: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        tokenizer_kwargs: dict[str, Any] | None = None,
        doc_sep: str | None = None,
        doc_sep_regex: bool = False,
        tokenizer_file: str | os.PathLike | None = None,
    ) -> None:
        """``doc_sep``: a line (``doc_sep_regex``: a regular expression a whole line matches) that begins a new
        document, beyond the source's own documents (each file, each article)."""
        super().__init__()
        self.source = source if doc_sep is None else SeparatedSource(source, str(doc_sep), doc_sep_regex)
        self.tokenizer_name = tokenizer
        self.tokenizer_kwargs = dict(tokenizer_kwargs or {})
        self.tokenizer_file = tokenizer_file
        self._new_tokenizer()  # fail on a bad name, setting or file now, not in prepare_data
        self.batch_size = batch_size
        self.tgt_len = tgt_len
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        self.eval_tgt_len = tgt_len if eval_tgt_len is None else eval_tgt_len
        for setting in ("batch_size", "tgt_len", "eval_batch_size", "eval_tgt_len"):
            if getattr(self, setting) < 1:
                raise DataError(f"data.{setting} must be at least 1, got {getattr(self, setting)}")
        self.cache_dir = cache_dir
        self._cache: TokenCache | None = None
        self._loaders: dict[str, SegmentLoader] = {}

    @classmethod
    def from_files(cls, train: str | Sequence[str], val: str | Sequence[str], test: str | Sequence[str],
                   **kwargs: Any) -> SegmentDataModule:
        """The ``data=text`` entry point: ``data.train/val/test`` are paths (or lists of paths) of local text files."""
        return cls(TextFilesSource(train, val, test), **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """Memory maps belong to one process: a pickled copy (``ddp_spawn``) reopens the cache, not the arrays."""
        return {**self.__dict__, "_cache": None, "_loaders": {}}

    def _new_tokenizer(self) -> Tokenizer:
        return make_tokenizer(self.tokenizer_name, self.tokenizer_file, **self.tokenizer_kwargs)

    def prepare_data(self) -> None:
        """Tokenise into the cache, or check the cache that exists (a damaged one is rebuilt), and keep it open."""
        self._cache = open_cache(self.source, self._new_tokenizer(), self.cache_dir)

    @property
    def cache(self) -> TokenCache:
        """The opened token cache (built first if this process is the first to need it)."""
        if self._cache is None:
            self._cache = open_cache(self.source, self._new_tokenizer(), self.cache_dir)
        return self._cache

    @property
    def tokenizer(self) -> Tokenizer:
        return self.cache.tokenizer

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str:
        """:func:`xl.data.tokenizers.fingerprint` of the fitted tokenizer: checkpoints record it."""
        return fingerprint(self.tokenizer)

    @property
    def identity(self) -> dict[str, str]:
        """What the token cache is keyed by (the source with its document rule, the tokenizer's settings) and the
        corpus in words; checkpoints record it, so that a run's data can be told from other data."""
        return {"source": self.source.identity(), "tokenizer": self._new_tokenizer().key(),
                "corpus": self.source.setting("train")}

    @property
    def vocab_size(self) -> int:
        return self.cache.tokenizer.vocab_size

    @property
    def unit(self) -> str:
        return self.cache.tokenizer.unit

    @property
    def default_cutoffs(self) -> list[int]:
        """Adaptive-softmax cutoffs that fit this vocabulary (``[]``: one plain softmax); see ``default_cutoffs``."""
        return default_cutoffs(self.vocab_size, self.cache.tokenizer.ranked)

    @property
    def token_bytes(self) -> torch.Tensor:
        """Each id's length in UTF-8 bytes of the original text (int64, vocabulary-sized), for bits per byte; where
        a split has text the vocabulary lacks, its batches also carry each target's own length, which the metrics
        count instead."""
        return torch.from_numpy(self.cache.tokenizer.token_bytes())

    @property
    def unk_id(self) -> int | None:
        """The id of ``<unk>`` (char and word tokenizers), which bits per byte charge for the text it stands for
        (:mod:`xl.data.metrics`); None for tokenizers that never give it."""
        return getattr(self.cache.tokenizer, "unk_id", None)

    def setup(self, stage: str | None = None) -> None:
        """Cut this rank's streams for the splits ``stage`` needs; a split too short for one batch fails here."""
        for split in STAGE_SPLITS.get(stage, SPLITS):
            self._loaders[split] = self._make_loader(split)

    def _make_loader(self, split: str) -> SegmentLoader:
        world_size, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        ids, docs, n_bytes = self.cache.splits[split], self.cache.docs[split], self.cache.target_bytes.get(split)
        scored = self.scored_spans(split)
        if split == "train":
            return SegmentLoader(ids, self.batch_size, self.tgt_len, rank, world_size, split,
                                 epoch_length=self._epoch_length, doc_starts=docs, target_bytes=n_bytes,
                                 scored=scored)
        return SegmentLoader(ids, self.eval_batch_size, self.eval_tgt_len, rank, world_size, split, doc_starts=docs,
                             target_bytes=n_bytes, scored=scored)

    def scored_spans(self, split: str) -> np.ndarray | None:
        """The ``[start, end)`` token spans whose targets are scored (None: every target); a data module that
        scores part of its text (``data=babilong``'s answers) gives them."""
        return None

    def _epoch_length(self) -> int | None:
        """Training segments per epoch as the trainer counts them (``limit_train_batches``), once it has."""
        n = getattr(self.trainer, "num_training_batches", None)
        return int(n) if isinstance(n, (int, float)) and math.isfinite(n) else None

    def _loader(self, split: str) -> SegmentLoader:
        if split not in self._loaders:
            self._loaders[split] = self._make_loader(split)
        return self._loaders[split]

    def train_dataloader(self) -> SegmentLoader:
        return self._loader("train")

    def val_dataloader(self) -> SegmentLoader:
        return self._loader("val")

    def test_dataloader(self) -> SegmentLoader:
        return self._loader("test")
