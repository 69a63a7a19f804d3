"""The training progress bar counts the run's steps out of trainer.max_steps: a resumed run's bar has its total and
an ETA, and a window of several segments per step counts steps, not batches."""

from __future__ import annotations

import lightning as L
import pytest

from tests.conftest import compose_config, tiny_overrides
from xl.training.build import build_run
from xl.training.services.progress_bar import RunProgressBar


class BarSeen(L.Callback):
    """What the bar shows after each training batch (this callback runs after the bar's own hook)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int | None, str]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        bar = trainer.progress_bar_callback
        assert isinstance(bar, RunProgressBar), f"the progress bar is Lightning's {type(bar).__name__}"
        self.seen.append((bar.train_progress_bar.n, bar.train_progress_bar.total, str(bar.train_progress_bar)))


def fit(cfg) -> list[tuple[int, int | None, str]]:
    run = build_run(cfg)
    seen = BarSeen()
    run.trainer.callbacks.append(seen)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
    return seen.seen


@pytest.mark.parametrize("window", [1, 2])
def test_a_resumed_run_shows_its_steps_out_of_max_steps_with_an_eta(tmp_path, corpus, window):
    common = [*tiny_overrides(tmp_path, corpus), "callbacks.progress_bar.refresh_rate=1", "test=false",
              "trainer.val_check_interval=4", f"memory.grad_segments={window}"]
    first = fit(compose_config(*common, "trainer.max_steps=4"))
    assert [(n, total) for n, total, _ in first][-1] == (4, 4)
    resumed = fit(compose_config(*common, "trainer.max_steps=8", f"ckpt_path={tmp_path / 'run'}"))
    assert all(total == 8 for _, total, _ in resumed)
    # From the checkpoint's step, one more per optimizer step: a window of `window` segments (batches) makes one.
    assert [n for n, _, _ in resumed] == [4 + (batch + 1) // window for batch in range(4 * window)]
    shown = resumed[-2][2]
    assert "Epoch 0" in shown and "/8 [" in shown and "<00:" in shown and "?" not in shown, shown  # an ETA
