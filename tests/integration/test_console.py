"""What a plain run prints: progress, results and real warnings, none of the libraries' notices
(xl/training/services/console.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import tiny_overrides
from tests.integration.test_train import run_train

# Each printed before: Lightning's litlogger tip and info lines, the model summary's FLOPs column (0), a torch
# deprecation inside Lightning, ThroughputMonitor's FLOP request, W&B's banner and "anonymous" notice, and the
# alembic lines of the optuna sweeper.
NOISE = ("litlogger", "GPU available", "FLOPs", "LeafSpec", "flops_per_batch", "anonymous", "wandb:", "alembic")


def test_a_plain_run_prints_progress_results_and_real_warnings_only(tmp_path, corpus):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install hydra-optuna-sweeper")
    overrides = [o for o in tiny_overrides(tmp_path, corpus)
                 if not o.startswith(("logger=", "+trainer.enable_model_summary", "paths.output_dir"))]
    result = run_train("-m", "hydra/sweeper=optuna_mem", "hydra.sweeper.n_trials=1", *overrides, "logger=wandb",
                       f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "test/bpb" in out and "parameters: 27,200" in out and "W&B run " in out
    assert [noise for noise in NOISE if noise in out] == []
    assert list((tmp_path / "sweep" / "0" / "wandb").glob("offline-run-*/*.wandb")), "W&B still logs, silently"


def test_faiss_loads_without_its_loader_lines():
    """Under the commands' job logging, importing faiss (memory.knn_search=faiss) printed eight INFO lines of which
    CPU build it tried. A fresh process: faiss prints them at its first import only."""
    pytest.importorskip("faiss")
    code = ("import logging.config\n"
            "from hydra import compose, initialize_config_dir\n"
            "from omegaconf import OmegaConf\n"
            "from xl.config.compose import CONF_DIR\n"
            "with initialize_config_dir(config_dir=str(CONF_DIR), version_base='1.3'):\n"
            "    cfg = compose('config', return_hydra_config=True)\n"
            "spec = OmegaConf.to_container(cfg.hydra.job_logging, resolve=False)\n"
            "del spec['handlers']['file']\n"  # the run folder's log file: the console is what is checked
            "spec['root']['handlers'] = ['console']\n"
            "logging.config.dictConfig(spec)\n"
            "logging.getLogger().info('shown')\n"
            "import faiss\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout + result.stderr
    assert "shown" in out and "faiss" not in out, out
