"""Byte, character and word tokenizers with one small interface.

``unit`` tells the trainer how to report the loss: bits per byte/char for ``byte``/``char``, perplexity for
``word``. ``encode`` is vectorised (numpy look-ups; the word path stays in C-level ``map``) because it runs over
corpora of 100M symbols. ``encode(text, unknown)`` adds out-of-vocabulary symbols to ``unknown`` so the caller
can report them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np

from xl.data.errors import DataError

UNK = "<unk>"
EOS = "<eos>"
_N_CODEPOINTS = 0x110000


class ByteTokenizer:
    """UTF-8 bytes, 256 symbols; no vocabulary to fit and nothing is ever unknown.

    Text decoded with ``surrogateescape`` (as the sources do) re-encodes to the original bytes, so any file works.
    """

    name: ClassVar[str] = "byte"
    unit: ClassVar[str] = "byte"
    vocab_size: int = 256

    def fit(self, texts: Iterable[str]) -> None:
        """Nothing to learn: the vocabulary is all 256 byte values."""

    def encode(self, text: str, unknown: Counter | None = None) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "surrogateescape"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", "replace")

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

    def key(self) -> str:
        return "char"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "chars": "".join(self.chars)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CharTokenizer:
        return cls(values["chars"])


class _Lookup(dict):
    """Word → id map whose misses give ``<unk>``'s id, so ``map(lookup.__getitem__, words)`` stays in C."""

    unk_id: int = 0

    def __missing__(self, word: str) -> int:
        return self.unk_id


class WordTokenizer:
    """Whitespace-separated words with ``<eos>`` closing every line; unseen or rare words become ``<unk>``.

    Words are ranked by frequency in the training split (ties: first seen first), like the original
    Transformer-XL vocabulary; ``min_freq`` drops rare words and ``max_size`` caps the number of words kept
    (the two special symbols are not counted).
    """

    name: ClassVar[str] = "word"
    unit: ClassVar[str] = "word"

    def __init__(self, min_freq: int = 1, max_size: int | None = None, words: Iterable[str] = ()) -> None:
        if min_freq < 1:
            raise DataError(f"data.tokenizer_kwargs.min_freq must be at least 1, got {min_freq}")
        if max_size is not None and max_size < 1:
            raise DataError(f"data.tokenizer_kwargs.max_size must be positive or null, got {max_size}")
        self.min_freq = min_freq
        self.max_size = max_size
        self._set_words(list(words))

    def _set_words(self, words: list[str]) -> None:
        self.itos: list[str] = [EOS, UNK] + [w for w in words if w not in (EOS, UNK)]
        self._stoi = _Lookup((w, i) for i, w in enumerate(self.itos))
        self._stoi.unk_id = self.unk_id

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    @property
    def eos_id(self) -> int:
        return 0

    @property
    def unk_id(self) -> int:
        return 1

    def fit(self, texts: Iterable[str]) -> None:
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(text.split())
        ranked = [w for w, n in counts.most_common() if n >= self.min_freq and w not in (EOS, UNK)]
        self._set_words(ranked[: self.max_size])

    def encode(self, text: str, unknown: Counter | None = None) -> np.ndarray:
        """Ids of the words of ``text``, one ``<eos>`` after each line (a last line without newline included)."""
        words = text.replace("\n", f" {EOS} ").split()
        if text and not text.endswith("\n"):
            words.append(EOS)
        ids = np.fromiter(map(self._stoi.__getitem__, words), dtype=np.int32, count=len(words))
        if unknown is not None and (ids == self.unk_id).any():
            unknown.update(w for w in words if w not in self._stoi)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        lines, line = [], []
        for i in np.asarray(ids).tolist():
            if i == self.eos_id:
                lines.append(" ".join(line) + "\n")
                line = []
            else:
                line.append(self.itos[i])
        return "".join(lines) + " ".join(line)

    def key(self) -> str:
        return f"word(min_freq={self.min_freq},max_size={self.max_size})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "min_freq": self.min_freq, "max_size": self.max_size, "words": self.itos[2:]}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> WordTokenizer:
        return cls(values["min_freq"], values["max_size"], values["words"])


Tokenizer = ByteTokenizer | CharTokenizer | WordTokenizer
TOKENIZERS: dict[str, type[Tokenizer]] = {t.name: t for t in (ByteTokenizer, CharTokenizer, WordTokenizer)}


def make_tokenizer(name: str, **kwargs: Any) -> Tokenizer:
    """An unfitted tokenizer by name; ``kwargs`` are its vocabulary settings (``min_freq``/``max_size`` for word)."""
    if name not in TOKENIZERS:
        raise DataError(f"data.tokenizer must be one of {sorted(TOKENIZERS)}, got {name!r}")
    try:
        return TOKENIZERS[name](**kwargs)
    except TypeError as e:
        raise DataError(f"data.tokenizer_kwargs {dict(kwargs)} do not fit the {name} tokenizer ({e})") from e


def tokenizer_from_dict(values: dict[str, Any]) -> Tokenizer:
    """Rebuild a fitted tokenizer from its ``to_dict()``."""
    return TOKENIZERS[values["name"]].from_dict(values)


def _codepoints(text: str) -> np.ndarray:
    """Unicode code points of ``text`` as uint32, without a Python-level loop."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
