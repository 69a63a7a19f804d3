"""Tokenise a source once and keep the ids on disk as memory-mappable ``.npy`` files.

The folder name is a hash of the source identity (its document rule included) and tokenizer settings, so a changed file,
document rule or vocabulary setting gets a fresh folder; a folder whose recorded settings differ from the run's is
refused, never mixed. Each split has its ids (``<split>.npy``) and the offsets where its documents begin
(``<split>.docs.npy``, int64, sorted, from 0), both memory-mapped when read. A split where the tokenizer met text its
vocabulary lacks (read as ``<unk>``, whose one table entry cannot say how many bytes each stands for) also has the UTF-8
length of every position's text (``<split>.bytes.npy``, the smallest unsigned dtype that holds them), so that bits per
byte count the real bytes and charge the spelling of each ``<unk>`` (:mod:`xl.data.metrics`); where the tokenizer's
per-id table is exact (a literal ``<unk>`` in the text included) there is no such file. A split whose source marks
answer pieces (:mod:`xl.data.sources`) also has their token spans (``<split>.answers.npy``, int64 ``[n, 2]`` of start
and end offsets, sorted). A cache is built in a private temporary folder (the fitted vocabulary and the ids it gave,
together) and renamed into place only when complete, ``meta.json`` included, so a crash, a full disk or two processes
building at once never leave a cache that a later run trusts (:mod:`xl.data.workspace`: the temporary folders of killed
builds are swept away).

``meta.json`` records the size of every other file of the folder. Each open compares them, parses the tokenizer and
checks that the vocabulary, the dtypes and the token counts agree with the record (a few ``stat`` calls and the
arrays' headers: nothing is read in full, nothing is tokenised again); a folder that fails is damaged, and is
rebuilt with one line that names it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from xl.data.errors import DataError
from xl.data.progress import Progress, progress, split_bytes
from xl.data.sources import SPLITS, Source, documents
from xl.data.tokenizers import Tokenizer, tokenizer_from_dict
from xl.data.workspace import discard, publish, sweep, workspace

log = logging.getLogger(__name__)

# 2: document start offsets per split; 3: the positions' bytes of a split with <unk>; 4: every file's size;
# 5: a tokenizer file's ids as the file gives them
CACHE_FORMAT = 5
TOP_UNKNOWN = 20
BATCH_CHARS = 16 << 20  # text handed to one (parallel) encode_batch call


@dataclass(frozen=True)
class TokenCache:
    """A complete cache folder opened for reading: the fitted tokenizer, one read-only memmap of ids per split, one
    of the offsets where the split's documents begin, one of each position's UTF-8 length for the splits that
    have ``<unk>`` (``target_bytes``; absent where the tokenizer's table is exact), and one of the answers' token
    spans for the splits whose source marks answers (``answers``)."""

    folder: Path
    tokenizer: Tokenizer
    splits: dict[str, np.ndarray]
    meta: dict[str, Any]
    docs: dict[str, np.ndarray] = field(default_factory=dict)
    target_bytes: dict[str, np.ndarray] = field(default_factory=dict)
    answers: dict[str, np.ndarray] = field(default_factory=dict)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$XL_CACHE_DIR``, else ``~/.cache/xl``."""
    return Path(cache_dir or os.environ.get("XL_CACHE_DIR") or Path.home() / ".cache" / "xl").expanduser()


def cache_folder(source: Source, tokenizer: Tokenizer, cache_dir: str | os.PathLike | None = None) -> Path:
    key = json.dumps({"format": CACHE_FORMAT, "source": source.identity(), "tokenizer": tokenizer.key()})
    return cache_root(cache_dir) / f"{tokenizer.unit}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds every id: uint8, uint16 or int32."""
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65535 else np.int32)


def bytes_dtype(largest: int) -> np.dtype:
    """The smallest unsigned dtype that holds every position's byte count."""
    return np.dtype(np.uint8 if largest <= 0xFF else np.uint16 if largest <= 0xFFFF else np.uint32)


