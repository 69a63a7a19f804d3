"""Byte-level subword tokenizers (BPE or Unigram through Hugging Face ``tokenizers``): fitted on the training split
(ids then ranked by training frequency) or read from a ``tokenizer.json`` (ids then the file's), decoding exact byte
for byte."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import tokenizers as hf

from xl.data.errors import DataError, existing_file

# GPT-2's 256 printable stand-ins for the byte values: a byte-level vocabulary holds each as a token.
BYTE_ALPHABET: frozenset[str] = frozenset(hf.pre_tokenizers.ByteLevel.alphabet())
DEFAULT_VOCAB_SIZE = 4096
PRE_TOKENIZERS = ("gpt2", "digits")
PIECE_CHARS = 1 << 16
# A cut between a non-space character and a newline: GPT-2's pattern (gpt2, digits) always splits there, so
# encoding the pieces in parallel gives the ids of one encode of the whole text. With a tokenizer file's own
# pattern a cut can move a token boundary at a line end (as the sources' chunks can); decoding stays exact.
_CUT = re.compile(r"(?<=\S)(?=\n)")


class SubwordTokenizer:
    """Byte-level subwords (BPE or Unigram from Hugging Face ``tokenizers``): fitted on the training split, or
    read from a ``tokenizer.json``.

    The pre-tokenizer writes each UTF-8 byte as one of 256 symbols that are all in the vocabulary, so nothing is
    ever unknown and decoding gives the text back byte for byte (no normalizer). ``pre_tokenizer``: ``gpt2``
    (GPT-2's pattern: words with their leading space, numbers, punctuation, whitespace runs) or ``digits`` (the
    same, with every digit a piece of its own). Special tokens are matched where the text holds them literally
    (a document separator your files contain, say) and never split. After fitting, the cache calls
    :meth:`rank_by_frequency`: ids are then ordered by frequency in the training split, most frequent first.
    """

    name: ClassVar[str]
    model: ClassVar[str]  # the Hugging Face model type: "BPE" or "Unigram"
    trainer: ClassVar[str]  # its trainer in tokenizers.trainers
    unit: ClassVar[str] = "token"

    def __init__(self, vocab_size: int | None = None, special_tokens: Sequence[str] = (),
                 pre_tokenizer: str | None = None, file: str | Path | None = None) -> None:
        if isinstance(special_tokens, str) or not all(isinstance(t, str) and t for t in special_tokens) \
                or len(set(special_tokens)) != len(special_tokens):
            raise DataError(f"data.tokenizer_kwargs.special_tokens must be a list of distinct non-empty strings, "
                            f"got {special_tokens!r}")
        self.special_tokens = list(special_tokens)
        self.hf: hf.Tokenizer | None = None
        self.order = self._rank = np.zeros(0, dtype=np.int64)
        if file is None:
            vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
            minimum = len(BYTE_ALPHABET) + len(self.special_tokens)
            if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < minimum:
                raise DataError(f"data.tokenizer_kwargs.vocab_size={vocab_size!r} cannot hold the 256 byte symbols and "
                                f"{len(self.special_tokens)} special token(s); set it to at least {minimum}")
            pre_tokenizer = PRE_TOKENIZERS[0] if pre_tokenizer is None else pre_tokenizer
            if pre_tokenizer not in PRE_TOKENIZERS:
                raise DataError(f"data.tokenizer_kwargs.pre_tokenizer must be one of {list(PRE_TOKENIZERS)}, "
                                f"got {pre_tokenizer!r}")
            self.settings: dict[str, Any] = {"vocab_size": vocab_size, "pre_tokenizer": pre_tokenizer,
                                             "special_tokens": self.special_tokens}
            return
        if vocab_size is not None or pre_tokenizer is not None:
            raise DataError("data.tokenizer_kwargs.vocab_size and pre_tokenizer come from data.tokenizer_file; "
                            "leave them unset (null) when reading a tokenizer file")
        path = existing_file(file, "data.tokenizer_file", "tokenizer.json")
        data = path.read_bytes()
        try:
            loaded = hf.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed JSON or an unknown layout
            raise DataError(f"data.tokenizer_file={file} is not a Hugging Face tokenizer.json "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
        self.settings = {"file_sha256": hashlib.sha256(data).hexdigest(), "special_tokens": self.special_tokens}
        self._use(loaded, np.arange(loaded.get_vocab_size()), f"data.tokenizer_file={file}")

    def _use(self, tokenizer: hf.Tokenizer, order: np.ndarray, setting: str) -> None:
        """Adopt a fitted or loaded tokenizer after checking that it is byte-level and holds the special tokens."""
        layout = json.loads(tokenizer.to_str())
        model = layout["model"]["type"]
        if model != self.model:
            raise DataError(f"{setting} holds a {model} model but data.tokenizer={self.name} expects {self.model}; "
                            f"set data.tokenizer to match the file")
        pre = layout.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        decoder = (layout.get("decoder") or {}).get("type")
        if layout.get("normalizer") or "ByteLevel" not in {s.get("type") for s in steps} or decoder != "ByteLevel":
            raise DataError(f"{setting} is not a byte-level tokenizer (it needs a ByteLevel pre-tokenizer and "
                            f"decoder and no normalizer, so that decoding is exact); use a byte-level BPE or Unigram "
                            f"file or let data.tokenizer={self.name} fit one")
        added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        missing = [t for t in self.special_tokens if tokenizer.token_to_id(t) not in added]
        if missing:
            raise DataError(f"{setting} lacks the special token(s) {missing} that data.tokenizer_kwargs.special_tokens "
                            f"names; add them to the file or remove them from the setting")
        pieces = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
        if None in pieces:
            raise DataError(f"{setting} has no token for id {pieces.index(None)}; its ids must run from 0 to "
                            f"{len(pieces) - 1} without gaps")
        if not BYTE_ALPHABET <= set(pieces) or any(not BYTE_ALPHABET.issuperset(p)
                                                   for i, p in enumerate(pieces) if i not in added):
            raise DataError(f"{setting} does not hold every byte as a token of its own, so some text would be "
                            f"unknown; use a byte-level vocabulary")
        # Added tokens stand for their literal text; every other piece is one byte per symbol.
        lengths = [len(added[i].encode("utf-8")) if i in added else len(p) for i, p in enumerate(pieces)]
        self.hf, self._piece_bytes = tokenizer, np.array(lengths, dtype=np.int64)
        self._added, self._added_ids = added, np.array(sorted(added), dtype=np.int64)
        self.order = np.asarray(order, dtype=np.int64)
        self._rank = np.empty_like(self.order)
        self._rank[self.order] = np.arange(len(self.order))

    def _fitted(self) -> hf.Tokenizer:
        if self.hf is None:
            raise RuntimeError("fit() the tokenizer (or read it from a cache) before encoding")
        return self.hf

    @property
    def from_file(self) -> bool:
        """Read from ``data.tokenizer_file`` (nothing fitted, the file's ids), rather than fitted here."""
        return "file_sha256" in self.settings

    @property
    def ranked(self) -> bool:
        """Ids ordered by training frequency: a fitted vocabulary's are; a file's are the file's own."""
        return not self.from_file

    @property
    def vocab_size(self) -> int:
        return self.settings["vocab_size"] if self.hf is None else self.hf.get_vocab_size()

    def fit(self, texts: Iterable[str]) -> None:
        """Train on ``texts`` (a tokenizer read from a file has nothing to learn)."""
        if self.from_file:
            return
        tokenizer = hf.Tokenizer(getattr(hf.models, self.model)())
        byte_level = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.pre_tokenizer = byte_level if self.settings["pre_tokenizer"] == "gpt2" else \
            hf.pre_tokenizers.Sequence([hf.pre_tokenizers.Digits(individual_digits=True), byte_level])
        tokenizer.decoder = hf.decoders.ByteLevel()
        trainer = getattr(hf.trainers, self.trainer)(
            vocab_size=self.settings["vocab_size"], special_tokens=self.special_tokens,
            initial_alphabet=sorted(BYTE_ALPHABET), show_progress=False)
        tokenizer.train_from_iterator((piece for text in texts for piece in _pieces(text)), trainer)
        # The trained model as its own file reads it back: a Unigram model fresh from its trainer can split a text
        # otherwise than the same model loaded from its JSON (a few tokens of a corpus, in a few fits out of a
        # hundred), and the token cache, a shared model and a tokenizer_file all load the JSON.
        tokenizer = hf.Tokenizer.from_str(tokenizer.to_str())
        self._use(tokenizer, np.arange(tokenizer.get_vocab_size()), f"data.tokenizer={self.name}")

    def rank_by_frequency(self, train_ids: np.ndarray) -> np.ndarray:
        """Renumber the ids by their count in ``train_ids`` (most frequent first, ties by id); returns the map
        from the old ids to the new ones, to apply to ids already encoded. A file's ids stay as they are (the
        identity map)."""
        if self.from_file:
            return np.arange(self.vocab_size)
        by_count = np.argsort(-np.bincount(train_ids, minlength=self.vocab_size), kind="stable")
        remap = np.empty_like(by_count)
        remap[by_count] = np.arange(len(by_count))
        self._use(self._fitted(), self.order[by_count], f"data.tokenizer={self.name}")
        return remap

    def encode(self, text: str, unknown: Counter | None = None) -> np.ndarray:
        """Ids of ``text``; byte-level, so ``unknown`` never grows."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text, all encoded in one parallel call of ``tokenizers``."""
        if not texts:
            return []
        pieces = [_pieces(text) for text in texts]
        encodings = self._fitted().encode_batch_fast([p for ps in pieces for p in ps], add_special_tokens=False)
        flat = np.concatenate([np.array(e.ids, dtype=np.int64) for e in encodings])
        starts = np.cumsum([0] + [len(ps) for ps in pieces[:-1]])
        per_text = np.add.reduceat(np.array([len(e.ids) for e in encodings]), starts)
        return np.split(self._rank[flat], np.cumsum(per_text)[:-1])

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``. Added (special) tokens are written as their text, between decoded runs of the
        others: the byte-level decoder would read a non-ASCII special token's characters as byte symbols."""
        hf_ids = self.order[np.asarray(ids, dtype=np.int64)]
        parts, start = [], 0
        for at in np.flatnonzero(np.isin(hf_ids, self._added_ids)).tolist():
            parts += [self._fitted().decode(hf_ids[start:at].tolist()), self._added[int(hf_ids[at])]]
            start = at + 1
        return "".join(parts) + self._fitted().decode(hf_ids[start:].tolist())

    def token_bytes(self) -> np.ndarray:
        """Each token's exact UTF-8 length: one byte per symbol, a special token its literal text."""
        return self._piece_bytes[self.order]

    def key(self) -> str:
        return f"{self.name}({json.dumps(self.settings, sort_keys=True)})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "settings": self.settings, "tokenizer": self._fitted().to_str(),
                "order": self.order.tolist()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SubwordTokenizer:
        tokenizer = cls.__new__(cls)
        tokenizer.settings = values["settings"]
        tokenizer.special_tokens = tokenizer.settings["special_tokens"]
        tokenizer._use(hf.Tokenizer.from_str(values["tokenizer"]), np.array(values["order"]), "the token cache")
        return tokenizer


class BPETokenizer(SubwordTokenizer):
    """Byte-level BPE (Sennrich et al., 2016; GPT-2's byte-level variant)."""

    name: ClassVar[str] = "bpe"
    model: ClassVar[str] = "BPE"
    trainer: ClassVar[str] = "BpeTrainer"


class UnigramTokenizer(SubwordTokenizer):
    """Byte-level Unigram language model (Kudo, 2018)."""

    name: ClassVar[str] = "unigram"
    model: ClassVar[str] = "Unigram"
    trainer: ClassVar[str] = "UnigramTrainer"


def _pieces(text: str) -> list[str]:
    """``text`` cut into pieces of about ``PIECE_CHARS`` characters where ``_CUT`` allows (at least one piece)."""
    starts = [0]
    while starts[-1] + PIECE_CHARS < len(text) and (cut := _CUT.search(text, starts[-1] + PIECE_CHARS)):
        starts.append(cut.start())
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)], strict=True)]
