"""The figures of the docs and the markers that say where each comes from.

A figure is a Markdown table or a fenced output block whose cells or lines hold measured-looking numbers
(:func:`looks_measured`). The line just above it (blank lines between allowed) is an HTML comment, which Markdown
renders as nothing, of one of three kinds::

    <!-- figure: cheap cmd="python -m xl.footprint --mem-len 512 --d-model 768 --n-layer 12 --batch 8" -->
    <!-- figure: measured cmd="python train.py" cmd="python train.py memory=none"
         date=2026-12-01 commit=36deef4 machine="2-core AMD EPYC VM (AVX2), torch 2.13.0+cpu, 1 thread" -->
    <!-- figure: tested test=tests/integration/test_experiments.py -->

- ``cheap``: deterministic on one machine and quick (arithmetic, counts, a short seeded run); the block is what the
  command prints, verbatim, and ``tests/integration/test_doc_figures.py`` reruns it (a slow test).
- ``measured``: a timing or a long run; the marker records when, at which commit and on which machine it was
  measured, one ``cmd`` per command the figure comes from.
- ``tested``: computed from the code and compared with it by the named default-suite test.

A marker may also stand before a paragraph, for figures given in prose. The attributes are read as the shell reads
words (``shlex``), so a command is quoted as on a command line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("cheap", "measured", "tested")
COMMAND_FENCES = ("bash", "sh", "shell", "console", "python")
MARKER = re.compile(r"<!--\s*figure:(.*?)-->", re.S)


@dataclass(eq=False)
class Marker:
    kind: str
    cmds: list[str]
    attrs: dict[str, str]
    page: str
    line: int  # where the marker starts (1-based)
    section: str = ""  # the visible text of its section (heading to heading), where its commands must be shown
    block: Block | None = None  # the table or fenced block just below it, if any

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(eq=False)
class Block:
    """A table (its lines) or a fenced block (its body, fences left out) of a page."""

    page: str
    start: int  # first line of the block, 1-based (a fenced block: its opening fence)
    kind: str  # "table" or "fence"
    lines: list[str]
    marker: Marker | None = None
    info: str = ""  # a fence's language tag

    @property
    def where(self) -> str:
        return f"{self.page}:{self.start}"


@dataclass
class Page:
    name: str
    blocks: list[Block] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)


def parse_marker(body: str, page: str, line: int) -> Marker:
    words = shlex.split(body)
    kind, attrs, cmds = (words[0] if words else ""), {}, []
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key == "cmd":
            cmds.append(value)
        else:
            attrs[key] = value
    return Marker(kind, cmds, attrs, page, line)


def visible(text: str) -> str:
    """Text as a reader sees it: HTML comments removed, shell line continuations joined, whitespace collapsed."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"\\\n\s*", " ", text)
    return " ".join(text.split())


def read_page(path: Path) -> Page:
    name = path.relative_to(ROOT).as_posix()
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    page = Page(name)
    ending = {}  # the line a marker's comment ends on -> the marker
    for m in MARKER.finditer(text):
        marker = parse_marker(m.group(1), name, text.count("\n", 0, m.start()) + 1)
        page.markers.append(marker)
        ending[text.count("\n", 0, m.end()) + 1] = marker
    headings, fenced = [], False
    for number, line in enumerate(lines, 1):
        fenced ^= line.strip().startswith("```")
        if not fenced and re.match(r"#+\s", line):
            headings.append(number)

    def section(number: int) -> str:
        lo = max([h for h in headings if h <= number], default=1)
        hi = min([h for h in headings if h > number], default=len(lines) + 1)
        return visible("\n".join(lines[lo - 1: hi - 1]))

    def marker_above(number: int) -> Marker | None:
        i = number - 1
        while i >= 1 and not lines[i - 1].strip():
            i -= 1
        return ending.get(i)

    for marker in page.markers:
        marker.section = section(marker.line)
    i = 0
    while i < len(lines):
        if lines[i].strip().startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            page.blocks.append(Block(name, i + 1, "fence", lines[i + 1: j], marker_above(i + 1),
                                     lines[i].strip()[3:].strip()))
            i = j + 1
        elif lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            page.blocks.append(Block(name, i + 1, "table", lines[i:j], marker_above(i + 1)))
            i = j
        else:
            i += 1
    for block in page.blocks:
        if block.marker is not None:
            block.marker.block = block
    return page


def pages() -> list[Page]:
    return [read_page(path) for path in PAGES]


# ------------------------------------------------------------------------------------------------ what looks measured

def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def figure_cell(cell: str) -> bool:
    """A table cell that is a figure: a number first (a bound, a range, a unit or a note may follow), code spans and
    bold left out; a cell that is prose with a number in it is not."""
    text = re.sub(r"`[^`]*`", "", cell).replace("*", "").strip()
    return bool(re.match(r"[≤≥<>~]?\s*\d[\d,.]*(\s*(×|%|[A-Za-zµ/]+(/[a-z]+)?))?(\s|$|:|\()", text)) and \
        len(text.split()) <= 12 and not re.match(r"\d+\.\s|\d[\d,]*\s+to\s", text)  # not "4. positions", "1 to 5"


def looks_measured(block: Block) -> bool:
    """A table with at least two figure cells in its body, or an output block (not a command block) holding a
    decimal number or a line of three or more numbers."""
    if block.kind == "table":
        body = block.lines[2:] if len(block.lines) > 1 and re.fullmatch(r"[|\s:-]+", block.lines[1]) else []
        return sum(figure_cell(c) for row in body for c in cells(row)) >= 2
    if block.info.split()[:1] and block.info.split()[0] in COMMAND_FENCES:
        return False
    return any(re.search(r"\d\.\d", line) or len(re.findall(r"(?<![\w.])\d[\d,.]*(?![\w.])", line)) >= 3
               for line in block.lines)


def generated(page: Page, block: Block) -> bool:
    """Inside a ``<!-- BEGIN GENERATED ... -->`` section (its own test compares it with its generator)."""
    text = (ROOT / page.name).read_text(encoding="utf-8").splitlines()
    above = text[: block.start - 1]
    begins = [i for i, line in enumerate(above) if "<!-- BEGIN GENERATED" in line]
    ends = [i for i, line in enumerate(above) if "<!-- END GENERATED" in line]
    return bool(begins) and (not ends or ends[-1] < begins[-1])


def figures() -> list[Block]:
    """Every block of the docs that looks measured, outside generated sections."""
    return [b for page in pages() for b in page.blocks if looks_measured(b) and not generated(page, b)]


# ------------------------------------------------------------------------------------------------ comparing output

def normalise(lines: list[str]) -> list[str]:
    return [" ".join(line.split()) for line in lines if line.strip()]


def shown_in(block: Block, output: str) -> bool:
    """The block's lines appear, in order and one after another, among the output's lines (spaces collapsed)."""
    want, got = normalise(block.lines), normalise(output.splitlines())
    return any(got[i: i + len(want)] == want for i in range(len(got) - len(want) + 1))


def markers() -> list[Marker]:
    return [m for page in pages() for m in page.markers]
