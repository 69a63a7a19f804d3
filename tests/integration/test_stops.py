"""A run that stops before its end says so in one sentence, exits non-zero, and can be finished from the command
line: a signal outside the training steps (sanity check, validation, test), non-finite steps, and what the terminal
and train.log show last."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.conftest import compose_config, tiny_overrides
from tests.helpers.paths import ROOT
from xl import train
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import CheckpointError
from xl.training.services.stops import stopping


class SignalAt(L.Callback):
    """Sends ``signum`` to this process at the start of the first batch of ``stage`` (sanity, validation, test)."""

    def __init__(self, stage: str, signum: int = signal.SIGTERM) -> None:
        self.stage, self.signum, self.sent = stage, signum, False

    def send(self, stage: str) -> None:
        if stage == self.stage and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_validation_batch_start(self, trainer, module, *args):
        self.send("sanity" if trainer.sanity_checking else "validation")

    def on_test_batch_start(self, trainer, module, *args):
        self.send("test")


class ValidationBatches(L.Callback):
    """Counts the batches of each validation of a fit: {global step: batches}."""

    def __init__(self) -> None:
        self.batches: dict[int, int] = {}

    def on_validation_batch_end(self, trainer, module, *args):
        if not trainer.sanity_checking:
            self.batches[trainer.global_step] = self.batches.get(trainer.global_step, 0) + 1


def stop_cfg(tmp_path: Path, corpus, *extra: str, stage: str | None = None):
    signal_at = [f"+callbacks.signal._target_={__name__}.SignalAt", f"+callbacks.signal.stage={stage}"] if stage else []
    return compose_config(*tiny_overrides(tmp_path, corpus), "trainer.num_sanity_val_steps=2", *signal_at, *extra)


def stopped(cfg, counter: ValidationBatches | None = None) -> str:
    """The sentence the training command ends with (``counter``: counts the validations' batches of the fit)."""
    with pytest.raises(SystemExit) as info:
        if counter is None:
            train.fit_and_test(cfg)
        else:
            run = build_run(cfg)
            run.trainer.callbacks.append(counter)
            with stopping(run.trainer, run.trainer.default_root_dir):
                run.trainer.fit(run.module, datamodule=run.datamodule)
    return str(info.value.code)


def test_sigterm_during_the_sanity_check_stops_before_training_and_says_so(tmp_path, corpus):
    """It exited 0 in silence (Lightning's SIGTERMException is a SystemExit without a code)."""
    message = stopped(stop_cfg(tmp_path, corpus, stage="sanity"))
    assert message == ("error: stopped by SIGTERM during the sanity check, before the first training step; nothing "
                       "was saved: run the command again")
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_sigterm_during_a_validation_lets_it_finish_and_stops_after_it(tmp_path, corpus):
    """A signal in the first batch of the validation of step 10 lets that validation score every batch and write its
    checkpoints, then stops with last.ckpt at step 10; the resume trains on and validates at 20 and 30 (the
    validation of step 10 is not lost: it ran before the stop, and is not run twice)."""
    run = tmp_path / "run"
    first = ValidationBatches()
    message = stopped(stop_cfg(tmp_path, corpus, stage="validation"), first)
    assert message == (f"error: stopped by SIGTERM after step 10 and its validation, checkpoint "
                                    f"{run}/checkpoints/last.ckpt; resume with: python train.py ckpt_path={run}")
    assert first.batches == {10: 4}, "the validation under way ran in full"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 10
    model_checkpoint = next(v for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert model_checkpoint["best_model_score"] is not None, "last.ckpt records the validation's score"
    counter = ValidationBatches()
    cfg = stop_cfg(tmp_path, corpus, f"ckpt_path={run}", "trainer.max_steps=30", "test=false")
    resumed = build_run(cfg)
    resumed.trainer.callbacks.append(counter)
    resumed.trainer.fit(resumed.module, datamodule=resumed.datamodule, ckpt_path=resumed.ckpt_path, weights_only=True)
    assert resumed.trainer.global_step == 30 and counter.batches == {20: 4, 30: 4}


class SignalTwice(SignalAt):
    """Sends the signal at the first and at the second batch of the first validation of the fit."""

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, *args):
        if not trainer.sanity_checking and trainer.global_step == 10 and batch_idx < 2:
            os.kill(os.getpid(), self.signum)


def test_a_second_signal_cuts_the_validation_short_and_keeps_its_step(tmp_path, corpus):
    run = tmp_path / "run"
    counter = ValidationBatches()
    cfg = stop_cfg(tmp_path, corpus, f"+callbacks.signal._target_={__name__}.SignalTwice",
                   "+callbacks.signal.stage=validation")
    message = stopped(cfg, counter)
    assert message == (f"error: stopped by SIGTERM during the validation after step 10, checkpoint "
                                    f"{run}/checkpoints/last.ckpt; resume with: python train.py ckpt_path={run}")
    assert counter.batches == {10: 2}, "Lightning ends the validation after the batch the second signal came in"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 10


def test_sigterm_during_the_test_leaves_a_run_that_the_same_command_finishes(tmp_path, corpus):
    """The test was cut short and exited 0; its run could not be finished ("nothing is left to train"). Now the
    resume of a run whose training is complete runs its test, and results.json keeps the training's figures."""
    run = tmp_path / "run"
    message = stopped(stop_cfg(tmp_path, corpus, stage="test"))
    assert re.fullmatch(rf"error: stopped by SIGTERM during the test; the training is complete \({run}/checkpoints/"
                        rf"last.ckpt, step 20\); test it with: python train.py ckpt_path={run}", message), message
    trained = json.loads((run / "results.json").read_text())
    assert "test/loss" not in trained and trained["steps"] == 20 and "val/loss" in trained
    metrics = train.fit_and_test(stop_cfg(tmp_path, corpus, f"ckpt_path={run}"))
    results = json.loads((run / "results.json").read_text())
    assert results["test/loss"] == pytest.approx(metrics["test/loss"])
    assert {k: results[k] for k in trained} == trained, "the training's figures are kept"
    with pytest.raises(CheckpointError, match="nothing is left to train"):  # tested: nothing is left
        train.fit_and_test(stop_cfg(tmp_path, corpus, f"ckpt_path={run}"))


def last_line(output: str) -> str:
    """The line a terminal shows last: progress bars redraw their line with carriage returns."""
    return [line for line in re.split(r"[\r\n]", output) if line.strip()][-1]


STOPS = {  # a real stop of each kind, on the command line with the progress bar drawn
    "signal": ["+callbacks.signal._target_=tests.integration.test_resume.SendSignal", "+callbacks.signal.signum=15",
               "+callbacks.signal.at_step=3"],
    "nonfinite": ["optim.lr=1e10", "max_nonfinite_steps=2"],
}


@pytest.mark.parametrize("name", list(STOPS))
def test_a_stop_is_the_last_line_on_the_terminal_and_is_in_train_log(name, tmp_path, corpus):
    """With the progress bar on, the bar was drawn again after the sentence; the sentence was not in train.log; the
    non-finite stop claimed that the last good checkpoint was kept when none had been written."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith(("paths.output_dir", "callbacks"))]
    run = tmp_path / name
    command = [sys.executable, str(ROOT / "train.py"), *overrides, "callbacks.progress_bar.refresh_rate=1",
               *STOPS[name], f"hydra.run.dir={run}"]
    result = subprocess.run(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=300)
    sentence = last_line(result.stdout)
    assert result.returncode == 1 and sentence.startswith("error: "), result.stdout[-2000:]
    assert (run / "train.log").read_text().rstrip().endswith(sentence)
    if name == "signal":
        assert sentence == (f"error: stopped by SIGTERM after step 3, checkpoint {run}/checkpoints/last.ckpt; "
                            f"resume with: python train.py ckpt_path={run}")
    else:
        assert re.fullmatch(r"error: non-finite loss or gradient for 2 steps in a row \(found by step \d+\); "
                            r"lower optim.lr or set trainer.gradient_clip_val; no checkpoint was written",
                            sentence), sentence
