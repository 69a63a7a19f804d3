"""What the scorer (:mod:`xl.babilong.score`) reports: ``results.json``, the table, the heatmap, W&B, a sweep's summary.

Beside the model's accuracy each of them holds the rules that need no memory of the asked entity, scored on the same
samples (:mod:`xl.babilong.baselines`). The heatmap is :mod:`xl.babilong.heatmap`'s. Under ``-m``
:class:`BabilongSummary` (a Hydra callback) gathers the jobs' ``results.json`` into ``summary.csv``, ``summary.md`` (one
row per job, one column per task and length, and the mean over tasks per length, then the rules' rows) and
``summary.png`` (the jobs' heatmaps side by side), and logs them to W&B, as a training sweep's summary is
(:mod:`xl.training.services.sweep`).
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from xl.babilong.baselines import ANSWERS, RULES
from xl.babilong.heatmap import draw_heatmaps
from xl.data.babilong.lengths import length_name
from xl.model.memory_settings import MemoryConfig, MemoryContext, describe
from xl.training.build import run_identity
from xl.training.services.callbacks import write_json
from xl.training.services.console import quiet_wandb
from xl.training.services.sweep import RESULTS_FILE, collect

log = logging.getLogger(__name__)
HEATMAP = "heatmap.png"
FACT_RULES = ("last named", "entity's labels")  # the rules the table gives beside each group of stories by facts
FACT_COUNTS = (5, 10, 15, 20)  # the upper ends of the groups of stories by number of facts that the table reports


def facts_group(facts: int) -> str:
    """The group of stories with ``facts`` facts: 1-5, 6-10, 11-15, 16-20 or 21+."""
    low = 1
    for high in FACT_COUNTS:
        if facts <= high:
            return f"{low}-{high}"
        low = high + 1
    return f"{low}+"


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
    baselines: dict[str, float] = field(default_factory=dict)  # each rule's accuracy on the cell's samples
    answers: dict[str, int] = field(default_factory=dict)  # how many answers are each of baselines.ANSWERS
    supports: dict[str, list[int]] = field(default_factory=dict)  # per tasks.support: [right answers, samples]
    facts: dict[str, list[int]] = field(default_factory=dict)  # per facts_group of the story: the same
    facts_baselines: dict[str, dict[str, float]] = field(default_factory=dict)  # per facts_group: each rule's accuracy

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Cell:
        """A cell as :meth:`to_dict` wrote it (one written before ``answers`` was recorded has none)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    def add(self, answer: str, context_tokens: int, read_tokens: int, support: str = "", facts: int = 0) -> None:
        """One sample: its answer as :func:`xl.babilong.baselines.follows` names it, what was read, what the
        answer follows from (:func:`xl.data.babilong.tasks.support`) and how many facts its story has."""
        self.answers[answer] = self.answers.get(answer, 0) + 1
        for counts_of, key in ((self.supports, support), (self.facts, facts_group(facts) if facts else "")):
            if key:
                counts = counts_of.setdefault(key, [0, 0])
                counts[0] += int(answer == "right")
                counts[1] += 1
        self.correct += int(answer == "right")
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


def record(cfg: DictConfig, run: Any, context: MemoryContext, memory: MemoryConfig, decoding: str, background: str,
           cells: list[Cell], identity: dict[str, Any] | None = None, complete: bool = True) -> dict[str, Any]:
    """One scoring as ``results.json`` holds it: the run, the context and the memory read with (the scoring's
    evaluation settings on the checkpoint's), whether every cell is scored (``complete``)
    and what the cells depend on (``identity``), then accuracy per task and length (and the mean over tasks per
    length, where every task has it), each rule's accuracy per task and length, then every cell with its
    cost."""
    tasks = [str(t) for t in cfg.tasks]
    lengths = [length_name(n) for n in cfg.lengths]
    accuracy = {t: {c.length: c.accuracy for c in cells if c.task == t} for t in tasks}
    mean = {n: sum(accuracy[t][n] for t in tasks) / len(tasks) for n in lengths
            if all(n in accuracy[t] for t in tasks)}
    baselines = {t: {rule: {c.length: c.baselines[rule] for c in cells if c.task == t and rule in c.baselines}
                     for rule in RULES} for t in tasks}
    model = run.checkpoint.model_config
    return {
        "ckpt": str(run.checkpoint.path.resolve()), "step": run.checkpoint.global_step,
        "run": str(run.folder.resolve()) if run.folder else None, "mem_len": model["mem_len"],
        "memory": describe(memory), "window": context.mem_len,
        "clamp_len": context.clamp_len, "same_length": context.same_length, "decoding": decoding,
        "background": background, "samples": cfg.samples, "seed": cfg.seed, "tasks": tasks, "lengths": lengths,
        "complete": complete, "identity": identity, "accuracy": accuracy, "mean": mean, "baselines": baselines,
        "cells": [c.to_dict() for c in cells],
    }


