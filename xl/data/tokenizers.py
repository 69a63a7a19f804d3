"""Byte, character, word and subword (byte-level BPE or Unigram) tokenizers with one small interface.

``unit`` tells the trainer how to report the loss: bits per byte/char for ``byte``/``char``, perplexity for
``word`` and ``token`` (subwords). ``encode`` is vectorised (numpy look-ups; the word path stays in C-level
``map``; subwords go through Hugging Face ``tokenizers`` in parallel) because it runs over corpora of 100M
symbols. ``encode(text, unknown)`` adds out-of-vocabulary symbols to ``unknown`` so the caller can report them.
``token_bytes()`` gives each id's length in UTF-8 bytes of the original text, so that every tokenizer's loss
can also be read as bits per byte (``xl.metrics``). ``ranked``: ids are ordered by training frequency, as an
adaptive softmax's clusters need (:func:`default_cutoffs`).
"""

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
        """Each character's UTF-8 length; ``<unk>`` counts 1 (the character it replaced is not known)."""
        return np.array([len(c.encode("utf-8")) for c in self.chars] + [1], dtype=np.int64)

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
    ranked: ClassVar[bool] = True

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

    def token_bytes(self) -> np.ndarray:
        """A word counts its UTF-8 bytes plus one separator (the space that followed it), ``<eos>`` the newline,
        ``<unk>`` the literal ``<unk>`` and its separator (as WikiText writes unknown words).

        The sum over a split equals its bytes when each word is followed by exactly one space, the last of a line
        included (``"a b c \\n"``: 7 bytes); a line ending without that space (``"a b c\\n"``) counts one byte more,
        a space before the first word (WikiText's ``" = Title = \\n"``) one byte less, and a run of whitespace,
        which the tokenizer does not keep, counts as one.
        """
        return np.array([1, len(UNK) + 1] + [len(w.encode("utf-8")) + 1 for w in self.itos[2:]], dtype=np.int64)

    def key(self) -> str:
        return f"word(min_freq={self.min_freq},max_size={self.max_size})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "min_freq": self.min_freq, "max_size": self.max_size, "words": self.itos[2:]}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> WordTokenizer:
        return cls(values["min_freq"], values["max_size"], values["words"])


# GPT-2's 256 printable stand-ins for the byte values: a byte-level vocabulary holds each as a token.
BYTE_ALPHABET: frozenset[str] = frozenset(hf.pre_tokenizers.ByteLevel.alphabet())
DEFAULT_VOCAB_SIZE = 4096
# Up to this size (the usual subword vocabularies) one plain softmax; clusters pay off for larger vocabularies.
PLAIN_SOFTMAX_MAX = 32768
ADAPTIVE_HEAD = 8192
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
    ranked: ClassVar[bool] = True

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
        path = Path(file).expanduser()
        if not path.is_file():
            raise DataError(f"data.tokenizer_file={file} does not exist; point it at a tokenizer.json file")
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
    def vocab_size(self) -> int:
        return self.settings["vocab_size"] if self.hf is None else self.hf.get_vocab_size()

    def fit(self, texts: Iterable[str]) -> None:
        """Train on ``texts`` (a tokenizer read from a file has nothing to learn)."""
        if "file_sha256" in self.settings:
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
        self._use(tokenizer, np.arange(tokenizer.get_vocab_size()), f"data.tokenizer={self.name}")

    def rank_by_frequency(self, train_ids: np.ndarray) -> np.ndarray:
        """Renumber the ids by their count in ``train_ids`` (most frequent first, ties by id); returns the map
        from the old ids to the new ones, to apply to ids already encoded."""
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


Tokenizer = ByteTokenizer | CharTokenizer | WordTokenizer | SubwordTokenizer
TOKENIZERS: dict[str, type[Tokenizer]] = {
    t.name: t for t in (ByteTokenizer, CharTokenizer, WordTokenizer, BPETokenizer, UnigramTokenizer)}


def make_tokenizer(name: str, file: str | Path | None = None, **kwargs: Any) -> Tokenizer:
    """An unfitted tokenizer by name; ``kwargs`` are its vocabulary settings (``min_freq``/``max_size`` for word;
    ``vocab_size``, ``special_tokens``, ``pre_tokenizer`` for bpe/unigram), ``file`` a ``tokenizer.json`` to read."""
    if name not in TOKENIZERS:
        raise DataError(f"data.tokenizer must be one of {sorted(TOKENIZERS)}, got {name!r}")
    if file is not None:
        if not issubclass(TOKENIZERS[name], SubwordTokenizer):
            raise DataError(f"data.tokenizer_file is read by data.tokenizer=bpe or unigram, not {name}; "
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
