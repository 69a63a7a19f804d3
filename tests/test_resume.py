"""Exact resume: stopping mid-epoch and resuming gives the very losses and weights of an unbroken run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.conftest import compose_config, tiny_overrides
from xl.build import build_run
from xl.checkpoint import CheckpointError

STEPS, STOP_AT = 12, 7  # epochs of 5 segments: the stop falls in the middle of the second epoch


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()


def resume_cfg(tmp_path: Path, corpus, run: str, *extra: str):
    return compose_config(
        *tiny_overrides(tmp_path / run, corpus), "model.dropout=0.1", "trainer.limit_train_batches=5",
        "trainer.val_check_interval=3", f"trainer.max_steps={STEPS}", "callbacks.model_checkpoint.monitor=null",
        f"callbacks.model_checkpoint.every_n_train_steps={STOP_AT}", "trainer.deterministic=true", *extra,
    )


def fit(cfg) -> tuple:
    run = build_run(cfg)
    recorder = LossRecorder()
    run.trainer.callbacks.append(recorder)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
    return run, recorder.losses


def test_resume_mid_epoch_is_exact(tmp_path, corpus):
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole"))
    assert sorted(whole_losses) == list(range(1, STEPS + 1))

    first, first_losses = fit(resume_cfg(tmp_path, corpus, "first", f"trainer.max_steps={STOP_AT}"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == STOP_AT and saved["xl"]["train_memory"].shape == (1, 2, 4, 16, 32)

    # Resume by naming the run folder: its checkpoints/last.ckpt is found.
    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", f"ckpt_path={tmp_path / 'first' / 'run'}"))
    assert sorted(second_losses) == list(range(STOP_AT + 1, STEPS + 1))
    for step in second_losses:
        assert second_losses[step] == whole_losses[step], f"step {step} differs after resume"
    for (name, a), b in zip(whole.module.state_dict().items(), second.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_resume_with_another_memory_length_is_refused(tmp_path, corpus):
    fit(resume_cfg(tmp_path, corpus, "first", "trainer.max_steps=3",
                   "callbacks.model_checkpoint.every_n_train_steps=3"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    cfg = resume_cfg(tmp_path, corpus, "second", f"ckpt_path={ckpt}", "memory.mem_len=8")
    with pytest.raises(CheckpointError, match=r"mem_len=16 \(this run: 8\)"):
        build_run(cfg)
    cfg = resume_cfg(tmp_path, corpus, "third", f"ckpt_path={ckpt}", "model.d_model=48")
    with pytest.raises(CheckpointError, match=r"d_model=32 \(this run: 48\)"):
        build_run(cfg)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing"])
def test_damaged_checkpoint_is_one_clear_error(tmp_path, corpus, damage):
    path = tmp_path / "bad.ckpt"
    if damage == "truncated":
        fit(resume_cfg(tmp_path, corpus, "first", "trainer.max_steps=3",
                       "callbacks.model_checkpoint.every_n_train_steps=3"))
        good = (tmp_path / "first" / "run" / "checkpoints" / "last.ckpt").read_bytes()
        path.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01not a checkpoint" * 100)
    cfg = resume_cfg(tmp_path, corpus, "second", f"ckpt_path={path}")
    with pytest.raises(CheckpointError, match="ckpt_path=") as info:
        build_run(cfg)
    assert "\n" not in str(info.value)


class SendSignal(L.Callback):
    """Delivers a real signal to this process in the middle of a training step."""

    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step = signum, at_step

    def on_before_backward(self, trainer, module, loss):
        if trainer.global_step == self.at_step - 1:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_checkpoints_and_resume_is_exact(tmp_path, corpus, signum):
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole"))
    run = build_run(resume_cfg(tmp_path, corpus, "first", "callbacks.model_checkpoint.every_n_train_steps=null"))
    run.trainer.callbacks.append(SendSignal(signum, at_step=STOP_AT))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == STOP_AT, "the run stops at the end of the step the signal arrived in"
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == STOP_AT
    assert signal.getsignal(signum) is not None  # handlers are restored after fit

    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", f"ckpt_path={ckpt}"))
    assert sorted(second_losses) == list(range(STOP_AT + 1, STEPS + 1))
    assert all(second_losses[s] == whole_losses[s] for s in second_losses)
