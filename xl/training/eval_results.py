"""What ``python -m xl.evaluate`` reports: the printed table, ``results.json`` in its output folder, and W&B.

``results.json`` holds the checkpoint and its run, the corpus scored, the evaluation context and every metric, in the
form a training job's ``results.json`` has (:mod:`xl.training.services.sweep` gathers both): an ``-m`` sweep over
evaluation settings ends with the same summary table and plot as a training sweep. W&B: into the evaluated run's own W&B
run when its folder records the id (resumed offline; metrics under ``evaluate/``, at the checkpoint's step, and one
table row of context and metrics), else into a new run of job type ``evaluate``.

``results.json`` is written again as each split finishes, with ``"complete": false`` until the last one: an
evaluation stopped by a signal (or killed) keeps the splits it finished, and :func:`stopped_sentence` says so.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from xl.device.footprint import memory_bytes
from xl.model import memory_settings
from xl.model.documents import bucket_names
from xl.training.build import build, run_identity
from xl.training.runs import recorded_wandb_id, run_setting
from xl.training.services.callbacks import write_json
from xl.training.services.console import quiet_wandb
from xl.training.services.sweep import RESULTS_FILE


def scored_corpus(datamodule: Any, splits: list[str]) -> dict[str, str]:
    """The files or source of each split scored, in words."""
    return {split: datamodule.source.setting(split) for split in splits}


def describe(module: Any, path: str, step: int, datamodule: Any, corpus: dict[str, str], note: str,
             segments: str) -> str:
    """The evaluation in words: the checkpoint, the data scored (``note``: whose they are) and the context
    (``segments``: where the segment length and the batch come from)."""
    c = module.eval_context
    mode = (f"vanilla (no cache), attn_len={module.attn_len}" if module.attn_len else
            f"mem_len={c.mem_len} same_length={c.same_length}") + f" doc_boundaries={module.doc_boundaries}"
    filled = min(c.mem_len, module.warmup * datamodule.eval_tgt_len)
    scored = "; ".join(corpus.values())
    return (f"checkpoint {path} (step {step}, trained with mem_len={module.config.mem_len})\n"
            f"  scored: {scored} ({note})\n"
            f"  {mode} tgt_len={datamodule.eval_tgt_len} clamp_len={c.clamp_len} "
            f"batch={datamodule.eval_batch_size} ({segments}) warmup={module.warmup} segments"
            + (f" (memory >= {filled} tokens when scoring)" if module.warmup and not module.attn_len else ""))


def format_table(results: dict[str, dict[str, float]], unit: str) -> str:
    """Loss, the tokenizer's own figure, bits per byte (the figure that compares across tokenizers) and, for a
    tokenizer with ``<unk>``, the share of the bytes spelled by its fallback (:mod:`xl.data.metrics`) per split."""
    figures = list(dict.fromkeys([unit, "bpb"]))
    if any(f"{split}/unk_share" in m for split, m in results.items()):
        figures.append("unk_share")
    header = " ".join(f"{f:>9}" for f in figures)
    lines = [f"  {'split':<6} {'loss':>8} {header} {'tokens':>12} {'tokens/s':>10}"]
    for split, m in results.items():
        lines.append(f"  {split:<6} {m[f'{split}/loss']:>8.4f} "
                     + " ".join(f"{m[f'{split}/{f}']:>9.4f}" if f"{split}/{f}" in m else f"{'':>9}" for f in figures)
                     + f" {m[f'{split}/tokens']:>12,.0f} {m[f'{split}/tok_s']:>10,.0f}")
    if all(f"{split}/docs" in m for split, m in results.items()) and results:
        names = bucket_names()
        lines.append(f"  per document ({unit}; by position in document):")
        lines.append(f"  {'split':<6} {'docs':>8} {'mean':>8} " + " ".join(f"{n:>9}" for n in names))
        for split, m in results.items():
            lines.append(f"  {split:<6} {m[f'{split}/docs']:>8,.0f} {cell(m[f'{split}/doc_mean_{unit}'], 8)} "
                         + " ".join(cell(m[f"{split}/pos_{n}_{unit}"], 9) for n in names))
        lines.append("  docs: document pieces; the split is cut into one stretch per stream, and each cut makes one "
                     "piece more")
        if any(math.isnan(v) for split, m in results.items() for k, v in m.items() if k.startswith(f"{split}/pos_")):
            lines.append("  -: no token scored at those positions (warm-up segments are not scored)")
    return "\n".join(lines)


def cell(value: float, width: int) -> str:
    """A figure of the per-document table; ``-`` where no token was scored (the mean of nothing)."""
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}.4f}"


def record(module: Any, datamodule: Any, results: dict[str, dict[str, float]], checkpoint: dict[str, Any],
           corpus: dict[str, str], run_data: bool, complete: bool = True) -> dict[str, Any]:
    """One evaluation as ``results.json`` holds it: context and cost first (the sweep summary's columns), then the
    metrics of every split scored; ``complete``: whether every split asked for is among them."""
    cfg, c = module.config, module.eval_context
    dtype = next(module.parameters()).dtype
    values: dict[str, Any] = {
        "ckpt": checkpoint["path"], "step": checkpoint["step"], "run": checkpoint["run"], "corpus": corpus,
        "run_data": run_data, "complete": complete, "mem_len": cfg.mem_len, "eval_mem_len": c.mem_len,
        "clamp_len": c.clamp_len, "same_length": c.same_length, "memory": memory_settings.describe(cfg.memory),
        "doc_boundaries": module.doc_boundaries, "scored": getattr(datamodule, "scored", "every token"),
        "warmup": module.warmup, "vanilla": module.attn_len is not None,
        "attn_len": module.attn_len, "tgt_len": datamodule.eval_tgt_len, "batch_size": datamodule.eval_batch_size,
        "unit": module.quality_name, "params": sum(p.numel() for p in module.model.parameters()),
        "cache_mb": memory_bytes(cfg, c.mem_len, datamodule.eval_batch_size, dtype, datamodule.eval_tgt_len) / 2**20,
    }
    for metrics in results.values():
        values.update({k: float(v) for k, v in metrics.items()})
    return values


def write_results(output_dir: str | Path, values: dict[str, Any]) -> Path:
    path = Path(output_dir) / RESULTS_FILE
    write_json(path, values)
    return path


@dataclasses.dataclass
class Progress:
    """How far an evaluation got: the split being scored, the splits finished and the file that holds them."""

    scoring: str | None = None
    finished: list[str] = dataclasses.field(default_factory=list)
    written: Path | None = None
    complete: bool = False
    trainer: Any = None  # once built: its progress bars are closed before the closing sentence


def stopped_sentence(signal_name: str, progress: Progress) -> str:
    """What an evaluation that a signal stopped says: where it was, and what it kept."""
    stopped = f"stopped by {signal_name}"
    if progress.complete:
        return f"{stopped} after every split was scored; the results are complete in {progress.written}"
    where = f"while scoring {progress.scoring}" if progress.scoring else "before scoring began"
    if not progress.finished:
        finished = ", before any split was finished" if progress.scoring else ""
        return f"{stopped} {where}{finished}; nothing was written: run the command again"
    if not progress.scoring:
        where = f"after scoring {', '.join(progress.finished)}"
    return (f"{stopped} {where}; {', '.join(progress.finished)} {'is' if len(progress.finished) == 1 else 'are'} "
            f"kept in {progress.written}, marked incomplete: run the command again to score every split")


def log_results(cfg: DictConfig, values: dict[str, Any]) -> str | None:
    """Log the evaluation to W&B (with ``logger.wandb``); returns where it went, in words."""
    if OmegaConf.select(cfg, "logger.wandb") is None:
        return None
    quiet_wandb(cfg.logger.wandb.offline)
    node = OmegaConf.to_container(cfg.logger.wandb, resolve=True)
    run_id = node.get("id") or recorded_wandb_id(values["run"])
    if run_id is None:  # a new run of its own, named and grouped as train.py's runs are
        name, group = run_identity(cfg)
        node.update(name=node.get("name") or name, group=node.get("group") or group, job_type="evaluate")
    else:  # the evaluated run, in its own project: its name, group and config stay as training left them
        project = run_setting(values["run"], "logger.wandb.project") or node.get("project")
        node.update(id=run_id, project=project, name=None, group=None)
    logger = build(OmegaConf.create(node), "logger.wandb")
    if run_id is None:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    scalars = {f"evaluate/{k}": v for k, v in values.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and "/" in k}
    logger.log_metrics(scalars, step=values["step"] or 0)
    columns = [k for k, v in values.items() if isinstance(v, (int, float, str, bool)) or v is None]
    logger.log_table("evaluate/results", columns=columns, data=[[values[k] for k in columns]],
                     step=values["step"] or 0)
    run = logger.experiment
    where = f"W&B run {run.id} ({'the evaluated run' if run_id else 'a new evaluation run'}): {Path(run.dir).parent}"
    run.finish()
    return where
