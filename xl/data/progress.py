"""Progress of the long data work (fitting a vocabulary, encoding the splits into the token cache), on stderr.

One tqdm bar per pass over a split, counted in bytes of text, with the total and an ETA where the source knows its
size (``nbytes(split)``: local files and the stdlib corpus). tqdm's own rule decides whether a bar is drawn: only
where stderr is a terminal (``disable=None``), so logs, pipes, batch jobs and tests get no bar. A bar appears with
the first text read (a vocabulary that has nothing to fit draws none) and is cleared when its pass ends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from tqdm import tqdm


def split_bytes(source: object, split: str) -> int | None:
    """The split's size in bytes where the source can tell it without reading it, else None (no total, no ETA)."""
    nbytes = getattr(source, "nbytes", None)
    return nbytes(split) if nbytes is not None else None


@contextmanager
def progress(what: str, total: int | None) -> Iterator[Progress]:
    """A bar for one pass (``what``: e.g. "encoding train"), closed when the pass ends."""
    bar = Progress(what, total)
    try:
        yield bar
    finally:
        bar.close()


class Progress:
    """A tqdm bar drawn from the first :meth:`update` on (see the module docstring)."""

    def __init__(self, what: str, total: int | None) -> None:
        self.what, self.total = what, total
        self.bar: tqdm | None = None

    def update(self, n_bytes: int) -> None:
        if self.bar is None:
            self.bar = tqdm(desc=self.what, total=self.total, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)
        self.bar.update(n_bytes)

    def note(self, text: str) -> None:
        """Say what the pass does once its text is read (e.g. "computing merges")."""
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def reading(self, texts: Iterable[str], after: str | None = None) -> Iterator[str]:
        """``texts`` as they are, each counted once it is handed on; ``after``: noted when the last is read."""
        for text in texts:
            yield text
            self.update(len(text.encode("utf-8", "surrogateescape")))
        if after:
            self.note(after)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
