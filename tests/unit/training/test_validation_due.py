"""The preemption callback's reading of the validation schedule agrees with Lightning's own, step by step."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from xl.training.services.callbacks import validation_due


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Schedule(L.Callback):
    """The steps after which validation_due said yes, and those after which Lightning validated."""

    def __init__(self) -> None:
        self.due: list[int] = []
        self.ran: list[int] = []

    def on_train_batch_end(self, trainer, *args):
        if validation_due(trainer):
            self.due.append(trainer.global_step)

    def on_validation_start(self, trainer, module):
        if not trainer.sanity_checking:
            self.ran.append(trainer.global_step)


@pytest.mark.parametrize("settings", [
    {"val_check_interval": 3},  # every 3 batches, across epochs
    {"val_check_interval": 3, "check_val_every_n_epoch": 1},  # every 3 batches of each epoch
    {"val_check_interval": 0.5, "check_val_every_n_epoch": 1},  # twice an epoch
    {"val_check_interval": 1.0, "check_val_every_n_epoch": 2},  # every other epoch's end
    {"val_check_interval": 4, "accumulate_grad_batches": 2},  # windows of two segments (memory.grad_segments)
    {"val_check_interval": 2, "limit_val_batches": 0},  # no validation
])
def test_validation_due_is_lightnings_schedule(settings, tmp_path):
    data = DataLoader(TensorDataset(torch.randn(7, 2)), batch_size=1)
    schedule = Schedule()
    trainer = L.Trainer(max_steps=20, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[schedule],
                        default_root_dir=tmp_path, **{"check_val_every_n_epoch": None, **settings})
    trainer.fit(Tiny(), train_dataloaders=data, val_dataloaders=data)
    assert trainer.global_step == 20
    assert schedule.due == schedule.ran
    assert bool(schedule.ran) == (settings.get("limit_val_batches") != 0)
