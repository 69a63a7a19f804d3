"""Hydra launchers and strategies that need a cluster or a GPU: what can run here runs, the rest composes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from tests.conftest import CONF_DIR, compose_config, tiny_overrides
from tests.helpers.paths import ROOT
from xl.config.machine import check_device
from xl.config.rules import ConfigError


def test_slurm_launcher_composes_with_one_task_per_device():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4",
                                           "trainer.num_nodes=2"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)


def test_fsdp_composes_and_asks_for_a_gpu(tmp_path):
    # Lightning's FSDPStrategy refuses CPU accelerators, so here it can only compose and be refused clearly.
    cfg = compose_config("trainer=fsdp", f"paths.output_dir={tmp_path}")
    assert cfg.trainer.strategy._target_.endswith("FSDPStrategy") and cfg.trainer.accelerator == "gpu"
    with pytest.raises(ConfigError, match="use trainer=cpu"):
        check_device(cfg)
    assert instantiate(cfg.trainer.strategy).sharding_strategy.name == "FULL_SHARD"


@pytest.mark.slow
def test_local_submitit_launcher_runs_two_jobs(tmp_path, corpus):
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith("paths.output_dir")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path / 'sweep'}",
         *overrides, "trainer.max_steps=4", "memory.mem_len=0,16"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    for job, mem_len in (("0", 0), ("1", 16)):
        folder = tmp_path / "sweep" / job
        assert f"memory.mem_len={mem_len}" in (folder / ".hydra" / "overrides.yaml").read_text()
        assert (folder / "checkpoints" / "last.ckpt").is_file()
