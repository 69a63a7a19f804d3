"""The vocabulary pickle of a published Transformer-XL: read as plain data in every format it comes in, and every
hostile or oversized file refused in one sentence, before it can run anything or take more memory than its size.

The hostile files are written here opcode by opcode (``pickle``'s own constants), each next to what Python's
unpickler would do with it.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import tracemalloc
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import FIXTURES
from xl.convert import convert
from xl.convert.vocab import LEGACY_TORCH_MAGIC, MAX_BYTES, VocabularyError, read_pickle, vocabulary_from_pickle

FIXTURE = FIXTURES / "transfo_xl"


def the_vocabulary() -> dict:
    return read_pickle(FIXTURE / "vocab.pkl")


def text(s: str) -> bytes:
    data = s.encode("utf-8")
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def put(i: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", i)


def get(i: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", i)


def written(tmp_path: Path, data: bytes, name: str = "vocab.pkl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def peak_bytes(fn, *args) -> tuple[object, int]:
    """What ``fn(*args)`` returns or raises, and the most memory Python held meanwhile."""
    tracemalloc.start()
    try:
        result = fn(*args)
    except Exception as err:  # the refusal is the result to check
        result = err
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, peak


class Stub(dict):
    """What :class:`Recorder` gives for every name: accepts any call, items and state, and does nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass

    def append(self, item) -> None:
        pass

    extend = append


class Recorder(pickle.Unpickler):
    """Python's unpickler, recording the names it is asked for and resolving each to :class:`Stub`."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.names: list[str] = []

    def find_class(self, module: str, name: str):
        self.names.append(f"{module}.{name}")
        return Stub


def names_pickle_asks_for(data: bytes) -> list[str]:
    recorder = Recorder(data)
    recorder.load()
    return recorder.names


def test_vocabulary_reads_alike_from_a_plain_pickle_of_every_protocol_and_both_torch_formats(tmp_path):
    vocab = the_vocabulary()
    assert isinstance(vocab["sym2idx"], OrderedDict) and isinstance(vocab["counter"], Counter)
    vocab["shared"] = vocab["special"]  # a value referred to twice stays one object, as pickle gives it
    zipped = tmp_path / "zip.pkl"
    torch.save(vocab, zipped)
    texts = {vocabulary_from_pickle(FIXTURE / "vocab.pkl")[0], vocabulary_from_pickle(zipped)[0]}
    for protocol in range(6):
        plain = written(tmp_path, pickle.dumps(vocab, protocol=protocol))
        texts.add(vocabulary_from_pickle(plain)[0])
        got = read_pickle(plain)
        assert got == vocab == pickle.loads(plain.read_bytes()) and got["shared"] is got["special"]
        assert type(got["sym2idx"]) is OrderedDict and type(got["counter"]) is Counter
    assert len(texts) == 1


class WritesAFile:
    """A pickle that, loaded with pickle.load, would create a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


class RunsACommand:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class Evaluates:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (eval, (f"open({str(self.path)!r}, 'w')",))


@pytest.mark.parametrize("payload, named", [(WritesAFile, r"(builtins|io)\.open"), (RunsACommand, r"posix\.system"),
                                            (Evaluates, r"(__builtin__|builtins)\.eval")])
@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_a_vocabulary_that_calls_code_is_refused_before_anything_runs(tmp_path, protocol, payload, named):
    target = tmp_path / "pwned"
    vocab = the_vocabulary()
    vocab["payload"] = payload(target)
    hostile = written(tmp_path, pickle.dumps(vocab, protocol=protocol))
    with pytest.raises(VocabularyError, match=f"holds the name {named} .* refused without building anything"):
        read_pickle(hostile)
    legacy = tmp_path / "legacy.pkl"  # the torch legacy layout around it
    legacy.write_bytes(b"".join(pickle.dumps(x, protocol=2) for x in (LEGACY_TORCH_MAGIC, 1001, {})) +
                       pickle.dumps(vocab, protocol=2) + pickle.dumps([], protocol=2))
    source = tmp_path / "src"
    shutil.copytree(FIXTURE, source)
    shutil.copy(legacy, source / "vocab.pkl")
    with pytest.raises(VocabularyError, match=f"holds the name {named}"):
        convert(source, tmp_path / "out")
    assert not target.exists() and not (tmp_path / "out").exists()
    pickle.loads(hostile.read_bytes())
    assert target.exists()  # what an ordinary unpickler would have done


