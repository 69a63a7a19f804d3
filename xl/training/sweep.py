"""What a sweep measured: one ``results.json`` per job, then one table and one plot per sweep.

Only a running job knows its training throughput and wall time, and train.py keeps its metrics in
memory, so :class:`xl.training.callbacks.JobSummary` (a Lightning callback of the callbacks group) writes them into
``<run folder>/results.json``; ``python -m xl.evaluate`` writes its own there too (:mod:`xl.training.eval_results`).
When a Hydra multirun ends, :func:`write_summary` (called by
``xl.training.hydra_callbacks.SweepSummary``) gathers the jobs' files into ``summary.csv``, ``summary.md`` and
``summary.png`` in the sweep folder: the metric and the cost (cache MB, tokens/s) against the setting that the sweep
varies (:func:`series`).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

RESULTS_FILE = "results.json"  # what xl.training.callbacks.JobSummary writes into each job's folder


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder (one holding ``.hydra/``), named by the overrides that differ between jobs, which
    ``varied`` holds as ``{key: value}`` (the plot's axes; the table leaves it out).

    Searched at any depth: an override value with a ``/`` (a path) puts the job folder deeper.
    """
    jobs = sorted(p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml"))
    overrides = [list(OmegaConf.load(job / ".hydra" / "overrides.yaml")) for job in jobs]
    common = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    parser = OverridesParser.create()
    rows = []
    for job, job_overrides in zip(jobs, overrides, strict=True):
        results = job / RESULTS_FILE
        differing = [o for o in job_overrides if o not in common]
        row: dict[str, Any] = {"job": ",".join(differing) or job.name,
                               "varied": {o.key_or_group: o.value() for o in parser.parse_overrides(differing)}}
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


def series(rows: list[dict[str, Any]]) -> tuple[str, dict[str, list[tuple[Any, dict[str, Any]]]]]:
    """What the plot draws: (the x-axis, ``{label: [(x, row), ...]}``, one series per line).

    The x-axis is the first setting whose value differs between jobs (the rows' ``varied``, in command-line order),
    and there is one series per combination of the other settings that vary, labelled by them, its points in order
    of x. Where nothing varies (one job), the memory length (:func:`x_axis`)."""
    keys = list(dict.fromkeys(k for r in rows for k in r.get("varied", {})))
    if not keys:
        key = x_axis(rows)
        return key, {"": [(r[key], r) for r in rows]}
    key, others = keys[0], keys[1:]
    lines: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    for r in rows:
        varied = r.get("varied", {})
        label = ", ".join(f"{k}={varied.get(k)}" for k in others)
        lines.setdefault(label, []).append((varied.get(key), r))
    numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for line in lines.values() for x, _ in line)
    for line in lines.values():
        line.sort(key=lambda point: point[0] if numeric else str(point[0]))
    return key, lines


def write_plot(rows: list[dict[str, Any]], sweep_dir: Path) -> Path:
    """Left: val/test bits per byte (:func:`plotted_unit`) against what the sweep varies (:func:`series`); right:
    cache MB and tokens/s (training's, else evaluation's) against it. One line per combination of the other
    settings that vary; points only where every job has its own combination (a search, such as Optuna's)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "mem_len" in r]
    unit = plotted_unit(measured)
    key, lines = series(measured)
    search = len(lines) > 1 and all(len(line) == 1 for line in lines.values())
    if search:  # each point its own combination: one series of points, each named by the other settings
        lines = {"": [point for line in lines.values() for point in line]}
    speed_key = next((k for k in ("train_tok_s", "test/tok_s", "val/tok_s") if any(r.get(k) for r in measured)), None)
    fig, (quality, cost) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    rate = cost.twinx() if speed_key else None
    markers = "os^Dvx*"
    for i, (label, points) in enumerate(lines.items()):
        xs = [str(x) if not isinstance(x, int | float) else x for x, _ in points]
        style = markers[i % len(markers)] + ("" if search or len(set(xs)) < len(xs) else "-")
        suffix = f" ({label})" if label else ""
        for split in ("val", "test"):
            drawn = [(x, r[f"{split}/{unit}"]) for x, (_, r) in zip(xs, points, strict=True)
                     if r.get(f"{split}/{unit}") is not None]
            if drawn:
                quality.plot(*zip(*drawn, strict=True), style, label=split + suffix)
        cost.plot(xs, [r["cache_mb"] for _, r in points], style, color="tab:red")
        if rate is not None:
            drawn = [(x, r[speed_key]) for x, (_, r) in zip(xs, points, strict=True) if r.get(speed_key)]
            if drawn:
                rate.plot(*zip(*drawn, strict=True), style, color="tab:blue")
    if search:
        for x, r in lines[""]:
            if r.get(f"val/{unit}") is not None:
                quality.annotate(", ".join(f"{k}={v}" for k, v in r["varied"].items() if k != key),
                                 (x, r[f"val/{unit}"]), fontsize=6)
    quality.set(xlabel=key, ylabel=unit, title=f"{unit} against {key}")
    quality.legend(fontsize=7)
    cost.set(xlabel=key, title=f"cost against {key}")
    evaluation = all("run_data" in r for r in measured)  # jobs of python -m xl.evaluate: evaluation's cache
    cost.set_ylabel(f"{'evaluation' if evaluation else 'training'} cache (MB)", color="tab:red")
    cost.set_ylim(bottom=0)
    if rate is not None:
        rate.set_ylabel(f"{'evaluation' if evaluation else 'training'} tokens/s", color="tab:blue")
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
