"""What the scorer (:mod:`xl.babilong.score`) reports: ``results.json``, the table, the heatmap, W&B, a sweep's summary.

The heatmap is BABILong's leaderboard figure (its ``notebooks/draw_evals.ipynb``): tasks down, context lengths across,
the accuracy in percent in each cell, coloured from red (0) through yellow to green (100). Under ``-m``
:class:`BabilongSummary` (a Hydra callback) gathers the jobs' ``results.json`` into ``summary.csv``, ``summary.md``
(one row per job, one column per task and length, and the mean over tasks per length) and ``summary.png`` (the jobs'
heatmaps side by side), and logs them to W&B, as a training sweep's summary is (:mod:`xl.training.sweep`).
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from xl.memory import settings
from xl.memory.settings import describe
from xl.training.build import run_identity
from xl.training.callbacks import write_json
from xl.training.console import quiet_wandb
from xl.training.sweep import RESULTS_FILE, collect

log = logging.getLogger(__name__)
HEATMAP = "heatmap.png"


@dataclass
class Cell:
    """One task at one length: how many answers were right, and what reading them cost."""

    task: str
    length: str  # as written (1k)
    tokens: int  # the length asked for
    correct: int = 0
    samples: int = 0
    context_tokens: int = 0  # the samples' contexts, summed
    read_tokens: int = 0  # the prompts read (context and question), summed
    seconds: float = 0.0

    def add(self, correct: bool, context_tokens: int, read_tokens: int) -> None:
        self.correct += int(correct)
        self.samples += 1
        self.context_tokens += context_tokens
        self.read_tokens += read_tokens

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "accuracy": self.accuracy,
                "mean_context_tokens": self.context_tokens / self.samples if self.samples else None,
                "tok_s": self.read_tokens / self.seconds if self.seconds else None}


def record(cfg: DictConfig, run: Any, context: dict[str, Any], decoding: str, background: str,
           cells: list[Cell]) -> dict[str, Any]:
    """One scoring as ``results.json`` holds it: the run, the context, then accuracy per task and length (and the
    mean over tasks per length), then every cell with its cost."""
    tasks = list(dict.fromkeys(c.task for c in cells))
    lengths = list(dict.fromkeys(c.length for c in cells))
    accuracy = {t: {c.length: c.accuracy for c in cells if c.task == t} for t in tasks}
    mean = {n: sum(accuracy[t][n] for t in tasks) / len(tasks) for n in lengths}
    model = run.checkpoint.model_config
    return {
        "ckpt": str(run.checkpoint.path.resolve()), "step": run.checkpoint.global_step,
        "run": str(run.folder.resolve()) if run.folder else None, "mem_len": model["mem_len"],
        "memory": describe(settings.from_dict(model.get("memory"))), "window": context["window"],
        "clamp_len": context["clamp_len"], "same_length": context["same_length"], "decoding": decoding,
        "background": background, "samples": cfg.samples, "seed": cfg.seed, "tasks": tasks, "lengths": lengths,
        "accuracy": accuracy, "mean": mean, "cells": [c.to_dict() for c in cells],
    }


def table(values: dict[str, Any]) -> str:
    """Accuracy in percent: a row per task and the mean over tasks, a column per length."""
    lengths = values["lengths"]
    rows = [(t, values["accuracy"][t]) for t in values["tasks"]] + [("mean", values["mean"])]
    lines = ["  " + f"{'task':<6}" + "".join(f"{n:>7}" for n in lengths)]
    lines += ["  " + f"{name:<6}" + "".join(f"{100 * row[n]:>7.0f}" for n in lengths) for name, row in rows]
    return "\n".join(lines)


def grid(values: dict[str, Any]) -> list[list[float]]:
    return [[100 * values["accuracy"][t][n] for n in values["lengths"]] for t in values["tasks"]]


def draw_heatmaps(path: Path, panels: list[tuple[str, dict[str, Any]]]) -> Path:
    """One heatmap per (title, results) side by side, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    colours = LinearSegmentedColormap.from_list("ryg", ["red", "yellow", "green"], N=256)
    width = max(len(v["lengths"]) for _, v in panels)
    height = max(len(v["tasks"]) for _, v in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=((1.0 * width + 1.6) * len(panels), 0.55 * height + 1.8),
                             squeeze=False, constrained_layout=True)
    for ax, (title, values) in zip(axes[0], panels, strict=True):
        cells = grid(values)
        ax.imshow(cells, cmap=colours, vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(cells):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=11)
        ax.set_xticks(range(len(values["lengths"])), values["lengths"])
        ax.set_yticks(range(len(values["tasks"])), values["tasks"])
        ax.set(xlabel="context length (tokens)", ylabel="task", title=title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_results(output_dir: str | Path, values: dict[str, Any]) -> Path:
    """``results.json`` and ``heatmap.png`` in ``output_dir``; returns the first."""
    path = Path(output_dir) / RESULTS_FILE
    write_json(path, values)
    draw_heatmaps(path.parent / HEATMAP, [(Path(values["run"] or values["ckpt"]).name, values)])
    return path


def wandb_run(cfg: DictConfig, job_type: str, name: str | None, group: str | None, folder: Path) -> Any:
    """A W&B run (offline unless logger.wandb.offline=false) for the scorer's tables, or None without a W&B logger."""
    node = OmegaConf.select(cfg, "logger.wandb")
    if node is None:
        return None
    import wandb

    quiet_wandb(node.offline)
    return wandb.init(project=node.project, name=name, group=group, job_type=job_type, dir=str(folder),
                      mode="offline" if node.offline else "online", tags=list(node.tags or []),
                      config=OmegaConf.to_container(cfg, resolve=True), reinit="finish_previous")


def log_results(cfg: DictConfig, values: dict[str, Any], heatmap: Path) -> str | None:
    """The cells as a W&B table, with the heatmap; returns where they went, in words."""
    name, group = run_identity(cfg)
    run = wandb_run(cfg, "babilong", name, group, heatmap.parent)
    if run is None:
        return None
    import wandb

    columns = ["task", "length", "tokens", "accuracy", "correct", "samples", "mean_context_tokens", "tok_s"]
    rows = [[c[k] for k in columns] for c in values["cells"]]
    run.log({"babilong/accuracy": wandb.Table(columns=columns, data=rows),
             "babilong/heatmap": wandb.Image(str(heatmap))})
    where = f"W&B run {run.id}: {Path(run.dir).parent}"
    run.finish()
    return where


class BabilongSummary(Callback):
    """After ``-m``: every job's accuracy as summary.csv/.md/.png in the sweep folder, and to W&B."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [r for r in collect(sweep_dir) if "accuracy" in r]
        if not rows:
            log.warning("babilong summary: no job under %s wrote %s", sweep_dir, RESULTS_FILE)
            return
        columns = ["job"] + list(dict.fromkeys(f"{t}/{n}" for r in rows for t in r["tasks"] for n in r["lengths"]))
        columns += list(dict.fromkeys(f"mean/{n}" for r in rows for n in r["lengths"]))
        flat = [{"job": r["job"], **{f"{t}/{n}": a for t, row in r["accuracy"].items() for n, a in row.items()},
                 **{f"mean/{n}": a for n, a in r["mean"].items()}} for r in rows]
        with open(sweep_dir / "summary.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(flat)
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        lines += ["| " + " | ".join(row["job"] if c == "job" else f"{100 * row[c]:.0f}" if c in row else ""
                                    for c in columns) + " |" for row in flat]
        (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
        plot = draw_heatmaps(sweep_dir / "summary.png", [(r["job"], r) for r in rows])
        run = wandb_run(config, "summary", "babilong summary", str(sweep_dir), sweep_dir)
        if run is not None:
            import wandb

            summary = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in flat])
            run.log({"babilong/summary": summary, "babilong/summary_plot": wandb.Image(str(plot))})
            run.finish()
        log.info("babilong summary: %s", sweep_dir / "summary.md")
