"""What a sweep measured: one ``results.json`` per job, then one table and one plot per sweep.

Only a running job knows its training throughput and wall time, and train.py keeps its metrics in
memory, so :class:`xl.training.callbacks.JobSummary` (a Lightning callback of the callbacks group) writes them into
``<run folder>/results.json``; ``python -m xl.evaluate`` writes its own there too (:mod:`xl.training.eval_results`).
When a Hydra multirun ends, :func:`write_summary` (called by
``xl.training.hydra_callbacks.SweepSummary``) gathers the jobs' files into ``summary.csv``, ``summary.md`` and
``summary.png`` in the sweep folder: the metric and the cost (cache MB, tokens/s) against ``mem_len`` (against
``eval_mem_len`` for a sweep that evaluates one model with several memory lengths).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

RESULTS_FILE = "results.json"  # what xl.training.callbacks.JobSummary writes into each job's folder


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder (one holding ``.hydra/``), named by the overrides that differ between jobs.

    Searched at any depth: an override value with a ``/`` (a path) puts the job folder deeper.
    """
    jobs = sorted(p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml"))
    overrides = [list(OmegaConf.load(job / ".hydra" / "overrides.yaml")) for job in jobs]
    common = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    rows = []
    for job, job_overrides in zip(jobs, overrides, strict=True):
        results = job / RESULTS_FILE
        row: dict[str, Any] = {"job": ",".join(o for o in job_overrides if o not in common) or job.name}
        row.update(json.loads(results.read_text()) if results.is_file() else {"status": f"no {RESULTS_FILE}"})
        rows.append(row)
    return sorted(rows, key=lambda r: (r.get("mem_len", math.inf), r.get("eval_mem_len") or 0, r["job"]))


def units(rows: list[dict[str, Any]]) -> list[str]:
    """The jobs' own figures (bpb, bpc, ppl), in order of first appearance; bpb where none says."""
    return list(dict.fromkeys(r["unit"] for r in rows if "unit" in r)) or ["bpb"]


def plotted_unit(rows: list[dict[str, Any]]) -> str:
    """The figure the plot shows: bits per byte, which every job of any tokenizer reports and which compares
    across tokenizers (ppl of a word model and of a subword model do not, nor bpc and bpb on non-ASCII text); jobs
    of one tokenizer that score the same text rank as their own figure ranks them. Their own unit only where no job
    reports bpb."""
    if any(f"{split}/bpb" in r for r in rows for split in ("val", "test")):
        return "bpb"
    return units(rows)[0]


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """The table's columns: context, metrics (each job's own unit, bits per byte and the share of bytes spelled for
    <unk>), cost; unknown keys are left out."""
    metrics = [f"{split}/{m}" for split in ("val", "test") for m in ("loss", *units(rows), "bpb", "unk_share")]
    wanted = ["job", "mem_len", "eval_mem_len", "memory", "grad_segments",
              "doc_boundaries", *metrics, "train_tok_s", "val/tok_s", "test/tok_s", "cache_mb", "params", "wall_s",
              "status"]
    return list(dict.fromkeys(c for c in wanted if any(c in r for r in rows)))  # bpb once for byte data


def format_value(column: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if column in ("train_tok_s", "val/tok_s", "test/tok_s"):
            return f"{value:,.0f}"
        if column == "cache_mb":
            return f"{value:.2f}"
        if column == "wall_s":
            return f"{value:.1f}"
        return f"{value:.4f}"
    if isinstance(value, int) and column == "params":
        return f"{value:,}"
    return str(value)


def write_table(rows: list[dict[str, Any]], cols: list[str], sweep_dir: Path) -> None:
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(format_value(c, r.get(c)) for c in cols) + " |" for r in rows]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")


def x_axis(rows: list[dict[str, Any]]) -> str:
    """mem_len, or eval_mem_len for a sweep of evaluations of one model (the trained mem_len is the same)."""
    varies = {key: len({r.get(key) for r in rows}) > 1 for key in ("mem_len", "eval_mem_len")}
    return "eval_mem_len" if varies["eval_mem_len"] and not varies["mem_len"] else "mem_len"


def write_plot(rows: list[dict[str, Any]], sweep_dir: Path) -> Path:
    """Left: val/test bits per byte (:func:`plotted_unit`) against the memory length (mem_len, or eval_mem_len for
    an evaluation sweep); right: cache MB and tokens/s (training's, else evaluation's) against it."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "mem_len" in r]
    unit = plotted_unit(measured)
    key = x_axis(measured)
    x = [r[key] for r in measured]
    style = "o-" if len(set(x)) == len(x) else "o"  # several jobs per mem_len (e.g. Optuna): points only
    fig, (quality, cost) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for split in ("val", "test"):
        points = [(r[key], r[f"{split}/{unit}"]) for r in measured if r.get(f"{split}/{unit}") is not None]
        if points:
            quality.plot(*zip(*points, strict=True), style, label=split)
    quality.set(xlabel=key, ylabel=unit, title=f"{unit} against memory length")
    quality.legend()
    cost.plot(x, [r["cache_mb"] for r in measured], style, color="tab:red")
    cost.set(xlabel=key, title="cost against memory length")
    evaluation = key == "eval_mem_len"
    cost.set_ylabel(f"{'evaluation' if evaluation else 'training'} cache (MB)", color="tab:red")
    cost.set_ylim(bottom=0)
    speed_key = next((k for k in ("train_tok_s", "test/tok_s", "val/tok_s") if any(r.get(k) for r in measured)), None)
    if speed_key:
        rate = cost.twinx()
        rate.plot(*zip(*[(r[key], r[speed_key]) for r in measured if r.get(speed_key)], strict=True), style,
                  color="tab:blue")
        rate.set_ylabel(f"{'training' if speed_key == 'train_tok_s' else 'evaluation'} tokens/s", color="tab:blue")
        rate.set_ylim(bottom=0)
    path = sweep_dir / "summary.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def log_to_wandb(rows: list[dict[str, Any]], cols: list[str], plot: Path, sweep_dir: Path,
                 wandb_cfg: dict[str, Any]) -> None:
    """The same table and plot as a W&B run of job type ``summary`` in the sweep's group (the jobs' settings)."""
    import wandb

    run = wandb.init(project=wandb_cfg.get("project"), group=str(sweep_dir), job_type="summary", name="summary",
                     dir=str(sweep_dir), mode="offline" if wandb_cfg.get("offline", True) else "online",
                     tags=list(wandb_cfg.get("tags") or []), reinit="finish_previous")
    table = wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])
    run.log({"summary": table, "summary_plot": wandb.Image(str(plot))})
    run.finish()


def write_summary(sweep_dir: str | Path, wandb_cfg: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Write the summary files into ``sweep_dir`` (and log them to W&B with ``wandb_cfg``); return the rows."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    if not rows:
        return rows
    cols = columns(rows)
    write_table(rows, cols, sweep_dir)
    plot = write_plot(rows, sweep_dir)
    if wandb_cfg is not None:
        log_to_wandb(rows, cols, plot, sweep_dir, wandb_cfg)
    return rows
