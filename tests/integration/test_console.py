"""What a plain run prints: progress, results and real warnings, none of the libraries' notices
(xl/training/console.py)."""

from __future__ import annotations

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
