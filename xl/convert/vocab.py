"""Read a Transformer-XL vocabulary pickle without running any of its code.

The published vocabulary (``vocab.pkl`` or ``vocab.bin``) holds the attributes of the original ``Vocab`` object:
``idx2sym`` (every id's word), ``sym2idx`` (an ``OrderedDict``), ``counter`` (a ``Counter``), ``special``,
``lower_case``, ``delimiter``, ... It comes as a plain pickle, or as ``torch.save`` wrote it (the legacy format:
a magic number, a protocol number and a system record before the object, and the list of its tensors after it; or
a zip holding ``data.pkl``). Each pickle is read by :mod:`xl.convert.plain_pickle`, which builds plain data and
refuses anything else in one sentence. The file, and the pickle a zip inflates to, are refused unread beyond
:data:`MAX_BYTES`.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path
from typing import Any

from xl.convert.plain_pickle import PickleError, load
from xl.data.words import vocabulary_json

LEGACY_TORCH_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a file torch.save wrote in its legacy format
# A vocabulary of the published WikiText-103 one's size (267,735 words with their counts) takes about 10 MiB.
MAX_BYTES = 64 * 2**20
# Modules whose objects transformers' TransfoXLTokenizer.save_pretrained pickles along with the vocabulary.
TOKENIZER_OBJECT_MODULES = ("re.", "sacremoses.", "transformers.", "tokenizers.")


class VocabularyError(ValueError):
    """A vocabulary file that cannot be read safely or does not describe a word vocabulary."""


def too_large(at: str, size: int) -> VocabularyError:
    return VocabularyError(f"{at} holds {size:,} bytes, more than the {MAX_BYTES:,} a word vocabulary needs (one of "
                           "WikiText-103's 267,735 words takes about 10 MiB); it is refused unread")


def pickled_bytes(path: Path, at: str) -> bytes:
    """The file's pickles: the file itself, or the ``data.pkl`` of a zip that ``torch.save`` wrote."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise too_large(at, size)
    with open(path, "rb") as f:
        data = f.read(size)  # no more than was checked, should it grow meanwhile
    if not zipfile.is_zipfile(io.BytesIO(data)):
        return data
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = [m for m in archive.infolist() if m.filename == "data.pkl" or m.filename.endswith("/data.pkl")]
            if len(members) != 1:
                raise VocabularyError(f"{at} is a zip archive without one data.pkl; it is not a saved vocabulary")
            if members[0].file_size > MAX_BYTES:
                raise too_large(f"{at}'s {members[0].filename}", members[0].file_size)
            with archive.open(members[0]) as member:  # inflates no more than the size declared (its CRC checked)
                return member.read(members[0].file_size)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, zlib.error) as err:
        raise VocabularyError(f"{at} is a damaged zip archive ({err})") from None


def read_pickle(path: Path) -> Any:
    """The object in a vocabulary file: a plain pickle, or either format of ``torch.save``."""
    at = f"the vocabulary {path}"
    stream = io.BytesIO(pickled_bytes(path, at))
    try:
        first = load(stream, at)
        if first != LEGACY_TORCH_MAGIC:
            value, rest = first, stream.read(1)
        else:  # the protocol number, the system record, the object, the keys of its tensors
            _, _, value, tensors = (load(stream, at) for _ in range(4))
            if tensors != []:
                raise VocabularyError(f"{at} holds tensors; a vocabulary holds none, so it is refused")
            rest = stream.read(1)
    except PickleError as err:
        if err.name is not None and err.name.startswith(TOKENIZER_OBJECT_MODULES):
            raise VocabularyError(
                f"{err}; it looks like a whole TransfoXLTokenizer written by transformers' save_pretrained, whose "
                "plain attributes can be saved on their own where the file is trusted (docs/pretrained.md)") from None
        raise VocabularyError(str(err)) from None
    if rest:
        raise VocabularyError(f"{at} goes on after its pickle ended; it is damaged or not a vocabulary")
    return value


def unknown_symbol(vocab: dict[str, Any], words: list[str], at: str) -> str:
    """The word an unknown word reads as, by transformers' rule (TransfoXLTokenizer._convert_token_to_id, the
    original's ``get_idx``): the stored ``unk_idx``'s word where the vocabulary has one, else ``<unk>``, else
    ``<UNK>``."""
    if "unk_idx" in vocab:
        index = vocab["unk_idx"]
        if type(index) is not int or not 0 <= index < len(words):
            shown = index if type(index) is int else f"a {type(index).__name__}"
            raise VocabularyError(f"{at}: unk_idx={shown} is not the id of one of its {len(words)} words")
        return words[index]
    for unk in ("<unk>", "<UNK>"):
        if unk in words:
            return unk
    raise VocabularyError(f"{at} has neither unk_idx nor <unk> nor <UNK>; an unknown word would have no id")


def vocabulary_from_pickle(path: Path) -> tuple[str, dict[str, Any]]:
    """The word vocabulary file's text (:func:`xl.data.words.vocabulary_json`) for a Transformer-XL vocabulary pickle,
    and a summary of what was read; anything our word tokenizer would not reproduce exactly is refused."""
    vocab = read_pickle(path)
    at = f"the vocabulary {path}"
    if not isinstance(vocab, dict) or not isinstance(vocab.get("idx2sym"), list):
        raise VocabularyError(f"{at} has no idx2sym word list; it is not a Transformer-XL vocabulary")
    words = vocab["idx2sym"]
    if not all(type(w) is str and w for w in words) or len(set(words)) != len(words):
        raise VocabularyError(f"{at}: idx2sym must hold distinct non-empty strings")
    sym2idx = vocab.get("sym2idx")
    if sym2idx is not None and (not isinstance(sym2idx, dict) or len(sym2idx) != len(words)
                                or any(sym2idx.get(w) != i for i, w in enumerate(words))):
        raise VocabularyError(f"{at}: sym2idx does not give each word of idx2sym its position; the file is damaged")
    delimiter = vocab.get("delimiter")
    if delimiter is not None:
        shown = repr(delimiter) if type(delimiter) is str else f"a {type(delimiter).__name__}"
        raise VocabularyError(f"{at} splits lines on delimiter={shown}; only whitespace-separated words "
                              "(delimiter None) are supported")
    if "<eos>" not in words:
        raise VocabularyError(f"{at} has no <eos> symbol; only vocabularies that close every line with <eos> "
                              "(WikiText's layout) are supported")
    unk = unknown_symbol(vocab, words, at)
    lower_case = vocab.get("lower_case", False)
    if type(lower_case) is not bool:
        raise VocabularyError(f"{at}: lower_case must be true or false, not a {type(lower_case).__name__}")
    summary = {"words": len(words), "eos_id": words.index("<eos>"), "unk_id": words.index(unk), "unk": unk,
               "lower_case": lower_case}
    return vocabulary_json(words, "<eos>", unk, lower_case), summary
