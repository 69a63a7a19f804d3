"""Read a Transformer-XL vocabulary pickle without running any of its code.

The published vocabulary (``vocab.pkl`` or ``vocab.bin``) holds the attributes of the original ``Vocab`` object:
``idx2sym`` (every id's word), ``sym2idx`` (an ``OrderedDict``), ``counter`` (a ``Counter``), ``special``,
``lower_case``, ``delimiter``, ... It comes as a plain pickle, or as ``torch.save`` wrote it (the legacy format:
a magic number, a protocol number and a system record before the object; or a zip holding ``data.pkl``).
A pickle is a program: ``pickle.load`` would build whatever objects it names, so this reader first walks the
opcodes without executing them and refuses, in one sentence, any that could name or build something other than
plain containers, strings and numbers and those two ``collections`` classes. Only then does it unpickle, with an
unpickler that again resolves nothing else.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

from xl.data.words import vocabulary_json

ALLOWED_GLOBALS = {("collections", "OrderedDict"), ("collections", "Counter")}
# Opcodes that build containers, strings and numbers, keep and fetch memo entries, frame the stream, and call one of
# ALLOWED_GLOBALS (REDUCE, whose callable can only be such a class here).
SAFE_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "GET",
    "BINGET", "LONG_BINGET", "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1",
    "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
    "BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "EMPTY_LIST", "APPEND",
    "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT", "DICT", "SETITEM",
    "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET", "GLOBAL", "STACK_GLOBAL", "REDUCE",
}
STRING_OPCODES = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                  "SHORT_BINSTRING"}
LEGACY_TORCH_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a file torch.save wrote in its legacy format


class VocabularyError(ValueError):
    """A vocabulary file that cannot be read safely or does not describe a word vocabulary."""


def check_opcodes(data: bytes, at: str) -> int:
    """Walk the pickle at the start of ``data`` without executing it; refuse any opcode or global outside the
    allowed ones. Returns where the pickle ends."""
    strings: dict[int, str] = {}  # memo index -> string, to resolve STACK_GLOBAL's operands
    recent: list[str | None] = []  # the last two values pushed, when they are strings
    memo_next = 0
    end = len(data)
    stream = io.BytesIO(data)
    try:
        for op, arg, pos in pickletools.genops(stream):
            name = op.name
            if name not in SAFE_OPCODES:
                raise VocabularyError(f"{at} holds a pickle opcode {name} (at byte {pos}) that could build or run "
                                      "something other than plain data; refusing to read it")
            if name in ("GLOBAL", "STACK_GLOBAL"):
                module, _, attr = arg.partition(" ") if name == "GLOBAL" else (recent[-2] or "", "", recent[-1] or "")
                if (module, attr) not in ALLOWED_GLOBALS:
                    shown = f"{module}.{attr}" if module or attr else "a name computed at load time"
                    raise VocabularyError(f"{at} names {shown} (at byte {pos}); a vocabulary may only hold plain "
                                          "containers, strings, numbers, OrderedDict and Counter, so it is refused")
            if name in STRING_OPCODES:
                recent = (recent + [arg])[-2:]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent = (recent + [strings.get(arg)])[-2:]
            elif name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                index = memo_next if name == "MEMOIZE" else arg
                if recent and recent[-1] is not None:
                    strings[index] = recent[-1]
                else:
                    strings.pop(index, None)
                memo_next = max(memo_next, index + 1)
            elif name not in ("FRAME", "PROTO"):
                recent = (recent + [None])[-2:]
            if name == "STOP":
                end = stream.tell()
                break
    except VocabularyError:
        raise
    except Exception as err:  # pickletools raises ValueError and others for a truncated or garbled stream
        raise VocabularyError(f"{at} is not a readable pickle ({err})") from None
    return end


class _PlainUnpickler(pickle.Unpickler):
    """Resolves only OrderedDict and Counter (the opcodes were checked before this runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise VocabularyError(f"the vocabulary names {module}.{name}; refusing to read it")
        import collections

        return getattr(collections, name)

    def persistent_load(self, pid: Any) -> Any:
        raise VocabularyError("the vocabulary refers to stored tensors; a vocabulary holds none, so it is refused")


def check_all(data: bytes, at: str) -> list[int]:
    """Check every pickle in ``data`` (torch's legacy format writes several in a row) before any is loaded; returns
    where each one starts."""
    starts, offset = [], 0
    while offset < len(data):
        starts.append(offset)
        offset += check_opcodes(data[offset:], at)
    return starts


def load_plain(data: bytes) -> Any:
    """The pickle at the start of ``data``, its opcodes already checked."""
    return _PlainUnpickler(io.BytesIO(data), encoding="latin1").load()


def read_pickle(path: Path) -> Any:
    """The object in a vocabulary file: a plain pickle, or either format of ``torch.save``."""
    data = path.read_bytes()
    at = f"the vocabulary {path}"
    if zipfile.is_zipfile(io.BytesIO(data)):
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise VocabularyError(f"{at} is a zip archive without one data.pkl; it is not a saved vocabulary")
            data = archive.read(names[0])
    starts = check_all(data, at)
    if not starts:
        raise VocabularyError(f"{at} is empty")
    first = load_plain(data[starts[0]:])
    if first != LEGACY_TORCH_MAGIC:
        return first
    if len(starts) < 4:  # the magic number, the protocol number, the system record, the object
        raise VocabularyError(f"{at} is a truncated torch.save file")
    return load_plain(data[starts[3]:])


def vocabulary_from_pickle(path: Path) -> tuple[str, dict[str, Any]]:
    """The word vocabulary file's text (:func:`xl.data.words.vocabulary_json`) for a Transformer-XL vocabulary pickle,
    and a summary of what was read; anything our word tokenizer would not reproduce exactly is refused."""
    vocab = read_pickle(path)
    at = f"the vocabulary {path}"
    if not isinstance(vocab, dict) or not isinstance(vocab.get("idx2sym"), list):
        raise VocabularyError(f"{at} has no idx2sym word list; it is not a Transformer-XL vocabulary")
    words = vocab["idx2sym"]
    if not all(isinstance(w, str) and w for w in words) or len(set(words)) != len(words):
        raise VocabularyError(f"{at}: idx2sym must hold distinct non-empty strings")
    sym2idx = vocab.get("sym2idx")
    if sym2idx is not None and (len(sym2idx) != len(words) or any(sym2idx.get(w) != i for i, w in enumerate(words))):
        raise VocabularyError(f"{at}: sym2idx does not give each word of idx2sym its position; the file is damaged")
    delimiter = vocab.get("delimiter")
    if delimiter is not None:
        raise VocabularyError(f"{at} splits lines on delimiter={delimiter!r}; only whitespace-separated words "
                              "(delimiter None) are supported")
    if "<eos>" not in words:
        raise VocabularyError(f"{at} has no <eos> symbol; only vocabularies that close every line with <eos> "
                              "(WikiText's layout) are supported")
    unk = next((u for u in ("<unk>", "<UNK>") if u in words), None)
    if unk is None:
        raise VocabularyError(f"{at} has neither <unk> nor <UNK>; an unknown word would have no id")
    lower_case = bool(vocab.get("lower_case", False))
    summary = {"words": len(words), "eos_id": words.index("<eos>"), "unk_id": words.index(unk), "unk": unk,
               "lower_case": lower_case}
    return vocabulary_json(words, "<eos>", unk, lower_case), summary
