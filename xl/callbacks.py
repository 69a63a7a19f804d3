"""Lightning callbacks of the callbacks group: stopping cleanly when asked, and the job's summary for sweeps.

SIGTERM (most schedulers), SIGUSR1 (SLURM's warning before preemption) and SIGINT (Ctrl+C) only
raise a flag; the run stops at the next step boundary, where the memory, the data position and the
weights agree, writes ``last.ckpt`` there and ends the fit at once by raising :class:`Preempted` (Lightning's
``SIGTERMException``): no validation, no other checkpoint, so a cluster's grace period is spent on nothing else.
Lightning writes checkpoints through an fsspec transaction (a temporary file renamed into place), so a good
``last.ckpt`` is never replaced by a truncated one. A second Ctrl+C interrupts at once.

:class:`JobSummary` writes the job's metrics, training throughput and cost into ``results.json`` in the run
folder, which :mod:`xl.sweep` gathers into a sweep's summary.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from xl.footprint import memory_bytes
from xl.lit import batch_tokens

log = logging.getLogger(__name__)
SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None)


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM/SIGUSR1/SIGINT: finish the step, save ``last.ckpt``, stop training."""

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)
        self.received: int | None = None
        self.saved_path: Path | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum
        if signum == signal.SIGINT:  # a second Ctrl+C falls through to Python's KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Installed after Lightning's own SIGTERM handler (registered between on_fit_start and here).
        self.received = self.saved_path = None
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        stop = self.received is not None
        if trainer.world_size > 1:  # a signal seen by any rank stops all ranks at the same step
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        self.saved_path = self.dirpath / "last.ckpt"
        trainer.save_checkpoint(self.saved_path)
        name = self.signal_name or "a signal on another rank"
        if trainer.is_global_zero:
            log.warning("%s received: stopped after step %d, checkpoint %s", name, trainer.global_step, self.saved_path)
        # Ends the fit here: Lightning's own SIGTERM handling raises it after a validation, which is skipped.
        raise Preempted(name, trainer.global_step, self.saved_path)

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.received).name if self.received else None


class Preempted(SIGTERMException):
    """A fit stopped by a signal at a step boundary, after writing ``path`` (``last.ckpt``)."""

    def __init__(self, signal_name: str, step: int, path: Path) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {path}")
        self.signal_name, self.step, self.path = signal_name, step, path


def preempted_message(err: Preempted, run_dir: str) -> str:
    """What train.py says when a signal stopped the fit: where the checkpoint is and how to resume."""
    return f"{err}; resume with: python train.py ckpt_path={run_dir}"


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
        """The run's context and cost; ``cache_mb`` is one rank's training memory, compressed slots and memory tokens
        included (:func:`xl.footprint.memory_bytes`)."""
        cfg = pl_module.config
        datamodule = trainer.datamodule
        dtype = next(pl_module.parameters()).dtype
        return {
            "mem_len": cfg.mem_len,
            "eval_mem_len": pl_module.eval_context["mem_len"],
            "cmem_len": cfg.cmem_len,
            "cmem_rate": cfg.cmem_rate,
            "num_tokens": cfg.num_tokens,
            "grad_segments": pl_module.grad_segments,
            "doc_boundaries": pl_module.doc_boundaries,
            "scored": getattr(datamodule, "scored", "every token"),  # which targets the metrics count
            "tgt_len": datamodule.tgt_len,
            "batch_size": datamodule.batch_size,
            "unit": pl_module.quality_name,
            "params": sum(p.numel() for p in pl_module.parameters()),
            "cache_mb": memory_bytes(cfg, cfg.mem_len, datamodule.batch_size, dtype, datamodule.tgt_len) / 2**20,
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
