"""The word tokenizer: whitespace-separated words, an end-of-line symbol, ``<unk>`` for the rest.

With ``punctuation=True`` (``+data.tokenizer_kwargs.punctuation=true``) every punctuation mark is a word of its own:
``"John?"`` is ``John ?`` and ``"kitchen."`` is ``kitchen .``, so a name or a place is one symbol wherever it stands.

Its vocabulary is fitted on the training split (ranked by frequency, as an adaptive softmax's clusters need), or
read from a vocabulary file (``data.tokenizer_file``): the JSON that ``python -m xl.convert`` writes for a published
Transformer-XL model, whose ids, end-of-line and unknown symbols and case rule are the original's.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from xl.data.errors import DataError, existing_file

UNK = "<unk>"
EOS = "<eos>"
VOCABULARY_FORMAT = "xl-word-vocabulary"
PUNCTUATION = re.compile(r"([^\w\s])")  # a punctuation mark: neither a word character nor whitespace


class _Lookup(dict):
    """Word → id map whose misses give ``<unk>``'s id, so ``map(lookup.__getitem__, words)`` stays in C."""

    unk_id: int = 0

    def __missing__(self, word: str) -> int:
        return self.unk_id


def vocabulary_json(words: list[str], eos: str = EOS, unk: str = UNK, lower_case: bool = False,
                    punctuation: bool = False) -> str:
    """The vocabulary file's text: every id's word in id order, which of them ends a line and which stands for an
    unknown word, whether text is lower-cased before the look-up, and (only when true, so that a file without it
    keeps its text) whether punctuation marks are split off as words of their own."""
    split = {"punctuation": True} if punctuation else {}
    return json.dumps({"format": VOCABULARY_FORMAT, "eos": eos, "unk": unk, "lower_case": lower_case, **split,
                       "words": words}, ensure_ascii=False)


def read_vocabulary(text: str, setting: str) -> dict[str, Any]:
    """Parse and check a vocabulary file's text (:func:`vocabulary_json`)."""
    try:
        vocab = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{setting} is not a word vocabulary file (not JSON: {err})") from None
    if not isinstance(vocab, dict) or vocab.get("format") != VOCABULARY_FORMAT:
        raise DataError(f"{setting} is not a word vocabulary file (python -m xl.convert writes one as vocab.json)")
    words = vocab.get("words")
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words) \
            or len(set(words)) != len(words):
        raise DataError(f"{setting}: its words must be a list of distinct non-empty strings")
    for key in ("eos", "unk"):
        if vocab.get(key) not in words:
            raise DataError(f"{setting}: its {key} symbol {vocab.get(key)!r} is not one of its words")
    if not isinstance(vocab.get("lower_case"), bool):
        raise DataError(f"{setting}: lower_case must be true or false")
    if not isinstance(vocab.setdefault("punctuation", False), bool):
        raise DataError(f"{setting}: punctuation must be true or false")
    return vocab


