"""A token cache that was damaged after it was built, or a build that was killed half-way: the next run rebuilds or
sweeps it (one line naming the folder), never a traceback, never a vocabulary that disagrees with its ids."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.paths import ROOT
from xl.data import DataError, SegmentDataModule, make_tokenizer, sources
from xl.data.cache import build_cache, cache_folder, open_cache


def write_corpus(folder: Path) -> dict[str, Path]:
    texts = {"train": "the cat sat on the mat\n" * 40, "val": "the cat sat on a hat\n" * 6,
             "test": "a dog sat on the mat\n" * 6}  # val and test hold words the vocabulary lacks (<unk>)
    paths = {}
    for split, text in texts.items():
        paths[split] = folder / f"{split}.txt"
        paths[split].write_text(text)
    return paths


def truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def edit_vocab_size(path: Path) -> None:
    meta = json.loads(path.read_text())
    meta["vocab_size"] += 1
    path.write_text(json.dumps(meta))


DAMAGE = {
    "meta.json truncated": lambda f: truncate(f / "meta.json"),
    "meta.json empty": lambda f: truncate(f / "meta.json", 0),
    "train.npy deleted": lambda f: (f / "train.npy").unlink(),
    "tokenizer.json deleted": lambda f: (f / "tokenizer.json").unlink(),
    "tokenizer.json truncated": lambda f: truncate(f / "tokenizer.json"),
    "train.npy truncated": lambda f: truncate(f / "train.npy"),
    "train.npy one byte short": lambda f: truncate(f / "train.npy", (f / "train.npy").stat().st_size - 1),
    "val.docs.npy deleted": lambda f: (f / "val.docs.npy").unlink(),
    "val.bytes.npy deleted": lambda f: (f / "val.bytes.npy").unlink(),
    "test.npy grown": lambda f: (f / "test.npy").write_bytes((f / "test.npy").read_bytes() + b"\0\0"),
    "vocab_size edited": lambda f: edit_vocab_size(f / "meta.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_is_rebuilt_with_one_line_naming_the_folder(damage, tmp_path, caplog):
    paths = write_corpus(tmp_path)
    kwargs = dict(tokenizer="word", cache_dir=str(tmp_path / "cache"), batch_size=2, tgt_len=4)
    first = SegmentDataModule.from_files(**{k: str(v) for k, v in paths.items()}, **kwargs)
    first.prepare_data()
    folder, vocab = first.cache.folder, first.cache.tokenizer.itos
    ids = {split: np.array(a) for split, a in first.cache.splits.items()}
    assert (folder / "val.bytes.npy").is_file()
    DAMAGE[damage](folder)

    caplog.set_level(logging.INFO)
    again = SegmentDataModule.from_files(**{k: str(v) for k, v in paths.items()}, **kwargs)
    again.prepare_data()  # what train.py runs first: the damage is found and repaired here
    lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith(f"the token cache {folder} is damaged (") and lines[0].endswith("); rebuilding it")
    cache = again.cache
    assert cache.folder == folder and cache.tokenizer.itos == vocab and cache.meta["vocab_size"] == len(vocab)
    assert all(np.array_equal(cache.splits[s], ids[s]) for s in ids)
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # the damaged copy is gone


def test_an_intact_cache_is_checked_without_reading_its_ids(tmp_path, monkeypatch):
    """The check at every start compares sizes: it never tokenises again nor reads the ids."""
    paths = write_corpus(tmp_path)
    source, tokenizer = sources.TextFilesSource(**paths), make_tokenizer("word")
    build_cache(source, tokenizer, tmp_path / "cache")
    monkeypatch.setattr(type(tokenizer), "fit", lambda self, texts: pytest.fail("the vocabulary was fitted again"))
    monkeypatch.setattr(np, "save", lambda *a, **k: pytest.fail("the cache was written again"))
    cache = open_cache(source, make_tokenizer("word"), tmp_path / "cache")
    assert isinstance(cache.splits["train"], np.memmap)
    meta = json.loads((cache.folder / "meta.json").read_text())
    assert meta["files"] == {p.name: p.stat().st_size for p in cache.folder.iterdir() if p.name != "meta.json"}


def test_a_cache_found_damaged_right_after_its_build_is_refused_in_one_sentence(tmp_path, monkeypatch):
    """A build whose files do not read back (a failing disk) is not rebuilt again and again."""
    import xl.data.cache as cache_module

    paths = write_corpus(tmp_path)
    real_build = cache_module._build

    def build_then_lose_a_file(source, tokenizer, folder):
        real_build(source, tokenizer, folder)
        (folder / "train.npy").unlink()

    monkeypatch.setattr(cache_module, "_build", build_then_lose_a_file)
    source = sources.TextFilesSource(**paths)
    with pytest.raises(DataError) as info:
        open_cache(source, make_tokenizer("byte"), tmp_path / "cache")
    folder = cache_folder(source, make_tokenizer("byte"), tmp_path / "cache")
    assert str(info.value) == (f"the token cache {folder} does not read back right after it was built (train.npy "
                               "is missing); check the disk that holds it, or set data.cache_dir to another folder")


# ---- temporaries of killed builds ------------------------------------------------------------------------------
BUILD_THEN_HANG = """
import sys, time
from pathlib import Path
import xl.data.cache as cache
from xl.data import make_tokenizer, sources

real = cache._build
def hang(source, tokenizer, folder):
    real(source, tokenizer, folder)
    print(folder, flush=True)
    time.sleep(600)
