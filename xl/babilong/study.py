"""A study's table: several scorings of the BABILong scorer (:mod:`xl.babilong.score`) grouped by memory, each group
the seeds of one memory, read against the rules that need no memory of the asked entity.

    python -m xl.babilong.study none=runs/none-1-score,runs/none-2-score cache=runs/cache-1-score --out runs/table

prints a Markdown table (a row per memory and task: the seeds' mean accuracy in percent, each seed's, and how many
seeds beat the best rule by more than :data:`MARGIN` points; then the rules' rows) and writes ``study.md``,
``study.json`` and ``heatmap.png`` (a panel per memory, the mean over its seeds) in ``--out``. Every scoring must
have read the same samples (the tasks, lengths, samples per cell and seed, and the rules' accuracies that follow
from them), or the command says which differs and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from xl.babilong.baselines import RULES
from xl.training.services.console import plain_text

MARGIN = 10  # points above the best rule: two standard errors of a cell of 100 answers near 50%
SAME = ("tasks", "lengths", "samples", "seed", "baselines")  # what makes two scorings' samples the same


class StudyError(ValueError):
    """A study that cannot be tabled: one sentence naming the argument to change."""


def read_scoring(path: str | Path) -> dict[str, Any]:
    """A scoring folder's (or its file's) ``results.json``, refused unless it is complete."""
    file = Path(path) / "results.json" if Path(path).is_dir() else Path(path)
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise StudyError(f"{path} holds no results.json of the BABILong scorer ({err.__class__.__name__}); "
                         "name a scoring's folder") from None
    if not values.get("complete", False):
        raise StudyError(f"{path} is an incomplete scoring; finish it (run its command again) or leave it out")
    return values


def parse_groups(args: list[str]) -> dict[str, list[str]]:
    """``NAME=DIR[,DIR...]`` arguments, in order, as {name: folders}."""
    groups: dict[str, list[str]] = {}
    for arg in args:
        name, _, folders = arg.partition("=")
        if not name or not folders or name in groups:
            raise StudyError(f"{arg!r}: give each memory once as NAME=SCORING[,SCORING...]")
        groups[name] = [f for f in folders.split(",") if f]
    return groups


def study(groups: dict[str, list[str]]) -> dict[str, Any]:
    """The table's values: per memory and task, each seed's accuracy per length, the mean, and the seeds above the
    best rule; the rules (the same for every scoring) once."""
    scorings = {name: [read_scoring(f) for f in folders] for name, folders in groups.items()}
    first_name, (first, *_) = next(iter(scorings.items()))
    for name, values in scorings.items():
        for folder, v in zip(groups[name], values, strict=True):
            differs = [key for key in SAME if v.get(key) != first.get(key)]
            if differs:
                raise StudyError(f"{folder} read other samples than {groups[first_name][0]} ({differs[0]} differs); "
                                 "score every run with the same tasks, lengths, samples and seed")
    tasks, lengths = first["tasks"], first["lengths"]
    rows = []
    for name, values in scorings.items():
        for task in tasks:
            seeds = [[100 * v["accuracy"][task][n] for n in lengths] for v in values]
            best = [max(100 * first["baselines"][task][r][n] for r in RULES) for n in lengths]
            rows.append({"memory": name, "task": task, "scorings": groups[name],
                         "seeds": seeds, "mean": [sum(c) / len(c) for c in zip(*seeds, strict=True)],
                         "above": [sum(s[i] > best[i] + MARGIN for s in seeds) for i in range(len(lengths))]})
    return {"tasks": tasks, "lengths": lengths, "samples": first["samples"], "margin": MARGIN, "rows": rows,
            "baselines": first["baselines"]}


def markdown(values: dict[str, Any]) -> str:
    """The study as one Markdown table: memories, then the rules."""
    lengths = values["lengths"]
    lines = [f"| memory | task | seeds | {' | '.join(lengths)} |", "|---|---|---:|" + "---:|" * len(lengths)]
    for row in values["rows"]:
        n = len(row["seeds"])
        cells = [f"{m:.0f} ({' '.join(f'{s[i]:.0f}' for s in row['seeds'])}) {row['above'][i]}/{n}"
                 for i, m in enumerate(row["mean"])]
        lines.append(f"| {row['memory']} | {row['task']} | {n} | {' | '.join(cells)} |")
    for task, rules in values["baselines"].items():
        for rule in RULES:
            if rule in rules:
                lines.append(f"| rule: {rule} | {task} | | "
                             + " | ".join(f"{100 * rules[rule][n]:.0f}" for n in lengths) + " |")
    return "\n".join(lines)


def panels(values: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A heatmap panel per memory: the mean over its seeds, the rules beneath each cell."""
    by_memory: dict[str, tuple[int, dict[str, Any]]] = {}
    for row in values["rows"]:
        _, panel = by_memory.setdefault(row["memory"], (len(row["seeds"]), {
            "tasks": [], "lengths": values["lengths"], "accuracy": {}, "baselines": values["baselines"],
            "cells": [{"samples": values["samples"]}]}))
        panel["tasks"].append(row["task"])
        panel["accuracy"][row["task"]] = {n: m / 100 for n, m in zip(values["lengths"], row["mean"], strict=True)}
    return [(f"{name}: mean of {seeds} seed{'s' if seeds > 1 else ''}", panel)
            for name, (seeds, panel) in by_memory.items()]


def write(out: Path, values: dict[str, Any]) -> None:
    """``study.json``, ``study.md`` and ``heatmap.png`` in ``out``, each written whole (a temporary file renamed)."""
    from xl.babilong.heatmap import draw_heatmaps
    from xl.training.services.callbacks import write_json

    write_json(out / "study.json", values)
    tmp = out / ".study.md.tmp"
    tmp.write_text(markdown(values) + "\n", encoding="utf-8")
    tmp.replace(out / "study.md")
    tmp = out / ".heatmap.tmp.png"
    draw_heatmaps(tmp, panels(values))
    tmp.replace(out / "heatmap.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m xl.babilong.study", description=plain_text(__doc__))
    parser.add_argument("groups", nargs="+", metavar="NAME=SCORING[,SCORING...]",
                        help="a memory's name and its scorings' folders (one per seed)")
    parser.add_argument("--out", type=Path, help="write study.md, study.json and heatmap.png here")
    args = parser.parse_args(argv)
    try:
        values = study(parse_groups(args.groups))
    except StudyError as err:
        sys.exit(f"error: {err}")
    print(f"accuracy (%) over {values['samples']} samples per cell: the seeds' mean (each seed) and the seeds more "
          f"than {MARGIN} points above the best rule\n{markdown(values)}")
    if args.out:
        write(args.out, values)
        print(f"wrote {args.out / 'study.md'}, study.json and heatmap.png")


if __name__ == "__main__":
    main()