def table(values: dict[str, Any]) -> str:
    """Accuracy in percent: a row per task and the mean over tasks, a column per length; then, for each task, a row
    per rule that needs no memory of the asked entity, on the same samples; then what the model's wrong answers
    were (:data:`xl.babilong.baselines.ANSWERS`), in percent of the samples; then, for a task whose answers follow
    from facts of more than one kind, the accuracy on each kind (:func:`xl.data.babilong.tasks.support`); then,
    for a task whose stories fall in more than one group by number of facts (:func:`facts_group`), the accuracy on
    each group, and that of the rules of :data:`FACT_RULES` on the group's samples."""
    lengths = values["lengths"]
    rows = [(t, values["accuracy"][t]) for t in values["tasks"]] + [("mean", values["mean"])]
    rules = [(f"{t} {rule}", by_length) for t, by_rule in values.get("baselines", {}).items()
             for rule, by_length in by_rule.items() if by_length]
    answers = [(f"{t} answer: {kind}", {c["length"]: c["answers"].get(kind, 0) / c["samples"] for c in values["cells"]
                                if c["task"] == t and c.get("answers")})
               for t in values["tasks"] for kind in ANSWERS[1:]]
    answers = [(name, row) for name, row in answers if row]
    supports = [(f"{t} from {key}", row) for t, key, _, row in breakdown(values, "supports", sorted)]
    facts = []
    for t, key, cells, row in breakdown(values, "facts", lambda groups: sorted(groups, key=group_start)):
        facts.append((f"{t} with {key} facts", row))
        facts += [(f"{t} with {key} facts: {rule}", {c["length"]: c["facts_baselines"][key][rule] for c in cells
                                                     if rule in c.get("facts_baselines", {}).get(key, {})})
                  for rule in FACT_RULES]
    facts = [(name, row) for name, row in facts if row]
    width = max(len(name) for name, _ in [*rows, *rules, *answers, *supports, *facts, ("task", None)]) + 1

    def line(name: str, row: dict[str, float]) -> str:
        return "  " + f"{name:<{width}}" + "".join(f"{100 * row[n]:>7.0f}" if n in row else f"{'':>7}"
                                                  for n in lengths)

    lines = ["  " + f"{'task':<{width}}" + "".join(f"{n:>7}" for n in lengths)]
    lines += [line(name, row) for name, row in rows]
    if rules:
        lines += ["  rules without memory of the asked entity, on the same samples:"]
        lines += [line(name, row) for name, row in rules]
    if answers:
        lines += ["  the model's wrong answers, by what they name, in percent of the samples:"]
        lines += [line(name, row) for name, row in answers]
    if supports:
        lines += ["  accuracy on the samples whose answer follows from facts of these kinds, in this order:"]
        lines += [line(name, row) for name, row in supports]
    if facts:
        lines += ["  accuracy on the samples whose story has this many facts:"]
        lines += [line(name, row) for name, row in facts]
    return "\n".join(lines)


def group_start(group: str) -> int:
    """The fewest facts of a :func:`facts_group` (6 for ``6-10``)."""
    return int(group.split("-")[0].rstrip("+"))


def breakdown(values: dict[str, Any], field_name: str,
              order: Callable[[set[str]], list[str]]) -> list[tuple[str, str, list[dict[str, Any]], dict[str, float]]]:
    """Per task whose cells' ``field_name`` (``{"get, move": [right, samples]}``) has more than one key, each key in
    ``order``: the task, the key, the task's cells that have it, and the accuracy on its samples per length."""
    rows = []
    for t in values["tasks"]:
        cells = [c for c in values["cells"] if c["task"] == t and c.get(field_name)]
        keys = order({key for c in cells for key in c[field_name]})
        if len(keys) > 1:
            for key in keys:
                have = [c for c in cells if key in c[field_name]]
                rows.append((t, key, have, {c["length"]: c[field_name][key][0] / c[field_name][key][1] for c in have}))
    return rows


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
                      config=settings_of(cfg), reinit="finish_previous")


