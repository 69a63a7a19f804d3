"""The training progress bar: Lightning's ``TQDMProgressBar``, counting the run's optimizer steps against
``trainer.max_steps``.

Lightning's bar counts the batches of the current epoch: a run resumed in the middle of an epoch gets no total and
no ETA (the epoch-start hook that sets them does not run again), and a window of ``grad_segments`` batches per step
counts each batch. ``trainer.max_steps`` counts the whole run, across resumes, so this bar shows the step reached
(``trainer.global_step``) out of ``max_steps``: a resumed run's bar starts where the checkpoint stopped, with the
total and an ETA from the speed since the start of this process. Without ``max_steps`` (``-1``: a run bounded by
epochs) it is Lightning's bar unchanged. Everything else (validation bars, metrics, ``refresh_rate``, off with 0)
is Lightning's.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar


class RunProgressBar(TQDMProgressBar):
    """Lightning's bar over the run's steps: ``global_step`` of ``max_steps`` (see the module docstring)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._count_steps(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if counts_steps(trainer) and not self.is_disabled:
            self.train_progress_bar.initial = 0  # Lightning's reset draws n=0 before it zeroes initial
        super().on_train_epoch_start(trainer, *args)
        self._count_steps(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not counts_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar, step = self.train_progress_bar, trainer.global_step
        if bar.disable or step == bar.n or (step % self.refresh_rate and step != trainer.max_steps):
            return
        bar.n = step
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws

    def _count_steps(self, trainer: pl.Trainer) -> None:
        """The bar counts from the step reached to ``max_steps``; its rate (and ETA) from now on."""
        if not counts_steps(trainer) or self.is_disabled:
            return
        bar = self.train_progress_bar
        bar.initial = 0  # tqdm's reset keeps it: n=0 against a resumed step's initial drew a negative rate
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = trainer.global_step
        bar.set_description(f"Epoch {trainer.current_epoch}")
        bar.refresh()


def counts_steps(trainer: pl.Trainer) -> bool:
    """Whether the run is bounded by ``trainer.max_steps`` (else by epochs, and Lightning's bar counts batches)."""
    return trainer.max_steps is not None and trainer.max_steps > 0