class Damaged(Exception):
    """A cache folder whose files disagree with its ``meta.json``; the message says how, in words."""


def build_cache(source: Source, tokenizer: Tokenizer, cache_dir: str | os.PathLike | None = None) -> Path:
    """Fit ``tokenizer`` on the train split and write every split's ids, unless an intact cache exists."""
    return open_cache(source, tokenizer, cache_dir).folder


def open_cache(source: Source, tokenizer: Tokenizer, cache_dir: str | os.PathLike | None = None) -> TokenCache:
    """Build the cache if needed (or rebuild a damaged one), then memory-map it; the returned tokenizer is the fitted
    one from disk.

    A folder whose recorded source or tokenizer settings are not this run's (a copied cache) is refused.
    """
    folder = cache_folder(source, tokenizer, cache_dir)
    sweep(folder.parent)
    if (folder / "meta.json").is_file():
        try:
            return _read(folder, source, tokenizer)
        except Damaged as err:
            log.warning("the token cache %s is damaged (%s); rebuilding it", folder, err)
            try:
                discard(folder)
            except OSError as cause:  # a cache folder this process may not change
                raise DataError(f"the token cache {folder} is damaged ({err}) and cannot be moved away "
                                f"({cause.strerror or cause}); delete that folder or set data.cache_dir to another "
                                "folder") from None
    try:
        with workspace(folder) as work:
            _build(source, tokenizer, work)
            publish(work, folder, "meta.json")
    except OSError as err:  # nothing half-written is kept: the build's folder is removed or swept later
        raise write_failure(err, folder.parent, cache_dir) from err
    try:
        return _read(folder, source, tokenizer)
    except Damaged as err:
        raise DataError(f"the token cache {folder} does not read back right after it was built ({err}); check the "
                        "disk that holds it, or set data.cache_dir to another folder") from None


def write_failure(err: OSError, root: Path, cache_dir: str | os.PathLike | None) -> DataError:
    """One sentence for a cache build under ``root`` that failed with ``err``, naming its cause: a full disk, a root
    that is not a folder, cannot be created or cannot be written; or a file outside the cache that cannot be read."""
    why = err.strerror or str(err)
    path = Path(err.filename) if err.filename else root
    where = f"data.cache_dir={cache_dir}" if cache_dir else f"the token cache folder {root} (data.cache_dir unset)"
    if path != root and root not in path.parents and path not in root.parents:  # not the cache's own path
        return DataError(f"{path} cannot be read ({why}); make it readable or name another file")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DataError(f"the disk of {where} is full ({why}); free space there or set data.cache_dir to a folder "
                         "on another disk")
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        file = next((p for p in (root, *root.parents) if p.exists()), root)
        return DataError(f"{where} is not a folder ({file} is a file); set data.cache_dir to a folder")
    if err.errno == errno.ENOENT:
        return DataError(f"{where} cannot be created ({path}: {why}); set data.cache_dir to a folder that exists")
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return DataError(f"{where} cannot be written ({why}); set data.cache_dir to a folder this process can write")
    return DataError(f"{where} cannot be written ({why}); set data.cache_dir to another folder")