def memo_trick(first: tuple[str, str], second: tuple[str, str]) -> bytes:
    """A pickle whose STACK_GLOBAL reads ``second`` from the memo, while a reader that numbers MEMOIZE entries as
    the largest index + 1 (instead of the memo's size, as pickle does) reads ``first``: each name is stored with an
    explicit index and then, for pickle, overwritten by a MEMOIZE."""
    return (pickle.PROTO + b"\x04" + pickle.MARK + text(first[0]) + put(1) + text(second[0]) + pickle.MEMOIZE
            + text(first[1]) + put(3) + text("pad") + pickle.MEMOIZE + text(second[1]) + pickle.MEMOIZE
            + get(1) + get(3) + pickle.STACK_GLOBAL + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.LIST + pickle.STOP)


def test_memo_entries_are_numbered_as_pickle_numbers_them(tmp_path):
    """The name a pickle calls is the one its own memo gives, whatever a walk with other numbering would see: read
    when that is OrderedDict (a walk numbering otherwise sees os.system), refused when it is os.system (the walk
    sees OrderedDict)."""
    harmless = memo_trick(("os", "system"), ("collections", "OrderedDict"))
    value = read_pickle(written(tmp_path, harmless))
    assert value == pickle.loads(harmless) and value[-1] == OrderedDict()
    hostile = memo_trick(("collections", "OrderedDict"), ("os", "system"))
    assert len(hostile) < 100 and names_pickle_asks_for(hostile) == ["os.system"]
    with pytest.raises(VocabularyError, match=r"holds the name os\.system"):
        read_pickle(written(tmp_path, hostile))


@pytest.mark.parametrize("data, what", [
    (b"\x80\x02c__main__\nThing\n)\x81.", r"the name __main__\.Thing"),
    (b"\x80\x02ccollections\nOrderedDict\n)\x81.", "the pickle instruction NEWOBJ"),  # __new__, not a call
    (b"\x80\x02ccollections\nOrderedDict\n)R}X\x01\x00\x00\x00aNsb.", "the pickle instruction BUILD"),  # attributes
    (b"\x80\x02ccollections\nCounter\n]X\x01\x00\x00\x00aa\x85R.", "Counter called with 1 arguments"),
    (b"\x80\x02ccollections\nOrderedDict\n]\x85R.", "OrderedDict called with 1 arguments"),
    (b"\x80\x02]]\x85R.", "a call of something other than OrderedDict or Counter"),
    (b"\x80\x02X\x01\x00\x00\x000Q.", "the pickle instruction BINPERSID"),  # a stored tensor
    (b"\x80\x02\x82\x01.", "the pickle instruction EXT1"),  # copyreg's extension registry
    (b"\x80\x02(X\x02\x00\x00\x00lsios\nsystem\n.", "the pickle instruction INST"),  # a name and its call in one
    (b"\x80\x02C\x03abc.", "the pickle instruction SHORT_BINBYTES"),
    (b"\x80\x04K\x01K\x02\x93.", "a name made of values other than strings"),  # STACK_GLOBAL of two numbers
])
def test_instructions_that_build_anything_else_are_refused(tmp_path, data, what):
    with pytest.raises(VocabularyError, match=f"holds {what}"):
        read_pickle(written(tmp_path, data))


