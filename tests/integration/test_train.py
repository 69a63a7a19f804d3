"""train.py as users run it: the command line, the W&B run, sweep naming, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from tests.conftest import CONF_DIR, compose_config, tiny_overrides
from tests.helpers.paths import ROOT
from xl.training.build import build_run, run_identity


def run_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_train_command_end_to_end_with_wandb_offline(tmp_path, corpus):
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith("logger=")]
    result = run_train(*overrides, "logger=wandb", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "test/bpb" in out and "best checkpoint:" in out
    run_dir = tmp_path / "run"
    assert list((run_dir / "checkpoints").glob("*.ckpt"))
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))


def test_bad_value_is_one_line_before_any_work(tmp_path, corpus):
    result = run_train(*tiny_overrides(tmp_path, corpus), "model.dropout=1.5", cwd=tmp_path)
    assert result.returncode == 1
    assert re.fullmatch(r"error: model.dropout must be .*\[0, 1\), got 1.5", result.stderr.splitlines()[-1])
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_sweep_runs_are_named_by_overrides_and_grouped(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["memory.mem_len=64", "model=tiny"], return_hydra_config=True)
    sweep_dir = str(tmp_path / "multirun" / "sweep1")

    def identity_in(mode: RunMode) -> tuple[str, str | None]:
        OmegaConf.set_readonly(cfg.hydra, False)
        with open_dict(cfg):
            cfg.hydra.job.override_dirname = "memory.mem_len=64,model=tiny"
            cfg.hydra.mode = mode
            cfg.hydra.sweep.dir = sweep_dir
        HydraConfig.instance().set_config(cfg)
        return run_identity(cfg)

    try:
        assert identity_in(RunMode.MULTIRUN) == ("memory.mem_len=64,model=tiny", sweep_dir)
        assert identity_in(RunMode.RUN) == ("memory.mem_len=64,model=tiny", None)
    finally:
        HydraConfig.instance().cfg = None


def test_cpu_half_precision_is_refused_with_the_alternative(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "precision=16-mixed")
    with pytest.raises(ValueError, match="use precision=32-true on CPU"):
        build_run(cfg)


@pytest.mark.parametrize("memory", sorted(p.stem for p in (CONF_DIR / "memory").glob("*.yaml")))
def test_debug_quick_validates_tests_a_few_batches_and_keeps_a_best_checkpoint_with_every_memory(memory, tmp_path,
                                                                                                  corpus):
    """``debug=quick`` as the README gives it, with each memory option, on the tiny model: its 30 steps reach two
    validations, a best checkpoint and a test of a few batches; the retrieval memory's store is sized down."""
    from xl.train import fit_and_test

    data = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith(("trainer.", "memory."))]
    cfg = compose_config(*data, "debug=quick", f"memory={memory}")
    trainer = cfg.trainer
    assert (trainer.max_steps, trainer.val_check_interval, trainer.limit_val_batches, trainer.limit_test_batches) == \
        (30, 15, 8, 8)
    assert cfg.memory.get("knn_size", 1024) == 1024  # the retrieval memory's 65,536 entries: 1,024
    metrics = fit_and_test(cfg)
    assert {"val/loss", "test/loss"} <= set(metrics)
    run = tmp_path / "run"
    assert {p.name for p in (run / "checkpoints").glob("step*.ckpt")} & {"step0000015.ckpt", "step0000030.ckpt"}
    assert json.loads((run / "results.json").read_text())["steps"] == 30


def test_the_results_block_names_both_checkpoints_and_every_logs_folder(tmp_path, corpus, caplog):
    """One validation, at the last step: the best checkpoint is the final step's, and the test from it gave the
    callback the state that checkpoint recorded, without last.ckpt: the block lost its "last checkpoint" line. It
    names where the CSV and TensorBoard logs went."""
    from xl.train import fit_and_test

    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith("logger=")]
    cfg = compose_config(*overrides, "trainer.max_steps=10", "trainer.val_check_interval=10",
                         "logger=[csv,tensorboard]")
    with caplog.at_level("INFO", logger="train"):
        fit_and_test(cfg)
    (block,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("results\n")]
    run = tmp_path / "run"
    assert f"  best checkpoint: {run / 'checkpoints' / 'step0000010.ckpt'}\n" in block
    assert f"  last checkpoint: {run / 'checkpoints' / 'last.ckpt'}\n" in block
    assert f"  CSV log: {run / 'csv' / 'metrics.csv'}\n" in block and (run / "csv" / "metrics.csv").is_file()
    assert f"  TensorBoard log: {run / 'tensorboard'} (tensorboard --logdir {run / 'tensorboard'})" in block
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
