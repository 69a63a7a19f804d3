"""Where the text comes from: the embedded stdlib corpus, local text files, or a Hugging Face hub benchmark.

A source gives each split ("train", "val", "test") as an iterator of text chunks that end at line boundaries
(the word tokenizer closes lines with ``<eos>``), an ``identity()`` for the token-cache key, and ``setting()``,
the config setting an error about a split should name. Bytes are decoded with ``surrogateescape`` so the byte
tokenizer gets every file back byte for byte.

A source may also say where its documents begin (:func:`documents`): each stdlib file, each local file, each
WikiText article (its `` = Title = `` heading line). :class:`SeparatedSource` cuts any source's documents further
at lines that match ``data.doc_sep``. Boundaries never change the text: a separator line stays in the stream, as
the first line of the document it begins. A source may also mark pieces as answers, ``(begins, text, True)``
(``data=babilong``'s samples): the token cache records where their tokens are, for a loss on them alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import sysconfig
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from xl.data.errors import DataError

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
CHUNK_BYTES = 8 << 20
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})
LOCAL_FILES = "data=text data.train=PATH data.val=PATH data.test=PATH"  # a hub benchmark fetched elsewhere
REACH_SECONDS = 5  # the hub's one reachability check; datasets itself retries for about 23 s


class Source(Protocol):
    """What the cache needs from a corpus (see the module docstring). A source that can tell a split's size in bytes
    without reading it also has ``nbytes(split)``, which gives the cache's progress bars a total."""

    def identity(self) -> str: ...

    def texts(self, split: str) -> Iterator[str]: ...

    def setting(self, split: str) -> str: ...


Piece = tuple[bool, str] | tuple[bool, str, bool]  # (a document begins with this text, the text[, an answer])


def documents(source: Source, split: str) -> Iterator[Piece]:
    """The split's text in order, each piece saying whether a document begins with it. A source without a
    ``documents`` method is one document per split."""
    method = getattr(source, "documents", None)
    if method is not None:
        return method(split)
    return ((i == 0, text) for i, text in enumerate(source.texts(split)))


def line_pattern(doc_sep: str, regex: bool, setting: str = "data.doc_sep") -> re.Pattern[str]:
    """Lines that begin a document: those equal to ``doc_sep``, or (``regex``) those that it matches whole.
    A ``\\r`` before the newline is not part of the line."""
    body = doc_sep if regex else re.escape(doc_sep)
    try:
        return re.compile(rf"^(?:{body})\r?$", re.MULTILINE)
    except re.error as err:
        raise DataError(f"{setting}={doc_sep!r} is not a valid regular expression ({err}); fix it, or set "
                        "data.doc_sep_regex=false to match it as a literal line") from err


def cut_at_lines(pieces: Iterable[Piece], pattern: re.Pattern[str]) -> Iterator[tuple[Piece, int]]:
    """``pieces`` cut before every line that ``pattern`` matches; each new piece begins a document. Yields
    (piece, matches in it) so that a caller can tell a rule that never matched."""
    for begins, text in pieces:
        cuts = [m.start() for m in pattern.finditer(text) if m.start() < len(text)]  # not the empty end "line"
        matches = len(cuts)
        if cuts and cuts[0] == 0:
            begins, cuts = True, cuts[1:]
        bounds = [0, *cuts, len(text)]
        for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            yield (begins or k > 0, text[a:b]), matches if k == 0 else 0


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

    def nbytes(self, split: str) -> int:
        return sum(path.stat().st_size + 1 for relative, path in self.files() if split_of(relative) == split)

    def documents(self, split: str) -> Iterator[Piece]:
        """Every file is one document."""
        return ((True, text) for text in self.texts(split))


