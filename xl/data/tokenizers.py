"""Byte, character, word and subword (byte-level BPE or Unigram) tokenizers with one small interface.

``unit`` tells the trainer how to report the loss: bits per byte/char for ``byte``/``char``, perplexity for
``word`` and ``token`` (subwords). ``encode`` is vectorised (numpy look-ups; the word path stays in C-level
``map``; subwords go through Hugging Face ``tokenizers`` in parallel) because it runs over corpora of 100M
symbols. ``encode(text, unknown)`` adds out-of-vocabulary symbols to ``unknown`` so the caller can report them.
``token_bytes()`` gives each id's length in UTF-8 bytes of the original text, so that every tokenizer's loss
can also be read as bits per byte (``xl.data.metrics``). ``ranked``: ids are ordered by training frequency, as an
adaptive softmax's clusters need (:func:`default_cutoffs`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from xl.data.errors import DataError
from xl.data.subwords import BPETokenizer, SubwordTokenizer, UnigramTokenizer
from xl.data.words import UNK, WordTokenizer

__all__ = ["TOKENIZERS", "BPETokenizer", "ByteTokenizer", "CharTokenizer", "SubwordTokenizer", "Tokenizer",
           "UnigramTokenizer", "WordTokenizer", "default_cutoffs", "fingerprint", "make_tokenizer",
           "tokenizer_from_dict"]
# Up to this size (the usual subword vocabularies) one plain softmax; clusters pay off for larger vocabularies.
PLAIN_SOFTMAX_MAX = 32768
ADAPTIVE_HEAD = 8192
_N_CODEPOINTS = 0x110000


class ByteTokenizer:
    """UTF-8 bytes, 256 symbols; no vocabulary to fit and nothing is ever unknown.

    Text decoded with ``surrogateescape`` (as the sources do) re-encodes to the original bytes, so any file works.
    """

    name: ClassVar[str] = "byte"
    unit: ClassVar[str] = "byte"
    ranked: ClassVar[bool] = False
    vocab_size: int = 256

    def fit(self, texts: Iterable[str]) -> None:
        """Nothing to learn: the vocabulary is all 256 byte values."""

    def encode(self, text: str, unknown: Counter | None = None) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "surrogateescape"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", "replace")

    def token_bytes(self) -> np.ndarray:
        """One byte per token."""
        return np.ones(self.vocab_size, dtype=np.int64)

    def key(self) -> str:
        return "byte"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ByteTokenizer:
        return cls()


class CharTokenizer:
    """Unicode characters seen in the training split, plus ``<unk>`` (the last id) for the rest."""

    name: ClassVar[str] = "char"
    unit: ClassVar[str] = "char"
    ranked: ClassVar[bool] = False

    def __init__(self, chars: Iterable[str] = ()) -> None:
        self.chars: list[str] = sorted(set(chars))
        self._table: np.ndarray | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    @property
    def unk_id(self) -> int:
        return len(self.chars)

    def fit(self, texts: Iterable[str]) -> None:
        seen = np.zeros(_N_CODEPOINTS, dtype=bool)
        for text in texts:
            seen[_codepoints(text)] = True
        self.chars = [chr(c) for c in np.flatnonzero(seen)]
        self._table = None

    def encode(self, text: str, unknown: Counter | None = None) -> np.ndarray:
        if self._table is None:
            self._table = np.full(_N_CODEPOINTS, self.unk_id, dtype=np.int32)
            self._table[[ord(c) for c in self.chars]] = np.arange(len(self.chars), dtype=np.int32)
        cps = _codepoints(text)
        ids = self._table[cps]
        if unknown is not None:
            missing, counts = np.unique(cps[ids == self.unk_id], return_counts=True)
            unknown.update({chr(c): int(n) for c, n in zip(missing, counts, strict=True)})
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        symbols = self.chars + [UNK]
        return "".join(symbols[i] for i in np.asarray(ids).tolist())

    def token_bytes(self) -> np.ndarray:
        """Each character's UTF-8 length; ``<unk>`` counts 1 byte here.

        ``<unk>`` stands for every character the training split lacks, whatever its own UTF-8 length (1 to 4
        bytes), so one length per id cannot count it: the token cache keeps, for a split that has ``<unk>``, the
        real length of each position (:meth:`unknown_bytes`); bits per byte count those, and charge 8 bits for
        each byte of an ``<unk>`` (:mod:`xl.data.metrics`).
        """
        return np.array([len(c.encode("utf-8")) for c in self.chars] + [1], dtype=np.int64)

    def unknown_bytes(self, text: str, ids: np.ndarray) -> np.ndarray:
        """The UTF-8 length of each character that ``encode(text)`` (``ids``) turned into ``<unk>``, in order."""
        cps = _codepoints(text)[ids == self.unk_id]
        return 1 + (cps >= 0x80) + (cps >= 0x800) + (cps >= 0x10000).astype(np.int64)

    def key(self) -> str:
        return "char"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "chars": "".join(self.chars)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CharTokenizer:
        return cls(values["chars"])


Tokenizer = ByteTokenizer | CharTokenizer | WordTokenizer | SubwordTokenizer
TOKENIZERS: dict[str, type[Tokenizer]] = {
    t.name: t for t in (ByteTokenizer, CharTokenizer, WordTokenizer, BPETokenizer, UnigramTokenizer)}


def make_tokenizer(name: str, file: str | Path | None = None, **kwargs: Any) -> Tokenizer:
    """An unfitted tokenizer by name; ``kwargs`` are its vocabulary settings (``min_freq``/``max_size`` for word;
    ``vocab_size``, ``special_tokens``, ``pre_tokenizer`` for bpe/unigram), ``file`` a ``tokenizer.json`` (bpe,
    unigram) or a word vocabulary (``vocab.json``, word) to read."""
    if name not in TOKENIZERS:
        raise DataError(f"data.tokenizer must be one of {sorted(TOKENIZERS)}, got {name!r}")
    if file is not None:
        if not issubclass(TOKENIZERS[name], (SubwordTokenizer, WordTokenizer)):
            raise DataError(f"data.tokenizer_file is read by data.tokenizer=word, bpe or unigram, not {name}; "
                            "set data.tokenizer_file=null or change data.tokenizer")
        kwargs["file"] = file
    try:
        return TOKENIZERS[name](**kwargs)
    except TypeError as e:
        kwargs.pop("file", None)
        raise DataError(f"data.tokenizer_kwargs {dict(kwargs)} do not fit the {name} tokenizer ({e})") from e


def default_cutoffs(vocab_size: int, ranked: bool) -> list[int]:
    """Adaptive-softmax cluster boundaries for a vocabulary (Grave et al., 2017): ``[]``, one plain softmax, up to
    ``PLAIN_SOFTMAX_MAX`` ids or when ids are not ordered by frequency (byte, char); above, a head of the
    ``ADAPTIVE_HEAD`` most frequent ids, then boundaries 4x apart (8192, 32768, 131072, ...) as long as the last
    cluster keeps at least as many ids as its boundary (50,257 ids: [8192]; 267,735: [8192, 32768, 131072])."""
    if vocab_size <= PLAIN_SOFTMAX_MAX or not ranked:
        return []
    cutoffs = [ADAPTIVE_HEAD]
    while cutoffs[-1] * 8 <= vocab_size:
        cutoffs.append(cutoffs[-1] * 4)
    return cutoffs


def fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of everything that decides the ids (kind, settings and fitted vocabulary): a model trained with
    one tokenizer reads nonsense from another of the same size, and this tells them apart."""
    return hashlib.sha256(json.dumps(tokenizer.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_from_dict(values: dict[str, Any]) -> Tokenizer:
    """Rebuild a fitted tokenizer from its ``to_dict()``."""
    return TOKENIZERS[values["name"]].from_dict(values)


def _codepoints(text: str) -> np.ndarray:
    """Unicode code points of ``text`` as uint32, without a Python-level loop."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
