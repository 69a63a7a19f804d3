"""What a sweep measured: one ``results.json`` per job, then one table and one plot per sweep.

Only a running job knows its training throughput and wall time, and train.py keeps its metrics in memory, so
:class:`xl.training.services.callbacks.JobSummary` (a Lightning callback of the callbacks group) writes them into
``<run folder>/results.json``; ``python -m xl.evaluate`` writes its own there too (:mod:`xl.training.eval_results`).
When a Hydra multirun ends, :func:`write_summary` (called by ``xl.training.hydra_callbacks.SweepSummary``) gathers
the jobs' files into ``summary.csv``, ``summary.md`` and ``summary.png`` in the sweep folder: the metric and the cost
(cache MB, tokens/s) against the setting that the sweep varies (:func:`series`).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

RESULTS_FILE = "results.json"  # what xl.training.services.callbacks.JobSummary writes into each job's folder
MIN_SPAN = 0.02  # the quality axis spans at least this share of the plotted values' mean


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
        label = ", ".join(f"{k}={short(varied.get(k))}" for k in others)
        lines.setdefault(label, []).append((varied.get(key), r))
    numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for line in lines.values() for x, _ in line)
    for line in lines.values():
        line.sort(key=lambda point: point[0] if numeric else str(point[0]))
    return key, lines


def short(value: Any) -> str:
    """A setting's value as a label: a float to three significant digits (a search's learning rate of
    0.000312878... reads 0.000313)."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def spread_title(unit: str, key: str, splits: dict[str, list[float]]) -> str:
    """The quality panel's title: what it plots and, per split, how far apart the jobs' values are, so that a
    reader judges whether a slope is more than noise."""
    spreads = [f"{split} {max(v) - min(v):.2g}" for split, v in splits.items() if len(v) > 1]
    values = [y for v in splits.values() for y in v]
    mean = sum(values) / len(values) if values else 0
    if not spreads or not mean:
        return f"{unit} against {key}"
    share = 100 * max(max(v) - min(v) for v in splits.values() if len(v) > 1) / abs(mean)
    return f"{unit} against {key}\nspread over jobs: {', '.join(spreads)} {unit} (at most {share:.2g}%)"


def annotate_points(ax: Any, key: str, unit: str, points: list[tuple[Any, dict[str, Any]]]) -> None:
    """Name each point of a search by its other settings, rounded; labels point towards the panel's middle, and a
    label that would sit on another one moves below it."""
    drawn = [(x if isinstance(x, int | float) else str(x), r) for x, r in points if r.get(f"val/{unit}") is not None]
    if not drawn:
        return
    numeric = all(isinstance(x, int | float) for x, _ in drawn)
    order = sorted({str(x) for x, _ in drawn})
    positions = [x if numeric else order.index(str(x)) for x, _ in drawn]
    ys = [r[f"val/{unit}"] for _, r in drawn]
    width, height = (max(positions) - min(positions)) or 1, (max(ys) - min(ys)) or 1
    middle = (min(positions) + max(positions)) / 2
    placed: list[tuple[float, float]] = []
    for (x, r), at, y in sorted(zip(drawn, positions, ys, strict=True), key=lambda p: (p[1], -p[2])):
        near = sum(abs(at - a) < 0.1 * width and abs(y - b) < 0.06 * height for a, b in placed)
        placed.append((at, y))
        right = at > middle
        ax.annotate(", ".join(f"{k}={short(v)}" for k, v in r["varied"].items() if k != key), (x, y),
                    xytext=(-4 if right else 4, 3 - 9 * near), textcoords="offset points",
                    ha="right" if right else "left", fontsize=7)


def quality_limits(values: list[float]) -> tuple[float, float] | None:
    """Y-limits that span at least :data:`MIN_SPAN` of the values' mean, centred on them (None where they span more
    already): values within 0.1% of one another must not fill the panel as if they differed."""
    if not values:
        return None
    low, high = min(values), max(values)
    span = MIN_SPAN * abs(sum(values) / len(values))
    if high - low >= span:
        return None
    middle = (low + high) / 2
    return middle - span / 2, middle + span / 2


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
    plotted: dict[str, list[float]] = {}
    for i, (label, points) in enumerate(lines.items()):
        xs = [str(x) if not isinstance(x, int | float) else x for x, _ in points]
        style = markers[i % len(markers)] + ("" if search or len(set(xs)) < len(xs) else "-")
        suffix = f" ({label})" if label else ""
        for split in ("val", "test"):
            drawn = [(x, r[f"{split}/{unit}"]) for x, (_, r) in zip(xs, points, strict=True)
                     if r.get(f"{split}/{unit}") is not None]
            if drawn:
                quality.plot(*zip(*drawn, strict=True), style, label=split + suffix)
                plotted.setdefault(split, []).extend(y for _, y in drawn)
        cost.plot(xs, [r["cache_mb"] for _, r in points], style, color="tab:red")
        if rate is not None:
            drawn = [(x, r[speed_key]) for x, (_, r) in zip(xs, points, strict=True) if r.get(speed_key)]
            if drawn:
                rate.plot(*zip(*drawn, strict=True), style, color="tab:blue")
    if search:
        annotate_points(quality, key, unit, lines[""])
    quality.set(xlabel=key, ylabel=unit)
    quality.set_title(spread_title(unit, key, plotted), fontsize=10)
    quality.margins(y=0.1)  # room for the points' labels
    limits = quality_limits([y for v in plotted.values() for y in v])
    if limits is not None:
        quality.set_ylim(*limits)
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