class TextFilesSource:
    """Local text files, one path or a list of paths per split, read as raw bytes so that byte/char token streams
    reproduce them exactly. Each file is one document (``data.doc_sep`` cuts them further).

    Hugging Face's ``text`` loader is not used here: it opens files in universal-newline mode and turns
    ``\\r\\n`` into ``\\n``, which would break that exactness.
    """

    def __init__(self, train: str | Sequence[str], val: str | Sequence[str], test: str | Sequence[str]) -> None:
        self.paths = {split: [Path(p).expanduser() for p in ([paths] if isinstance(paths, (str, os.PathLike))
                                                             else paths)]
                      for split, paths in zip(SPLITS, (train, val, test), strict=True)}

    def _checked(self, split: str) -> list[Path]:
        paths = self.paths[split]
        if not paths:
            raise DataError(f"data.{split} is an empty list; set data.{split}=PATH or a list of text files")
        for path in paths:
            if path.is_dir():
                raise DataError(f"data.{split}={path} is a folder; set data.{split}=PATH to a text file")
            if not path.is_file():
                raise DataError(f"data.{split} file {path} does not exist; set data.{split}=PATH to a text file")
        if all(path.stat().st_size == 0 for path in paths):
            what = f"file {paths[0]} is" if len(paths) == 1 else "files are all"
            raise DataError(f"data.{split} {what} empty; set data.{split}=PATH to a non-empty text file")
        return paths

    def identity(self) -> str:
        parts = []
        for split in SPLITS:
            for path in self._checked(split):
                stat = path.stat()
                parts.append(f"{split}={path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")
        return "files:" + ";".join(parts)

    def texts(self, split: str) -> Iterator[str]:
        return (text for _, text in self._blocks(split))

    def nbytes(self, split: str) -> int:
        return sum(path.stat().st_size for path in self._checked(split))

    def documents(self, split: str) -> Iterator[Piece]:
        """The files' blocks in order; the first block of each file begins a document (an empty file yields one
        empty piece, which the cache skips)."""
        return self._blocks(split)

    def _blocks(self, split: str) -> Iterator[Piece]:
        for path in self._checked(split):
            with open(path, "rb") as f:
                yield True, decode(f.read(CHUNK_BYTES) + f.readline())
                while block := f.read(CHUNK_BYTES):
                    yield False, decode(block + f.readline())

    def setting(self, split: str) -> str:
        paths = self.paths[split]
        return f"data.{split} ({paths[0] if len(paths) == 1 else ', '.join(map(str, paths))})"


