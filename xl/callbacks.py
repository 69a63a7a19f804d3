"""Stopping cleanly when the cluster or the user says so.

SIGTERM (most schedulers), SIGUSR1 (SLURM's warning before preemption) and SIGINT (Ctrl+C) only
raise a flag; the run stops at the next step boundary, where the memory, the data position and the
weights agree, and writes ``last.ckpt`` there. Lightning writes checkpoints through an fsspec
transaction (a temporary file renamed into place), so a good ``last.ckpt`` is never replaced by a
truncated one. A second Ctrl+C interrupts at once.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

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
        if not stop or trainer.should_stop:
            return
        self.saved_path = self.dirpath / "last.ckpt"
        trainer.save_checkpoint(self.saved_path)
        trainer.should_stop = True
        name = signal.Signals(self.received).name if self.received else "a signal on another rank"
        rank_zero_info(f"{name} received: stopped after step {trainer.global_step}, checkpoint {self.saved_path}")

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.received).name if self.received else None


def exit_if_preempted(trainer: L.Trainer) -> None:
    """After a fit that a signal stopped: say where the checkpoint is and how to resume, then exit."""
    for callback in trainer.callbacks:
        if isinstance(callback, PreemptionCheckpoint) and callback.signal_name:
            run_dir = trainer.default_root_dir
            sys.exit(f"stopped by {callback.signal_name} after step {trainer.global_step}; checkpoint "
                     f"{callback.saved_path}; resume with the same overrides plus ckpt_path={run_dir}")