def test_a_pickle_allocates_no_more_than_its_size(tmp_path):
    """Python's unpickler trusts the sizes a pickle declares: a memo index (a 9-byte file makes it allocate
    1.4 GB; index 2**31 ends in MemoryError), a byte string's length. Here the memo holds what is stored and a
    declared length must be in the file."""
    for index in (87_500_000, 2**31, 2**32 - 1):
        nine_bytes = pickle.PROTO + b"\x02" + pickle.NONE + put(index) + pickle.STOP
        value, peak = peak_bytes(read_pickle, written(tmp_path, nine_bytes))
        assert len(nine_bytes) == 9 and value is None and peak < 2**20
    declared = pickle.PROTO + b"\x04" + pickle.BINUNICODE8 + struct.pack("<Q", 1_400_000_000) + b"abc"
    value, peak = peak_bytes(read_pickle, written(tmp_path, declared))
    assert isinstance(value, VocabularyError) and "not a readable pickle" in str(value) and peak < 2**20


@pytest.mark.parametrize("pattern", ["dict of three-letter keys", "None", "memo entries"])
def test_the_costliest_pickles_take_about_twenty_bytes_of_memory_per_byte(tmp_path, monkeypatch, pattern):
    """What the reader builds is bounded by the file: a value per instruction, keys of one dict, memo entries up to
    MAX_MEMO (here 10,000, to refuse the 10,001st)."""
    monkeypatch.setattr("xl.convert.plain_pickle.MAX_MEMO", 10_000)
    n = 2**18 // 6
    if pattern == "dict of three-letter keys":
        keys = (bytes([33 + i % 90, 33 + i // 90 % 90, 33 + i // 8100 % 90]) for i in range(n))
        body = b"".join(pickle.SHORT_BINUNICODE + b"\x03" + k + pickle.NONE for k in keys) + pickle.DICT
    elif pattern == "None":
        body = pickle.NONE * (6 * n) + pickle.LIST
    else:
        body = (pickle.NONE + pickle.MEMOIZE) * 10_001 + pickle.LIST
    data = pickle.PROTO + b"\x02" + pickle.MARK + body + pickle.STOP
    value, peak = peak_bytes(read_pickle, written(tmp_path, data))
    if pattern == "memo entries":
        assert isinstance(value, VocabularyError) and "more than 10000 memo entries" in str(value)
    else:
        assert len(value) in (n, 6 * n) and peak < 24 * len(data)


def nested(depth: int) -> bytes:
    """A list inside a list ... ``depth`` deep."""
    return pickle.PROTO + b"\x02" + pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1) + pickle.STOP


def test_deep_nesting_is_read_without_recursion_up_to_the_container_limit(tmp_path):
    value = read_pickle(written(tmp_path, nested(4000)))
    for _ in range(3999):
        (value,) = value
    assert value == []
    with pytest.raises(VocabularyError, match="more than 4096 lists, tuples and dicts"):
        read_pickle(written(tmp_path, nested(1_000_000)))


def test_keys_that_cost_more_than_their_size_to_hash_are_refused(tmp_path):
    """A tuple's hash is not cached: a pair of the level below, 24 levels deep, hashes 2**24 tuples (each level
    doubles it) from a file of 300 bytes. Keys are strings."""
    levels = pickle.EMPTY_TUPLE + put(0) + b"".join(get(i) + pickle.TUPLE2 + put(i + 1) for i in range(24))
    data = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + levels + pickle.NONE + pickle.SETITEM + pickle.STOP
    assert len(data) < 300
    with pytest.raises(VocabularyError, match="holds a dict key of type tuple"):
        read_pickle(written(tmp_path, data))


def test_a_dict_copied_into_counters_again_and_again_is_refused(tmp_path):
    """Counter(d) copies d: one dict of 20,000 words referred to 500 times would build 10 million entries from a
    file of 300 kB."""
    words = b"".join(text(f"w{i}") + pickle.BININT2 + struct.pack("<H", i % 65536) for i in range(20000))
    data = (pickle.PROTO + b"\x02" + pickle.MARK + pickle.GLOBAL + b"collections\nCounter\n" + put(0)
            + pickle.EMPTY_DICT + pickle.MARK + words + pickle.SETITEMS + put(1)
            + (get(0) + get(1) + pickle.TUPLE1 + pickle.REDUCE) * 500 + pickle.LIST + pickle.STOP)
    assert len(data) < 300_000
    value, peak = peak_bytes(read_pickle, written(tmp_path, data))
    assert isinstance(value, VocabularyError) and "Counters copied from one dict" in str(value)
    assert peak < 64 * 2**20


def test_files_and_zip_members_beyond_the_limit_are_refused_unread(tmp_path):
    big = tmp_path / "big.pkl"
    with open(big, "wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: nothing to read, if it were read
    value, peak = peak_bytes(read_pickle, big)
    assert isinstance(value, VocabularyError) and "67,108,865 bytes, more than the 67,108,864" in str(value)
    assert peak < 2**20
    bomb = tmp_path / "bomb.pkl"  # a zip of 65 kB that inflates to 64 MiB and a byte
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("archive/data.pkl", "w") as member:
            for _ in range(64):
                member.write(bytes(2**20))
            member.write(b"\0")
    assert bomb.stat().st_size < 2**20
    value, peak = peak_bytes(read_pickle, bomb)
    assert isinstance(value, VocabularyError) and "data.pkl holds 67,108,865 bytes" in str(value) and peak < 2**20
    data = bytearray(bomb.read_bytes())  # the same zip claiming its member inflates to 100 bytes
    for header, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        start = data.index(header)
        data[start + at : start + at + 4] = struct.pack("<I", 100)
    value, peak = peak_bytes(read_pickle, written(tmp_path, bytes(data), "liar.pkl"))
    assert isinstance(value, VocabularyError) and "damaged zip archive (Bad CRC-32" in str(value) and peak < 2**20


def test_a_torch_file_with_tensors_or_trailing_bytes_is_refused(tmp_path):
    vocab = the_vocabulary()
    vocab["table"] = torch.zeros(3)
    path = tmp_path / "tensor.pkl"
    torch.save(vocab, path, _use_new_zipfile_serialization=False)
    with pytest.raises(VocabularyError, match=r"holds the name torch\._utils\._rebuild_tensor_v2"):
        read_pickle(path)
    header = b"".join(pickle.dumps(x, protocol=2) for x in (LEGACY_TORCH_MAGIC, 1001, {}))
    with pytest.raises(VocabularyError, match="holds tensors; a vocabulary holds none"):
        read_pickle(written(tmp_path, header + pickle.dumps(the_vocabulary(), 2) + pickle.dumps(["0"], 2)))
    with pytest.raises(VocabularyError, match="goes on after its pickle ended"):
        read_pickle(written(tmp_path, pickle.dumps(the_vocabulary()) + b"junk"))
    with pytest.raises(VocabularyError, match="not a readable pickle"):
        read_pickle(written(tmp_path, pickle.dumps(the_vocabulary())[:-30]))


def test_a_vocabulary_written_by_transformers_save_pretrained_is_refused_with_the_way_out():
    """TransfoXLTokenizer.save_pretrained pickles the whole tokenizer: compiled patterns (re._compile), Moses
    tools, its added tokens. Its plain attributes are the vocabulary; docs/pretrained.md says how to keep them."""
    path = FIXTURE / "save_pretrained_vocab.pkl"
    names = names_pickle_asks_for(path.read_bytes())
    assert names[:2] == ["collections.Counter", "re._compile"] and "sacremoses.tokenize.MosesTokenizer" in names
    with pytest.raises(VocabularyError, match=r"holds the name re\._compile .* a whole TransfoXLTokenizer written by "
                                              r"transformers' save_pretrained.*docs/pretrained\.md"):
        read_pickle(path)
