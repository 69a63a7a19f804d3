"""A callback that records, per rank, what a DDP run did (imported by train.py runs in tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L


class RankProbe(L.Callback):
    """Writes one JSON line per event to ``<out_dir>/rank<r>.jsonl``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def _write(self, trainer: L.Trainer, record: dict) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"rank": trainer.global_rank, **record}) + "\n")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        mems = module.memory.mems["train"]
        self._write(trainer, {
            "event": "train", "step": trainer.global_step, "loss": outputs["loss"].item(),
            "first_tokens": batch[0][:, 0].tolist(), "memory_sum": float(sum(m.double().sum() for m in mems)),
        })

    def on_validation_epoch_end(self, trainer, module):
        # Runs before the module's own hook: the metric still holds this rank's unsynced sums.
        sums = module.metrics.sums["val_nll"]
        self._write(trainer, {"event": "val_local", "step": trainer.global_step,
                              "sum": float(sums.nats), "weight": float(sums.tokens), "bytes": int(sums.bytes)})

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self._write(trainer, {"event": "val", "step": trainer.global_step,
                                  "loss": float(trainer.callback_metrics["val/loss"])})


class SignalRank(L.Callback):
    """Sends ``signum`` to the process of rank ``rank`` alone, in the middle of training step ``at_step`` (its
    backward), or at the first batch of the validation after that step (``in_validation``)."""

    def __init__(self, rank: int, signum: int, at_step: int, in_validation: bool = False) -> None:
        self.rank, self.signum, self.at_step, self.in_validation = rank, signum, at_step, in_validation

    def send(self, trainer: L.Trainer, step: int) -> None:
        if trainer.global_rank == self.rank and step == self.at_step:
            self.at_step = None
            os.kill(os.getpid(), self.signum)

    def on_before_backward(self, trainer, module, loss):
        if not self.in_validation:
            self.send(trainer, trainer.global_step + 1)

    def on_validation_batch_start(self, trainer, module, *args):
        if self.in_validation and not trainer.sanity_checking:
            self.send(trainer, trainer.global_step)
