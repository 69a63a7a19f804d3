"""Lightning's ``ModelCheckpoint``, which also keeps the weights a run ends with.

Lightning writes ``last.ckpt`` when it writes a ranked (or every-N-steps) checkpoint, and at the end of training only
if it never wrote one. A run whose last step is not a validation step (``trainer.max_steps`` not a multiple of
``trainer.val_check_interval``) would end with ``last.ckpt`` at its last validation: the steps after it would be
lost, and an evaluation, a generation or a resume of the run folder would read older weights. :class:`ModelCheckpoint`
writes ``last.ckpt`` at the end of training whenever the final step has not been saved yet.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

log = logging.getLogger(__name__)


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (the same arguments) that never ends a fit with the final step unsaved.

    With ``save_last`` false (or null) the user asked for no ``last.ckpt``: the end of training writes none and says,
    in one line, which step the newest checkpoint holds.
    """

    saved_step: int | None = None  # the step of the newest checkpoint written in this process (Lightning's arguments)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Every checkpoint the trainer writes (this callback's, a signal's) passes here on every rank."""
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self.saved_step = checkpoint.get("global_step", trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.fast_dev_run or self.saved_step == trainer.global_step or trainer.global_step == 0:
            return
        if not self.save_last:
            if trainer.is_global_zero:
                log.info("the final step (%d) is not saved (callbacks.model_checkpoint.save_last=%s); set it to true "
                         "to keep last.ckpt", trainer.global_step, str(self.save_last).lower())
            return
        path = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST)
        self.last_model_path = path  # before the save: it is part of the state the checkpoint records
        trainer.save_checkpoint(path, self.save_weights_only)
