"""Every figure of the docs says where it comes from, and the quick ones are what their commands print now.

What counts as a figure, the three kinds of marker and how a block is compared with a command's output:
:mod:`tests.helpers.figures`. The default suite checks that every figure is marked, that each marker is complete
and that its commands are shown to the reader in the same section; ``python -m pytest -m slow
tests/integration/test_doc_figures.py`` reruns every ``cheap`` figure's command and compares.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import date

import pytest

from tests.helpers.figures import KINDS, figures, markers, shown_in
from tests.helpers.paths import ROOT

ATTRIBUTES = {"cheap": set(), "measured": {"date", "commit", "machine"}, "tested": {"test"}}
MARKERS = markers()
CHEAP = [m for m in MARKERS if m.kind == "cheap"]


def test_every_figure_of_the_docs_has_a_marker():
    unmarked = [b.where for b in figures() if b.marker is None]
    assert not unmarked, ("these tables or output blocks look measured but say nowhere where they come from: "
                          + ", ".join(unmarked) + "; put a <!-- figure: ... --> line above each (tests/helpers/"
                          "figures.py)")


def check(marker) -> list[str]:
    problems = []
    if marker.kind not in KINDS:
        return [f"kind {marker.kind!r} is not one of {', '.join(KINDS)}"]
    missing, unknown = ATTRIBUTES[marker.kind] - set(marker.attrs), set(marker.attrs) - ATTRIBUTES[marker.kind]
    problems += [f"no {key}=" for key in sorted(missing)] + [f"{key}= is not an attribute of a {marker.kind} figure"
                                                              for key in sorted(unknown)]
    if marker.kind in ("cheap", "measured") and not marker.cmds:
        problems.append("no cmd=")
    if marker.kind == "cheap" and (len(marker.cmds) != 1 or marker.block is None):
        problems.append("a cheap figure is one command's output: one cmd= and the block it prints just below")
    for cmd in marker.cmds:
        if " ".join(cmd.split()) not in marker.section:
            problems.append(f"cmd {cmd!r} is not shown to the reader in the marker's section")
    if "date" in marker.attrs:
        try:
            date.fromisoformat(marker.attrs["date"])
        except ValueError:
            problems.append(f"date={marker.attrs['date']} is not YYYY-MM-DD")
    if "commit" in marker.attrs and not re.fullmatch(r"[0-9a-f]{7,40}(,[0-9a-f]{7,40})*", marker.attrs["commit"]):
        problems.append(f"commit={marker.attrs['commit']} is not one or more abbreviated hashes, comma-separated")
    if "machine" in marker.attrs and not marker.attrs["machine"].strip():
        problems.append("machine= is empty")
    if "test" in marker.attrs:
        test = ROOT / marker.attrs["test"]
        if not test.is_file() or marker.page not in test.read_text(encoding="utf-8"):
            problems.append(f"test={marker.attrs['test']} is not a test file that reads {marker.page}")
    return problems


def test_every_marker_says_where_its_figure_comes_from():
    problems = [f"{m.where}: {p}" for m in MARKERS for p in check(m)]
    assert not problems, "\n".join(problems)


def history_is_here() -> bool:
    git = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    return git.returncode == 0 and git.stdout.strip() == "false"


@pytest.mark.skipif(not history_is_here(), reason="needs the project's full git history")
def test_every_measured_figure_names_a_commit_of_the_project():
    unknown = [f"{m.where}: {commit}" for m in MARKERS if m.kind == "measured"
               for commit in m.attrs.get("commit", "").split(",")
               if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT,
                                 capture_output=True).returncode != 0]
    assert not unknown, "no such commit: " + ", ".join(unknown)


@pytest.mark.slow
@pytest.mark.parametrize("marker", CHEAP, ids=[m.where for m in CHEAP])
def test_a_cheap_figure_is_what_its_command_prints(marker, tmp_path):
    """The command as printed, in a fresh process in an empty folder, on one thread: arithmetic and parameter counts
    print the same on every machine, and a seeded run on one thread sums in one order, so it prints the same digits
    on machines of the class it was measured on (the same CPU and torch build)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "XL_CACHE_DIR": str(tmp_path / "cache"), "WANDB_MODE": "offline", "HF_DATASETS_OFFLINE": "1"}
    command = re.sub(r"^python\b", sys.executable, marker.cmds[0])
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{marker.cmds[0]} failed:\n{result.stderr[-2000:]}"
    assert shown_in(marker.block, result.stdout), (
        f"{marker.block.where} is not what {marker.cmds[0]!r} prints now; it prints:\n{result.stdout}")