def _build(source: Source, tokenizer: Tokenizer, folder: Path) -> None:
    """Fit, then encode each split into ``folder``; a fitted subword vocabulary is ranked by the train split's
    counts (:meth:`~xl.data.subwords.SubwordTokenizer.rank_by_frequency`)."""
    start = time.perf_counter()
    with progress(f"fitting the {tokenizer.name} vocabulary on train", split_bytes(source, "train")) as bar:
        tokenizer.fit(bar.reading(_checked_texts(source, "train", tokenizer), after="text read; fitting"))
    fit_seconds = time.perf_counter() - start
    dtype = token_dtype(tokenizer.vocab_size)
    splits, encode_seconds = {}, 0.0
    for split in SPLITS:
        unknown: Counter[str] = Counter()
        encode_start = time.perf_counter()
        ids, starts, empty, n_bytes, position_bytes, answers = encode_documents(source, split, tokenizer, unknown)
        encode_seconds += time.perf_counter() - encode_start
        if ids.size == 0:
            raise DataError(f"{source.setting(split)} gives no tokens; point it at a non-empty corpus")
        if empty:
            log.info("%d document(s) of %s give no tokens and are skipped (no boundary is kept for them)",
                     empty, source.setting(split))
        rank = getattr(tokenizer, "rank_by_frequency", None)
        if split == "train" and rank is not None:
            ids = rank(ids)[ids]
        ids = ids.astype(dtype, copy=False)
        _write_atomic(folder / f"{split}.npy", lambda f, ids=ids: np.save(f, ids))
        _write_atomic(folder / f"{split}.docs.npy", lambda f, starts=starts: np.save(f, starts))
        if position_bytes is not None:
            position_bytes = position_bytes.astype(bytes_dtype(int(position_bytes.max())))
            _write_atomic(folder / f"{split}.bytes.npy", lambda f, b=position_bytes: np.save(f, b))
        if answers is not None:
            _write_atomic(folder / f"{split}.answers.npy", lambda f, a=answers: np.save(f, a))
        table_bytes = int(tokenizer.token_bytes()[ids].sum())
        counted = table_bytes if position_bytes is None else int(position_bytes.sum(dtype=np.int64))
        splits[split] = {"tokens": int(ids.size), "bytes": n_bytes, "token_bytes": table_bytes,
                         "counted_bytes": counted,
                         "unknown": sum(unknown.values()), "unknown_top": unknown.most_common(TOP_UNKNOWN),
                         "documents": int(starts.size), "empty_documents": empty}
    _write_atomic(folder / "tokenizer.json", lambda f: f.write(json.dumps(tokenizer.to_dict()).encode()))
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if not p.name.startswith(".")}
    meta = {"format": CACHE_FORMAT, "source": source.identity(), "tokenizer": tokenizer.key(),
            "unit": tokenizer.unit, "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "splits": splits,
            "files": files, "fit_seconds": round(fit_seconds, 3), "encode_seconds": round(encode_seconds, 3),
            "build_seconds": round(time.perf_counter() - start, 3)}
    _write_atomic(folder / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))


