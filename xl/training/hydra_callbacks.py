"""Hydra callbacks: checks and reports around whole runs and sweeps (configured under ``hydra.callbacks``)."""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from xl.training.sweep import RESULTS_FILE, write_summary

log = logging.getLogger(__name__)


def ensure_writable(folder: str, setting: str) -> None:
    """Create ``folder`` and prove a file can be written there, or exit with one sentence."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        sys.exit(f"error: cannot write to the output folder {folder} ({err.strerror}); "
                 f"set {setting} to a writable folder")


class CheckOutputDir(Callback):
    """Hydra creates the run folder itself and fails with a traceback; check it first."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        ensure_writable(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        ensure_writable(config.hydra.sweep.dir, "hydra.sweep.dir")


class FinishWandbRun(Callback):
    """End the job's W&B run when the job ends.

    Under ``-m`` the basic launcher runs every job in one process, and Lightning's ``WandbLogger``
    reuses a W&B run still open in the process: without this, all jobs would log into the first one.
    """

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """The job's status is the W&B run's (a run a stop ended is already finished: xl.training.stops)."""
        wandb = sys.modules.get("wandb")  # imported only if the job logged to W&B
        if wandb is not None and wandb.run is not None:
            failed = getattr(job_return, "status", None) == JobStatus.FAILED
            wandb.finish(exit_code=1 if failed else 0)


class SweepSummary(Callback):
    """After ``-m``: the jobs' results as summary.csv/.md/.png in the sweep folder, and to W&B (see xl.training.sweep).
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        wandb_cfg = None
        if OmegaConf.select(config, "logger.wandb") is not None:
            wandb_cfg = {k: OmegaConf.select(config, f"logger.wandb.{k}") for k in ("project", "offline", "tags")}
        rows = write_summary(sweep_dir, wandb_cfg)
        if not rows:
            log.warning("sweep summary: no job folders under %s", sweep_dir)
        elif not any("mem_len" in row for row in rows):
            log.warning("sweep summary: no job wrote %s; add xl.training.callbacks.JobSummary to the callbacks group",
                        RESULTS_FILE)
        else:
            log.info("sweep summary: %s", sweep_dir / "summary.md")