def settings_of(node: DictConfig) -> dict[str, Any]:
    """The command's settings for W&B, resolved; left out: Hydra's own node and the values only a job can resolve
    (its folder, ``hydra.job.num``), which a sweep's end cannot."""
    settings: dict[str, Any] = {}
    for key in node:
        if key == "hydra":
            continue
        try:
            value = node[key]
            if isinstance(value, DictConfig):
                value = settings_of(value)
            elif isinstance(value, ListConfig):
                value = OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException:
            continue
        settings[str(key)] = value
    return settings


def log_results(cfg: DictConfig, values: dict[str, Any], heatmap: Path) -> str | None:
    """The cells as a W&B table, with the heatmap; returns where they went, in words."""
    name, group = run_identity(cfg)
    run = wandb_run(cfg, "babilong", name, group, heatmap.parent)
    if run is None:
        return None
    import wandb

    columns = ["task", "length", "tokens", "accuracy", "correct", "samples", "mean_context_tokens", "tok_s"]
    rows = [[c[k] for k in columns] + [c["baselines"].get(rule) for rule in RULES] for c in values["cells"]]
    columns += list(RULES)
    run.log({"babilong/accuracy": wandb.Table(columns=columns, data=rows),
             "babilong/heatmap": wandb.Image(str(heatmap))})
    where = f"W&B run {run.id}: {Path(run.dir).parent}"
    run.finish()
    return where


def reference_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary's rows of the rules: one per rule where every job scored the same samples alike, else one per rule
    and job."""
    reference = []
    for rule in RULES:
        per_job = [(r["job"], {f"{t}/{n}": a for t, by_rule in r.get("baselines", {}).items()
                               for n, a in by_rule.get(rule, {}).items()}) for r in rows]
        per_job = [(job, row) for job, row in per_job if row]
        if len({tuple(sorted(row.items())) for _, row in per_job}) == 1:
            reference.append({"job": f"rule: {rule}", **per_job[0][1]})
        else:
            reference += [{"job": f"rule: {rule} ({job})", **row} for job, row in per_job]
    return reference


def job_name(row: dict[str, Any]) -> str:
    return row["job"] if row.get("complete", True) else f"{row['job']} (incomplete)"


class BabilongSummary(Callback):
    """After ``-m``: every job's accuracy, and the rules' on the same samples, as summary.csv/.md/.png in the sweep
    folder, and to W&B."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [r for r in collect(sweep_dir) if "accuracy" in r]
        if not rows:
            log.warning("babilong summary: no job under %s wrote %s", sweep_dir, RESULTS_FILE)
            return
        columns = ["job"] + list(dict.fromkeys(f"{t}/{n}" for r in rows for t in r["tasks"] for n in r["lengths"]))
        columns += list(dict.fromkeys(f"mean/{n}" for r in rows for n in r["lengths"]))
        flat = [{"job": job_name(r), **{f"{t}/{n}": a for t, row in r["accuracy"].items() for n, a in row.items()},
                 **{f"mean/{n}": a for n, a in r["mean"].items()}} for r in rows]
        flat += reference_rows(rows)
        with open(sweep_dir / "summary.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(flat)
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        lines += ["| " + " | ".join(row["job"] if c == "job" else f"{100 * row[c]:.0f}" if c in row else ""
                                    for c in columns) + " |" for row in flat]
        (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
        plot = draw_heatmaps(sweep_dir / "summary.png", [(job_name(r), r) for r in rows])
        run = wandb_run(config, "summary", "babilong summary", str(sweep_dir), sweep_dir)
        if run is not None:
            import wandb

            summary = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in flat])
            run.log({"babilong/summary": summary, "babilong/summary_plot": wandb.Image(str(plot))})
            run.finish()
        log.info("babilong summary: %s", sweep_dir / "summary.md")