def encode_documents(source: Source, split: str, tokenizer: Tokenizer, unknown: Counter[str]
                     ) -> tuple[np.ndarray, np.ndarray, int, int, np.ndarray | None, np.ndarray | None]:
    """The split's ids, the offsets where its documents begin (int64, from 0), how many documents gave no tokens
    (skipped: their boundary would coincide with the next document's), the split's UTF-8 size, each position's
    UTF-8 length where the split has ``<unk>`` (else None: the tokenizer's table counts every id exactly), and the
    ``[start, end)`` token spans of the pieces marked as answers (None where the source marks none). Subword
    tokenizers get the documents in batches to encode in parallel."""
    encode_batch = getattr(tokenizer, "encode_batch", None)
    unknown_bytes = getattr(tokenizer, "unknown_bytes", None)  # tokenizers that can give <unk>
    table = tokenizer.token_bytes()
    pieces: list[tuple[bool, np.ndarray]] = []  # (a document begins here, ids)
    replaced: dict[int, np.ndarray] = {}  # piece → the bytes of each of its <unk>
    batch: list[tuple[bool, str, int]] = []  # (a document begins here, text, its UTF-8 bytes)
    marked: list[int] = []  # the pieces that are answers
    chars = n_bytes = 0
    with progress(f"encoding {split}", split_bytes(source, split)) as bar:
        for piece in documents(source, split):
            begins, text = piece[0], piece[1]
            if len(piece) > 2 and piece[2]:
                marked.append(len(pieces) + len(batch))
            _check_text(text, source, split, tokenizer)
            size = len(text.encode("utf-8", "surrogateescape"))
            n_bytes += size
            if encode_batch is None:
                missing: Counter[str] = Counter()
                ids = tokenizer.encode(text, missing)
                unknown.update(missing)
                if missing and unknown_bytes is not None:  # not a literal <unk> (WikiText's), which the table counts
                    replaced[len(pieces)] = unknown_bytes(text, ids)
                pieces.append((begins, ids))
                bar.update(size)
                continue
            batch.append((begins, text, size))
            chars += len(text)
            if chars >= BATCH_CHARS:
                pieces += encoded(batch, encode_batch, bar)
                batch, chars = [], 0
        if batch:
            pieces += encoded(batch, encode_batch, bar)
    starts, empty, offset, pending, offsets = [], 0, 0, False, []
    for begins, ids in pieces:
        offsets.append(offset)
        if begins:
            empty += pending  # the previous document ended before it gave a token
            pending = True
        if pending and ids.size:
            starts.append(offset)
            pending = False
        offset += ids.size
    empty += pending
    if starts[:1] != [0] and offset:  # text before the first marked document is a document too
        starts.insert(0, 0)
    ids = np.concatenate([p for _, p in pieces]) if pieces else np.zeros(0, np.int64)
    position_bytes = None
    if replaced:
        parts = [table[p] for _, p in pieces]
        for i, real in replaced.items():
            parts[i][pieces[i][1] == tokenizer.unk_id] = real
        position_bytes = np.concatenate(parts)
    answers = None
    if marked:
        answers = np.array([(offsets[i], offsets[i] + pieces[i][1].size) for i in marked], dtype=np.int64)
    return ids, np.asarray(starts, dtype=np.int64), empty, n_bytes, position_bytes, answers


def encoded(batch: list[tuple[bool, str, int]], encode_batch: Callable[[list[str]], list[np.ndarray]],
            bar: Progress) -> list[tuple[bool, np.ndarray]]:
    """(a document begins, ids) of each (begins, text, bytes) of ``batch``, encoded in one parallel call."""
    ids = encode_batch([text for _, text, _ in batch])
    bar.update(sum(size for *_, size in batch))
    return [(begins, i) for (begins, _, _), i in zip(batch, ids, strict=True)]


def _read(folder: Path, source: Source, tokenizer: Tokenizer) -> TokenCache:
    """Open a complete folder: :class:`Damaged` where its files disagree with ``meta.json`` (sizes, vocabulary,
    dtypes, token counts), :class:`DataError` where it was built with other settings than this run's."""
    meta = _json(folder, "meta.json")
    fitted = _tokenizer(folder)
    found = (meta.get("format"), meta.get("source"), meta.get("tokenizer"), fitted.key())
    if found != (CACHE_FORMAT, source.identity(), tokenizer.key(), tokenizer.key()):
        raise DataError(f"the token cache {folder} was built with other settings ({fitted.key()} on "
                        f"{meta.get('source')}) than this run's ({tokenizer.key()} on {source.identity()}); delete "
                        "that folder or set data.cache_dir to another folder")
    files, splits = meta.get("files"), meta.get("splits")
    if not isinstance(files, dict) or not isinstance(splits, dict) or set(splits) != set(SPLITS):
        raise Damaged("meta.json lacks the record of its files and splits")
    for name in ["tokenizer.json", *(f"{split}{kind}.npy" for split in SPLITS for kind in ("", ".docs"))]:
        if name not in files:
            raise Damaged(f"meta.json does not record {name}")
    for name, size in files.items():
        try:
            actual = (folder / name).stat().st_size
        except FileNotFoundError:
            raise Damaged(f"{name} is missing") from None
        if actual != size:
            raise Damaged(f"{name} is {actual:,} bytes, meta.json records {size:,}")
    if fitted.vocab_size != meta.get("vocab_size"):
        raise Damaged(f"meta.json records vocab_size {meta.get('vocab_size')!r}, tokenizer.json holds "
                      f"{fitted.vocab_size}")
    ids, docs, target_bytes, answers = {}, {}, {}, {}
    for split in SPLITS:
        info = splits[split] if isinstance(splits[split], dict) else {}
        ids[split] = _array(folder, f"{split}.npy", info.get("tokens"), meta.get("dtype"))
        docs[split] = _array(folder, f"{split}.docs.npy", info.get("documents"), "int64")
        if f"{split}.bytes.npy" in files:
            target_bytes[split] = _array(folder, f"{split}.bytes.npy", info.get("tokens"))
        if f"{split}.answers.npy" in files:
            answers[split] = _spans(folder, f"{split}.answers.npy")
    return TokenCache(folder, fitted, ids, meta, docs, target_bytes, answers)