class SeparatedSource:
    """Another source whose documents are cut further before every line that ``doc_sep`` matches (the line
    itself begins the new document: the text is unchanged). A rule that matches no line of a split is logged."""

    def __init__(self, source: Source, doc_sep: str, regex: bool = False) -> None:
        self.source, self.doc_sep, self.regex = source, doc_sep, regex
        self.pattern = line_pattern(doc_sep, regex)

    def identity(self) -> str:
        return f"{self.source.identity()}|doc_sep={'regex' if self.regex else 'line'}:{self.doc_sep!r}"

    def texts(self, split: str) -> Iterator[str]:
        return self.source.texts(split)

    def setting(self, split: str) -> str:
        return self.source.setting(split)

    def nbytes(self, split: str) -> int | None:
        nbytes = getattr(self.source, "nbytes", None)
        return nbytes(split) if nbytes is not None else None

    def documents(self, split: str) -> Iterator[Piece]:
        matches = 0
        for piece, n in cut_at_lines(documents(self.source, split), self.pattern):
            matches += n
            yield piece
        if not matches:
            log.warning("data.doc_sep=%r matches no line of %s: its documents are not cut further (each file or "
                        "source document stays one document)", self.doc_sep, self.source.setting(split))


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark lives on the hub.

    ``lines``: each row is one line of the original file (a newline is restored where the hub dropped it).
    ``carve``: the hub has only a train split; val and test are the last ``carve`` bytes twice over.
    ``headings``: a regular expression for the lines that begin a document (None: each split is one document).
    """

    path: str
    config: str | None
    splits: dict[str, str]
    lines: bool = True
    carve: int = 0
    headings: str | None = None


HUB_SPLITS = {"train": "train", "val": "validation", "test": "test"}
WIKITEXT_TITLE = r" = [^=].* = "  # an article's title line; section headings are " = = Name = = "
BENCHMARKS = {
    "wikitext-103": Benchmark("Salesforce/wikitext", "wikitext-103-v1", HUB_SPLITS, headings=WIKITEXT_TITLE),
    "wikitext-2": Benchmark("Salesforce/wikitext", "wikitext-2-v1", HUB_SPLITS, headings=WIKITEXT_TITLE),
    "enwik8": Benchmark("LTCB/enwik8", "enwik8-raw", {"train": "train"}, lines=False, carve=5_000_000),
    "text8": Benchmark("afmck/text8", None, HUB_SPLITS, lines=False),
}


def offline() -> bool:
    """Whether the environment forbids hub access (read now, not when ``datasets`` was imported)."""
    flags = (os.environ.get("HF_DATASETS_OFFLINE", ""), os.environ.get("HF_HUB_OFFLINE", ""))
    return any(flag.upper() in {"1", "ON", "YES", "TRUE"} for flag in flags)


def hub_unreachable() -> str | None:
    """Why the hub's endpoint (``HF_ENDPOINT``, as huggingface_hub reads it) does not answer within REACH_SECONDS,
    or None when it answers (with any HTTP status). One request, through the proxies the environment names."""
    from huggingface_hub import constants

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=REACH_SECONDS)
    except urllib.error.HTTPError:  # an answer: the hub is there
        return None
    except (OSError, ValueError) as err:  # URLError, a timeout, a malformed endpoint
        return str(getattr(err, "reason", None) or err)
    return None


def from_hub(name: str, path: str, config: str | None, split: str, hint: str, streaming: bool = False) -> Any:
    """``datasets.load_dataset(path, config, split=split)``, or :class:`DataError` in one sentence ending in ``hint``
    (where to pass local files instead). Offline (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE) datasets reads its cache only
    (a stream has no cache: refused at once); otherwise the hub is checked once first, so that no network fails at
    once, without datasets' retries (a copy in the cache is then read with HF_DATASETS_OFFLINE=1, docs/bad-input.md).
    ``name``: the dataset as the user knows it."""
    flagged = offline()
    if flagged and streaming:
        raise DataError(f"{name} is streamed from the hub, which HF_DATASETS_OFFLINE/HF_HUB_OFFLINE forbid; {hint}")
    if not flagged and (reason := hub_unreachable()) is not None:
        raise DataError(f"{name}: the hub cannot be reached ({reason}); {hint}")
    import datasets

    try:
        return datasets.load_dataset(path, config, split=split, **({"streaming": True} if streaming else {}))
    except Exception as e:  # a missing copy or a failing hub: ConnectionError, httpx or hub errors alike
        if flagged:
            raise DataError(f"{name} is not in the datasets cache (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set); "
                            f"{hint}") from e
        raise DataError(f"{name} could not be loaded from the hub ({type(e).__name__}); {hint}") from e


class HubSource:
    """A paper benchmark from the Hugging Face hub: wikitext-103, wikitext-2, enwik8 or text8.

    Each dataset row is one line (wikitext) or one whole split (enwik8, text8). enwik8 has one 100M-byte row
    that is cut like the Transformer-XL scripts do: the last 10M bytes become 5M val + 5M test. Offline
    (``HF_DATASETS_OFFLINE=1``) it reads the copy in datasets' cache; when the hub cannot be reached, or offline
    without a cached copy, it fails at once with one sentence saying what to do.
    """

    def __init__(self, name: str) -> None:
        if name not in BENCHMARKS:
            raise DataError(f"data.source.name must be one of {sorted(BENCHMARKS)}, got {name!r}")
        self.name = name
        self.benchmark = BENCHMARKS[name]

    def identity(self) -> str:
        b = self.benchmark
        return f"hub:{b.path}:{b.config}:{sorted(b.splits.items())}:carve={b.carve}:headings={b.headings!r}"

    def setting(self, split: str) -> str:
        return f"data.source.name={self.name} ({split} split)"

    def _load(self, hub_split: str) -> datasets.Dataset:
        """The split from datasets' cache or the hub (:func:`from_hub`)."""
        b = self.benchmark
        hint = f"fetch {b.path} ({b.config or 'its text'}) elsewhere and use {LOCAL_FILES}"
        return from_hub(self.name, b.path, b.config, hub_split, hint)

    def texts(self, split: str) -> Iterator[str]:
        if self.benchmark.carve:
            yield self._carved(split)
            return
        for batch in self._load(self.benchmark.splits[split]).iter(batch_size=10_000):
            rows = batch["text"]
            yield "".join(r if r.endswith("\n") else r + "\n" for r in rows) if self.benchmark.lines else "".join(rows)

    def documents(self, split: str) -> Iterator[Piece]:
        """Each article (a title line begins one) where the benchmark has them, else the split as one document."""
        pieces = ((i == 0, text) for i, text in enumerate(self.texts(split)))
        if self.benchmark.headings is None:
            return pieces
        pattern = line_pattern(self.benchmark.headings, True, f"the {self.name} heading rule")
        return (piece for piece, _ in cut_at_lines(pieces, pattern))

    def _carved(self, split: str) -> str:
        data = "".join(self._load(self.benchmark.splits["train"])["text"]).encode("utf-8", "surrogateescape")
        n = self.benchmark.carve
        cuts = {"train": data[: -2 * n], "val": data[-2 * n : -n], "test": data[-n:]}
        return decode(cuts[split])