cache._build = hang
paths = dict(zip(("train", "val", "test"), sys.argv[2:5]))
cache.build_cache(sources.TextFilesSource(**paths), make_tokenizer("byte"), sys.argv[1])
"""


def start_build(tmp_path: Path, paths: dict[str, Path]) -> tuple[subprocess.Popen, Path]:
    """A build in another process that stops once its temporary folder is full; returns the process and folder."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", BUILD_THEN_HANG, str(tmp_path / "cache"),
                                *(str(paths[s]) for s in ("train", "val", "test"))],
                               stdout=subprocess.PIPE, text=True, env=env)
    return process, Path(process.stdout.readline().strip())


def test_a_killed_build_leaves_no_temporary_folder_for_long(tmp_path):
    paths = write_corpus(tmp_path)
    source = sources.TextFilesSource(**paths)
    other = sources.TextFilesSource(paths["val"], paths["val"], paths["test"])  # another cache in the same root
    process, work = start_build(tmp_path, paths)
    try:
        assert work.is_dir() and work.name.startswith(".") and work.name.endswith(".tmp")
        build_cache(other, make_tokenizer("byte"), tmp_path / "cache")
        assert work.is_dir(), "a build that is still running keeps its folder"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert work.is_dir()  # SIGKILL: the process could not clean up
    folder = build_cache(source, make_tokenizer("byte"), tmp_path / "cache")
    assert not work.exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [folder.name, cache_folder(other, make_tokenizer("byte"), tmp_path / "cache").name])


def test_an_unlocked_temporary_folder_is_swept_only_once_it_is_old(tmp_path):
    """A temporary folder without its lock (its build killed before the lock was taken) is left alone for an hour:
    a build may be just starting."""
    paths = write_corpus(tmp_path)
    root = tmp_path / "cache"
    root.mkdir()
    young, old, locked = (root / f".text-{name}.abc.tmp" for name in ("young", "old", "locked"))
    for work in (young, old, locked):
        work.mkdir()
        (work / "train.npy").write_bytes(b"x" * 1000)
    hour_ago = time.time() - 3700
    os.utime(old, (hour_ago, hour_ago))
    (locked / ".lock").touch()
    os.utime(locked, (hour_ago, hour_ago))
    with open(locked / ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a build (another open file) holds it
        build_cache(sources.TextFilesSource(**paths), make_tokenizer("byte"), root)
        assert young.is_dir() and locked.is_dir() and not old.exists()


def test_a_damaged_cache_in_a_folder_this_process_may_not_change_is_one_sentence(tmp_path, monkeypatch):
    """A shared, read-only cache root: the damage is reported with the folder to delete, not as a traceback."""
    import xl.data.workspace as workspace

    paths = write_corpus(tmp_path)
    source = sources.TextFilesSource(**paths)
    folder = build_cache(source, make_tokenizer("byte"), tmp_path / "cache")
    (folder / "train.npy").unlink()

    def read_only(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(workspace.os, "rename", read_only)
    with pytest.raises(DataError) as info:
        open_cache(source, make_tokenizer("byte"), tmp_path / "cache")
    assert str(info.value) == (f"the token cache {folder} is damaged (train.npy is missing) and cannot be moved away "
                               "(Permission denied); delete that folder or set data.cache_dir to another folder")


def test_a_cache_folder_that_is_a_file_is_called_a_file(tmp_path):
    """data.cache_dir naming a file, or a folder under a file: the sentence names the file, not the disk's space."""
    source = sources.TextFilesSource(**write_corpus(tmp_path))
    (tmp_path / "notes").write_text("not a folder")
    for root in (tmp_path / "notes", tmp_path / "notes" / "cache"):
        with pytest.raises(DataError) as info:
            open_cache(source, make_tokenizer("byte"), root)
        assert str(info.value) == (f"data.cache_dir={root} is not a folder ({tmp_path / 'notes'} is a file); set "
                                   "data.cache_dir to a folder")


@pytest.mark.parametrize("code,why,sentence", [
    (30, "Read-only file system", "data.cache_dir=ROOT cannot be written (Read-only file system); set "
                                  "data.cache_dir to a folder this process can write"),
    (13, "Permission denied", "data.cache_dir=ROOT cannot be written (Permission denied); set data.cache_dir to a "
                              "folder this process can write"),
    (2, "No such file or directory", "data.cache_dir=ROOT cannot be created (ROOT: No such file or directory); set "
                                     "data.cache_dir to a folder that exists"),
    (28, "No space left on device", "the disk of data.cache_dir=ROOT is full (No space left on device); free space "
                                    "there or set data.cache_dir to a folder on another disk"),
])
def test_a_cache_folder_that_cannot_be_written_says_why(code, why, sentence, tmp_path, monkeypatch):
    """A read-only, forbidden, vanished or full cache folder (the error as the disk would give it, raised here in
    this process) is one sentence naming that cause; only a full disk asks for space. A corpus file that cannot be
    read is named as such."""
    import xl.data.cache as cache

    source = sources.TextFilesSource(**write_corpus(tmp_path))
    root = tmp_path / "cache"

    def failing(path):
        def build(*args):
            raise OSError(code, why, str(path))
        return build

    monkeypatch.setattr(cache, "_build", failing(root if code == 2 else root / ".build.tmp" / "train.npy"))
    with pytest.raises(DataError) as info:
        open_cache(source, make_tokenizer("byte"), root)
    assert str(info.value) == sentence.replace("ROOT", str(root))
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []  # nothing half-written
    monkeypatch.setattr(cache, "_build", failing(tmp_path / "train.txt"))
    with pytest.raises(DataError) as info:
        open_cache(source, make_tokenizer("byte"), root)
    assert str(info.value) == f"{tmp_path / 'train.txt'} cannot be read ({why}); make it readable or name another file"
