"""data.train_samples=stream through the real Trainer: a run stopped mid-epoch and resumed from its checkpoint trains
on the very samples, with the very losses and weights, of the unbroken run; experiment=babilong_bytes trains on it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import compose_config, run_hydra_main
from tests.integration.test_resume import STEPS, STOP_AT, assert_resumed_as_unbroken, fit
from xl import train
from xl.config.rules import ConfigError, check_config

STREAM = ["data=babilong", "model=tiny", "data.tasks=[qa1,qa4]", "data.length=0", "data.train_samples=stream",
          "data.eval_samples=6", "data.tgt_len=16", "data.batch_size=3", "memory.mem_len=16", "logger=none",
          "trainer.limit_val_batches=2", "trainer.num_sanity_val_steps=0", "callbacks.progress_bar.refresh_rate=0",
          "+trainer.enable_model_summary=false"]


def stream_cfg(tmp_path, run: str, *extra: str):
    return compose_config(
        *STREAM, f"data.cache_dir={tmp_path / 'cache'}", f"paths.output_dir={tmp_path / run}", "model.dropout=0.1",
        "trainer.limit_train_batches=5", "trainer.val_check_interval=3", f"trainer.max_steps={STEPS}",
        "callbacks.model_checkpoint.monitor=null", f"callbacks.model_checkpoint.every_n_train_steps={STOP_AT}",
        "trainer.deterministic=true", *extra)


def test_a_stream_resumed_mid_epoch_goes_on_as_the_unbroken_run(tmp_path):
    whole, whole_losses = fit(stream_cfg(tmp_path, "whole"))
    assert sorted(whole_losses) == list(range(1, STEPS + 1))
    first, _ = fit(stream_cfg(tmp_path, "first", f"trainer.max_steps={STOP_AT}"))
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert state["position"] == STOP_AT and set(state["rows"]) == {"0", "1", "2"}
    second, second_losses = fit(stream_cfg(tmp_path, "second", f"ckpt_path={tmp_path / 'first'}"))
    assert_resumed_as_unbroken(whole, whole_losses, second, second_losses)
    # the epochs of 5 segments did not start the stream again: the 12 segments read were 12 different ones
    loader = whole.datamodule.train_dataloader()
    assert loader.state_dict()["position"] == STEPS


def test_the_babilong_experiment_trains_on_a_stream(tmp_path, monkeypatch):
    monkeypatch.setenv("XL_CACHE_DIR", str(tmp_path / "cache"))
    run_hydra_main(train.main, [
        "train.py", "experiment=babilong_bytes", "data.train_samples=stream", "data.eval_samples=6",
        "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "trainer.num_sanity_val_steps=0", "callbacks.progress_bar.refresh_rate=0",
        "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["scored"] == "answer tokens only"
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"] == 3


def test_a_fraction_of_the_endless_epoch_is_refused_in_one_sentence(tmp_path):
    check_config(compose_config(*STREAM, "trainer.limit_train_batches=1.0", "trainer.val_check_interval=7"),
                 lambda: 256)
    for setting in ("trainer.val_check_interval=0.5", "trainer.limit_train_batches=0.25"):
        key, value = setting.split("=")
        with pytest.raises(ConfigError, match=rf"^{key} must be a count of segments with data.train_samples=stream, "
                                              rf"whose epoch never ends; got {value}$"):
            check_config(compose_config(*STREAM, setting), lambda: 256)