class WordTokenizer:
    """Whitespace-separated words with the end-of-line symbol closing every line; unknown words become ``<unk>``.

    Fitted: words are ranked by frequency in the training split (ties: first seen first), like the original
    Transformer-XL vocabulary, after ``<eos>`` (id 0) and ``<unk>`` (id 1); ``min_freq`` drops rare words and
    ``max_size`` caps the number of words kept (the two special symbols are not counted). From ``file``: the ids,
    symbols and case rule of that vocabulary, nothing fitted. Encoding is the original's: every line (an empty one
    too) is lower-cased if the vocabulary says so, split on whitespace and closed by the end-of-line symbol;
    ``punctuation`` (set when fitting; a vocabulary file says it of its own words) also splits each punctuation
    mark off as a word of its own.
    """

    name: ClassVar[str] = "word"
    unit: ClassVar[str] = "word"
    ranked: ClassVar[bool] = True

    def __init__(self, min_freq: int = 1, max_size: int | None = None, words: Iterable[str] = (),
                 file: str | Path | None = None, vocabulary: dict[str, Any] | None = None,
                 punctuation: bool = False) -> None:
        if not isinstance(punctuation, bool):
            raise DataError(f"data.tokenizer_kwargs.punctuation must be true or false, got {punctuation!r}")
        self.punctuation = punctuation
        if min_freq < 1:
            raise DataError(f"data.tokenizer_kwargs.min_freq must be at least 1, got {min_freq}")
        if max_size is not None and max_size < 1:
            raise DataError(f"data.tokenizer_kwargs.max_size must be positive or null, got {max_size}")
        self.min_freq, self.max_size = min_freq, max_size
        self.vocabulary = vocabulary  # a vocabulary file's content, or None (fitted)
        if file is not None:
            if min_freq != 1 or max_size is not None or tuple(words) or punctuation:
                raise DataError("data.tokenizer_kwargs min_freq, max_size and punctuation fit a vocabulary; leave "
                                "them unset when data.tokenizer_file gives one")
            path = existing_file(file, "data.tokenizer_file", "vocab.json")
            self.vocabulary = read_vocabulary(path.read_text(encoding="utf-8"), f"data.tokenizer_file={file}")
        if self.vocabulary is None:
            self._set_words([EOS, UNK] + [w for w in words if w not in (EOS, UNK)], EOS, UNK, False)
        else:
            v = self.vocabulary
            self._set_words(list(v["words"]), v["eos"], v["unk"], v["lower_case"])
            self.punctuation = v.get("punctuation", False)  # the file says how its words were split

    def _set_words(self, itos: list[str], eos: str, unk: str, lower_case: bool) -> None:
        self.itos = itos
        self._stoi = _Lookup((w, i) for i, w in enumerate(self.itos))
        self.eos, self.unk, self.lower_case = eos, unk, lower_case
        self.eos_id, self.unk_id = self._stoi[eos], self._stoi[unk]
        self._stoi.unk_id = self.unk_id

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def fit(self, texts: Iterable[str]) -> None:
        """Count the training split's words (a vocabulary file has nothing to learn)."""
        if self.vocabulary is not None:
            return
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(self.words(text))  # the end-of-line symbol is not ranked
        ranked = [w for w, n in counts.most_common() if n >= self.min_freq and w not in (EOS, UNK)]
        self._set_words([EOS, UNK] + ranked[: self.max_size], EOS, UNK, False)

    def words(self, text: str, close_last_line: bool = True) -> list[str]:
        """The symbols of ``text``: its words, the end-of-line symbol after each line. Lines end where the original
        reader's do (a file read in Python's text mode: at ``\\n``, ``\\r\\n`` or a lone ``\\r``); a last line
        without a newline is closed too, unless ``close_last_line`` is false (a prompt, which the samples continue)."""
        if self.lower_case:
            text = text.lower()
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if self.punctuation:
            text = PUNCTUATION.sub(r" \1 ", text)
        words = text.replace("\n", f" {self.eos} ").split()
        if close_last_line and text and not text.endswith("\n"):
            words.append(self.eos)
        return words

    def encode(self, text: str, unknown: Counter | None = None, close_last_line: bool = True) -> np.ndarray:
        """Ids of the words of ``text``, the end-of-line symbol after each line (:meth:`words`)."""
        words = self.words(text, close_last_line)
        ids = np.fromiter(map(self._stoi.__getitem__, words), dtype=np.int32, count=len(words))
        if unknown is not None and (ids == self.unk_id).any():
            unknown.update(w for w in words if w not in self._stoi)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Words joined by spaces, a newline for each end-of-line symbol."""
        lines, line = [], []
        for i in np.asarray(ids).tolist():
            if i == self.eos_id:
                lines.append(" ".join(line) + "\n")
                line = []
            else:
                line.append(self.itos[i])
        return "".join(lines) + " ".join(line)

    def token_bytes(self) -> np.ndarray:
        """A word counts its UTF-8 bytes plus one separator (the space that followed it), the end-of-line symbol the
        newline, ``<unk>`` the literal ``<unk>`` and its separator (what WikiText writes for the words it replaced).
        A word that this vocabulary lacks counts its own bytes and separator instead: the token cache keeps, for a
        split that has such words, the length of each position (:meth:`unknown_bytes`); bits per byte count those,
        and charge 8 bits for each byte of every ``<unk>`` of that split (:mod:`xl.data.metrics`).

        The sum over a split equals its bytes when each word is followed by exactly one space, the last of a line
        included (``"a b c \\n"``: 7 bytes); a line ending without that space (``"a b c\\n"``) counts one byte more,
        a space before the first word (WikiText's ``" = Title = \\n"``) one byte less, and a run of whitespace,
        which the tokenizer does not keep, counts as one.
        """
        table = [len(w.encode("utf-8")) + 1 for w in self.itos]
        table[self.eos_id] = 1
        return np.array(table, dtype=np.int64)

    def unknown_bytes(self, text: str, ids: np.ndarray) -> np.ndarray:
        """The UTF-8 length, plus one separator, of each word that ``encode(text)`` (``ids``) turned into ``<unk>``,
        in order (the word as looked up: lower-cased where the vocabulary is)."""
        words = self.words(text)
        return np.array([len(words[i].encode("utf-8")) + 1 for i in np.flatnonzero(ids == self.unk_id)],
                        dtype=np.int64)

    def key(self) -> str:
        if self.vocabulary is not None:
            return f"word(vocabulary_sha256={hashlib.sha256(self._vocabulary_text().encode()).hexdigest()})"
        more = ",punctuation=True" if self.punctuation else ""
        return f"word(min_freq={self.min_freq},max_size={self.max_size}{more})"

    def _vocabulary_text(self) -> str:
        v = self.vocabulary
        return vocabulary_json(v["words"], v["eos"], v["unk"], v["lower_case"], v.get("punctuation", False))

    def to_dict(self) -> dict[str, Any]:
        if self.vocabulary is not None:
            return {"name": self.name, "vocabulary": json.loads(self._vocabulary_text())}
        more = {"punctuation": True} if self.punctuation else {}
        return {"name": self.name, "min_freq": self.min_freq, "max_size": self.max_size, "words": self.itos[2:],
                **more}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> WordTokenizer:
        if "vocabulary" in values:
            return cls(vocabulary=read_vocabulary(json.dumps(values["vocabulary"]), "the token cache"))
        return cls(values["min_freq"], values["max_size"], values["words"],
                   punctuation=values.get("punctuation", False))
