"""Background text: any data source of the project cut into sentences, read in order, over and over.

BABILong takes its background from PG-19 and cuts it into sentences (NLTK's Punkt); the facts go between them. Here
a unit is a sentence that ends inside a line (``.``, ``!`` or ``?`` and the spaces after it) or what is left of a line
(its newline included), so that prose is cut into sentences and code, which has few, into lines; concatenated, the
units give the text back. A unit longer than :data:`MAX_UNIT_TOKENS` is skipped, which bounds how far below the
requested length a sample can end (:mod:`xl.data.babilong.samples`).

:class:`PG19Source` is PG-19 itself (Rae et al., 2020), streamed from the Hugging Face hub; offline, or when the hub
cannot be reached, it fails at once in one sentence (:func:`xl.data.sources.from_hub`, as the hub benchmarks do).
The embedded corpus (``xl.data.sources.StdlibSource``) and local text files (``TextFilesSource``) need no download.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from xl.data.errors import DataError
from xl.data.sources import Source, from_hub

MAX_UNIT_TOKENS = 256
UNIT = re.compile(r"[^\n]*?[.!?]+[ \t]+|[^\n]*\n|[^\n]+")
PG19 = "deepmind/pg19"
PG19_SPLITS = {"train": "train", "val": "validation", "test": "test"}
LOCAL_HINT = "fetch deepmind/pg19 elsewhere and use data/background=text, or data/background=stdlib (no download)"


def units(text: str) -> list[str]:
    """``text`` cut into sentences and line ends (see the module docstring); ``"".join(units(t)) == t``."""
    return UNIT.findall(text)


class Sentences:
    """The units of one split of a source with their lengths in tokens, in order; at the end of the split it
    starts again from its beginning. :meth:`peek` shows the next unit without taking it."""

    def __init__(self, source: Source, split: str, count: Callable[[str], int]) -> None:
        self.source, self.split, self.count = source, split, count
        self._units = self._cycle()
        self._next: tuple[str, int] | None = None

    def _cycle(self) -> Iterator[tuple[str, int]]:
        while True:
            found = False
            for text in self.source.texts(self.split):
                for unit in units(text):
                    n = self.count(unit)
                    if 0 < n <= MAX_UNIT_TOKENS:
                        found = True
                        yield unit, n
            if not found:
                raise DataError(f"{self.source.setting(self.split)} has no sentence or line of 1 to "
                                f"{MAX_UNIT_TOKENS} tokens to use as background; give it text")

    def peek(self) -> tuple[str, int]:
        if self._next is None:
            self._next = next(self._units)
        return self._next

    def take(self) -> tuple[str, int]:
        unit = self.peek()
        self._next = None
        return unit


class PG19Source:
    """PG-19's books (BABILong's background), streamed from the hub split by split: nothing is downloaded beyond
    the books read."""

    def identity(self) -> str:
        return f"hub:{PG19}"

    def setting(self, split: str) -> str:
        return f"data/background=pg19 ({split} split of {PG19})"

    def texts(self, split: str) -> Iterator[str]:
        rows = from_hub("PG-19", PG19, None, PG19_SPLITS[split], LOCAL_HINT, streaming=True)
        try:
            for row in rows:
                yield row["text"]
        except DataError:
            raise
        except Exception as e:  # a hub that fails while streaming: connection, httpx or hub errors alike
            raise DataError(f"PG-19 could not be read from the hub ({type(e).__name__}); {LOCAL_HINT}") from e