def _json(folder: Path, name: str) -> dict[str, Any]:
    try:
        value = json.loads((folder / name).read_text())
    except FileNotFoundError:
        raise Damaged(f"{name} is missing") from None
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise Damaged(f"{name} cannot be read: {err}") from None
    if not isinstance(value, dict):
        raise Damaged(f"{name} does not hold a mapping")
    return value


def _tokenizer(folder: Path) -> Tokenizer:
    values = _json(folder, "tokenizer.json")
    try:
        return tokenizer_from_dict(values)
    except (KeyError, TypeError, ValueError) as err:
        raise Damaged(f"tokenizer.json does not describe a tokenizer ({type(err).__name__}: {err})") from None


def _spans(folder: Path, name: str) -> np.ndarray:
    """The answer spans ``name``: int64 ``[n, 2]`` (read whole: one pair per answer)."""
    try:
        spans = np.load(folder / name)
    except (OSError, ValueError, EOFError) as err:
        raise Damaged(f"{name} cannot be read: {err}") from None
    if spans.ndim != 2 or spans.shape[1] != 2 or spans.dtype != np.int64:
        raise Damaged(f"{name} holds {spans.shape} values of {spans.dtype.name}, not [n, 2] int64 spans")
    return spans


def _array(folder: Path, name: str, length: Any, dtype: str | None = None) -> np.ndarray:
    """The memory-mapped array ``name``, which must hold ``length`` values (of ``dtype``, where given)."""
    try:
        array = np.load(folder / name, mmap_mode="r")
    except FileNotFoundError:
        raise Damaged(f"{name} is missing") from None
    except (OSError, ValueError, EOFError) as err:
        raise Damaged(f"{name} cannot be read: {err}") from None
    if array.ndim != 1 or array.size != length or (dtype is not None and array.dtype.name != dtype):
        raise Damaged(f"{name} holds {array.size:,} values of {array.dtype.name}, meta.json records {length!r}"
                      + (f" of {dtype}" if dtype else ""))
    return array


def _checked_texts(source: Source, split: str, tokenizer: Tokenizer) -> Iterator[str]:
    """The split's text; for char, word and subword tokenizers, binary data (NUL bytes, invalid UTF-8) is an error."""
    for text in source.texts(split):
        _check_text(text, source, split, tokenizer)
        yield text


def _check_text(text: str, source: Source, split: str, tokenizer: Tokenizer) -> None:
    if tokenizer.unit != "byte" and ("\x00" in text or not _is_utf8(text)):
        raise DataError(f"{source.setting(split)} looks binary (NUL bytes or invalid UTF-8); a {tokenizer.name} "
                        "tokenizer needs text, so fix the file or set data.tokenizer=byte")


def _is_utf8(text: str) -> bool:
    """False when ``text`` holds lone surrogates, i.e. bytes that were not valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _write_atomic(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write through a temporary file in the same folder and rename it over ``path`` only once it is complete."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
