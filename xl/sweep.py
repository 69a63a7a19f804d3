"""What a sweep measured: one ``results.json`` per job, then one table and one plot per sweep.

Only a running job knows its training throughput and wall time, and train.py keeps its metrics in
memory, so :class:`JobSummary` (a Lightning callback of the callbacks group) writes them into
``<run folder>/results.json``. When a Hydra multirun ends, :func:`write_summary` (called by
``xl.hydra_callbacks.SweepSummary``) gathers the jobs' files into ``summary.csv``, ``summary.md`` and
``summary.png`` in the sweep folder: the metric and the cost (cache MB, tokens/s) against ``mem_len``.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import OmegaConf

from xl.footprint import cache_footprint
from xl.lit import batch_tokens

RESULTS_FILE = "results.json"


class JobSummary(L.Callback):
    """Write the job's numbers to ``path`` after fitting, and again after testing.

    Training throughput counts only the time inside training steps (forward, backward, optimizer),
    not validation, data loading or checkpointing; wall time runs from the trainer's creation.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.created = time.perf_counter()
        self.train_seconds = 0.0
        self.train_tokens = 0
        self.metrics: dict[str, float] = {}
        self._batch_start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.strategy.root_device.type == "cuda":  # kernels run asynchronously: wait before reading the clock
            torch.cuda.synchronize()
        self.train_seconds += time.perf_counter() - self._batch_start
        self.train_tokens += batch_tokens(batch) * trainer.world_size  # every rank reads a batch of the same shape

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, pl_module, "val/")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, pl_module, "test/")

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, prefix: str) -> None:
        self.metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)})
        if trainer.is_global_zero:
            write_json(self.path, {**self.describe(trainer, pl_module), **self.metrics})

    def describe(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The run's context and cost; ``cache_mb`` is one rank's training memory (as ``python -m xl.footprint``)."""
        cfg = pl_module.config
        datamodule = trainer.datamodule
        dtype = next(pl_module.parameters()).dtype
        return {
            "mem_len": cfg.mem_len,
            "eval_mem_len": pl_module.eval_context["mem_len"],
            "tgt_len": datamodule.tgt_len,
            "batch_size": datamodule.batch_size,
            "unit": pl_module.quality_name,
            "params": sum(p.numel() for p in pl_module.parameters()),
            "cache_mb": cache_footprint(cfg.mem_len, cfg.d_model, cfg.n_layer, datamodule.batch_size, dtype).mib,
            "steps": trainer.global_step,
            "train_tokens": self.train_tokens,
            "train_tok_s": self.train_tokens / self.train_seconds if self.train_seconds else None,
            "wall_s": time.perf_counter() - self.created,
        }


def write_json(path: Path, values: dict[str, Any]) -> None:
    """Write via a temporary file, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values, indent=1) + "\n")
    tmp.replace(path)


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
    return sorted(rows, key=lambda r: (r.get("mem_len", math.inf), r["job"]))


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """The table's columns: context, metrics (whatever the unit), cost; unknown keys are left out."""
    unit = next((r["unit"] for r in rows if "unit" in r), "bpb")
    wanted = ["job", "mem_len", "eval_mem_len", "val/loss", f"val/{unit}", "test/loss", f"test/{unit}",
              "train_tok_s", "cache_mb", "params", "wall_s", "status"]
    return [c for c in wanted if any(c in r for r in rows)]


def format_value(column: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if column in ("train_tok_s",):
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


def write_plot(rows: list[dict[str, Any]], sweep_dir: Path) -> Path:
    """Left: val/test quality against mem_len; right: cache MB and training tokens/s against mem_len."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "mem_len" in r]
    unit = next((r["unit"] for r in measured), "bpb")
    x = [r["mem_len"] for r in measured]
    style = "o-" if len(set(x)) == len(x) else "o"  # several jobs per mem_len (e.g. Optuna): points only
    fig, (quality, cost) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for split in ("val", "test"):
        points = [(r["mem_len"], r[f"{split}/{unit}"]) for r in measured if r.get(f"{split}/{unit}") is not None]
        if points:
            quality.plot(*zip(*points, strict=True), style, label=split)
    quality.set(xlabel="mem_len", ylabel=unit, title=f"{unit} against memory length")
    quality.legend()
    cost.plot(x, [r["cache_mb"] for r in measured], style, color="tab:red")
    cost.set(xlabel="mem_len", title="cost against memory length")
    cost.set_ylabel("training cache (MB)", color="tab:red")
    cost.set_ylim(bottom=0)
    speed = [(r["mem_len"], r["train_tok_s"]) for r in measured if r.get("train_tok_s")]
    if speed:
        rate = cost.twinx()
        rate.plot(*zip(*speed, strict=True), style, color="tab:blue")
        rate.set_ylabel("training tokens/s", color="tab:blue")
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
