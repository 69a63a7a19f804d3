"""Where the text comes from: the embedded stdlib corpus, local text files, or a Hugging Face hub benchmark.

A source gives each split ("train", "val", "test") as an iterator of text chunks that end at line boundaries
(the word tokenizer closes lines with ``<eos>``), an ``identity()`` for the token-cache key, and ``setting()``,
the config setting an error about a split should name. Bytes are decoded with ``surrogateescape`` so the byte
tokenizer gets every file back byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from xl.data.errors import DataError

if TYPE_CHECKING:
    import datasets

SPLITS = ("train", "val", "test")
CHUNK_BYTES = 8 << 20
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})
OFFLINE_HINT = "download the files elsewhere and use data=text data.train=PATH data.val=PATH data.test=PATH"


class Source(Protocol):
    """What the cache needs from a corpus (see the module docstring)."""

    def identity(self) -> str: ...

    def texts(self, split: str) -> Iterator[str]: ...

    def setting(self, split: str) -> str: ...


def decode(data: bytes) -> str:
    """UTF-8 text that re-encodes (with ``surrogateescape``) to exactly ``data``, whatever the bytes are."""
    return data.decode("utf-8", "surrogateescape")


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """A stable ~90/5/5 train/val/test assignment from a hash of the path (same on every machine and run)."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:4], "big") % 100
    return "train" if bucket < 90 else "val" if bucket < 95 else "test"


class StdlibSource:
    """The ``.py`` files of the interpreter's stdlib (~12 MB on Python 3.11): a corpus that needs no download.

    Test suites and ``site-packages`` are left out; files are read in sorted path order, each followed by a
    newline, and assigned to a split as a whole by :func:`split_of`.
    """

    def files(self) -> list[tuple[str, Path]]:
        root = stdlib_dir()
        found = []
        for folder, subdirs, names in os.walk(root):
            subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
            for name in names:
                if name.endswith(".py"):
                    path = Path(folder) / name
                    found.append((path.relative_to(root).as_posix(), path))
        return sorted(found)

    def identity(self) -> str:
        return f"stdlib:{sys.version}:{stdlib_dir()}"

    def texts(self, split: str) -> Iterator[str]:
        for relative, path in self.files():
            if split_of(relative) == split:
                yield decode(path.read_bytes()) + "\n"

    def setting(self, split: str) -> str:
        return f"data=stdlib ({split} split of {stdlib_dir()})"


class TextFilesSource:
    """Three local text files, read as raw bytes so that byte/char token streams reproduce them exactly.

    Hugging Face's ``text`` loader is not used here: it opens files in universal-newline mode and turns
    ``\\r\\n`` into ``\\n``, which would break that exactness.
    """

    def __init__(self, train: str, val: str, test: str) -> None:
        self.paths = {"train": Path(train).expanduser(), "val": Path(val).expanduser(), "test": Path(test).expanduser()}

    def _checked(self, split: str) -> Path:
        path = self.paths[split]
        if path.is_dir():
            raise DataError(f"data.{split}={path} is a folder; set data.{split}=PATH to a text file")
        if not path.is_file():
            raise DataError(f"data.{split} file {path} does not exist; set data.{split}=PATH to a text file")
        if path.stat().st_size == 0:
            raise DataError(f"data.{split} file {path} is empty; set data.{split}=PATH to a non-empty text file")
        return path

    def identity(self) -> str:
        parts = []
        for split in SPLITS:
            stat = self._checked(split).stat()
            parts.append(f"{split}={self.paths[split].resolve()}:{stat.st_size}:{stat.st_mtime_ns}")
        return "files:" + ";".join(parts)

    def texts(self, split: str) -> Iterator[str]:
        with open(self._checked(split), "rb") as f:
            while block := f.read(CHUNK_BYTES):
                yield decode(block + f.readline())

    def setting(self, split: str) -> str:
        return f"data.{split} ({self.paths[split]})"


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark lives on the hub.

    ``lines``: each row is one line of the original file (a newline is restored where the hub dropped it).
    ``carve``: the hub has only a train split; val and test are the last ``carve`` bytes twice over.
    """

    path: str
    config: str | None
    splits: dict[str, str]
    lines: bool = True
    carve: int = 0


HUB_SPLITS = {"train": "train", "val": "validation", "test": "test"}
BENCHMARKS = {
    "wikitext-103": Benchmark("Salesforce/wikitext", "wikitext-103-v1", HUB_SPLITS),
    "wikitext-2": Benchmark("Salesforce/wikitext", "wikitext-2-v1", HUB_SPLITS),
    "enwik8": Benchmark("LTCB/enwik8", "enwik8-raw", {"train": "train"}, lines=False, carve=5_000_000),
    "text8": Benchmark("afmck/text8", None, HUB_SPLITS, lines=False),
}


def offline() -> bool:
    """Whether the environment forbids hub access (read now, not when ``datasets`` was imported)."""
    flags = (os.environ.get("HF_DATASETS_OFFLINE", ""), os.environ.get("HF_HUB_OFFLINE", ""))
    return any(flag.upper() in {"1", "ON", "YES", "TRUE"} for flag in flags)


class HubSource:
    """A paper benchmark from the Hugging Face hub: wikitext-103, wikitext-2, enwik8 or text8.

    Each dataset row is one line (wikitext) or one whole split (enwik8, text8). enwik8 has one 100M-byte row
    that is cut like the Transformer-XL scripts do: the last 10M bytes become 5M val + 5M test. Offline, or
    when the hub cannot be reached, it fails at once with a hint to use local files instead.
    """

    def __init__(self, name: str) -> None:
        if name not in BENCHMARKS:
            raise DataError(f"data.source.name must be one of {sorted(BENCHMARKS)}, got {name!r}")
        self.name = name
        self.benchmark = BENCHMARKS[name]

    def identity(self) -> str:
        b = self.benchmark
        return f"hub:{b.path}:{b.config}:{sorted(b.splits.items())}:carve={b.carve}"

    def setting(self, split: str) -> str:
        return f"data.source.name={self.name} ({split} split)"

    def _load(self, hub_split: str) -> datasets.Dataset:
        if offline():
            raise DataError(f"{self.name} cannot be fetched: HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set; {OFFLINE_HINT}")
        import datasets

        try:
            return datasets.load_dataset(self.benchmark.path, self.benchmark.config, split=hub_split)
        except Exception as e:  # an unreachable hub surfaces as ConnectionError, httpx or hub errors alike
            raise DataError(f"{self.name} could not be loaded from the hub ({type(e).__name__}: {e}); "
                            f"{OFFLINE_HINT}") from e

    def texts(self, split: str) -> Iterator[str]:
        if self.benchmark.carve:
            yield self._carved(split)
            return
        for batch in self._load(self.benchmark.splits[split]).iter(batch_size=10_000):
            rows = batch["text"]
            yield "".join(r if r.endswith("\n") else r + "\n" for r in rows) if self.benchmark.lines else "".join(rows)

    def _carved(self, split: str) -> str:
        data = "".join(self._load(self.benchmark.splits["train"])["text"]).encode("utf-8", "surrogateescape")
        n = self.benchmark.carve
        cuts = {"train": data[: -2 * n], "val": data[-2 * n : -n], "test": data[-n:]}
        return decode(cuts[split])
