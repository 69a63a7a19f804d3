"""Hydra callbacks: checks and reports around whole runs and sweeps (configured under ``hydra.callbacks``)."""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from xl.training.checkpoints import run_lock
from xl.training.runs import holds_run, requeued, resumes
from xl.training.services.sweep import RESULTS_FILE, write_summary

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


class ClaimRunFolder(CheckOutputDir):
    """``python train.py``: a run folder holds one run, written by one launch at a time.

    Before Hydra writes into the folder, the launch's rank 0 locks it (:mod:`xl.training.checkpoints.run_lock`; a second
    process is refused) and refuses a new run into a folder that holds another run's checkpoints: a resume or a requeue
    of that run continues it, and ``overwrite=true`` empties the folder first. Under ``-m`` the same holds for the sweep
    folder: the jobs' folders of an earlier sweep are refused, or removed with ``overwrite=true``. The lock is given
    back when the command ends (``xl.train.main``) or its process dies.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        super().on_run_start(config, **kwargs)
        if run_lock.launch_rank() == 0:
            claim(Path(config.hydra.run.dir), config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        super().on_multirun_start(config, **kwargs)
        if run_lock.launch_rank() == 0:
            claim(Path(config.hydra.sweep.dir), config, "hydra.sweep.dir")

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        run_lock.release(config.hydra.run.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        run_lock.release(config.hydra.sweep.dir)


def claim(folder: Path, config: DictConfig, setting: str) -> None:
    """Lock ``folder`` and make sure it holds no other run (see :class:`ClaimRunFolder`), or exit in one sentence."""
    try:
        run_lock.acquire(folder, setting)
    except run_lock.RunFolderBusy as err:
        sys.exit(f"error: {err}")
    sweep = setting == "hydra.sweep.dir"
    runs = [p for p in folder.iterdir() if p.is_dir() and holds_run(p)] if sweep else [folder] * holds_run(folder)
    if not runs:
        return
    if not sweep and requeued(config):  # the same command again: it continues its run (overwrite acted on its start)
        return
    overwrite = bool(config.get("overwrite"))
    if not sweep and resumes(config, folder):
        if overwrite:
            run_lock.release(folder)
            sys.exit(f"error: overwrite=true would remove the checkpoints that ckpt_path={config.ckpt_path} continues "
                     "from; remove overwrite=true")
        return
    if overwrite:
        empty(folder, runs if sweep else None)
        return
    run_lock.release(folder)
    if sweep:
        sys.exit(f"error: {folder} holds the runs of another sweep; give another {setting} (overwrite=true replaces "
                 "them)")
    sys.exit(f"error: {folder} holds another run's checkpoints; resume it with: python train.py ckpt_path={folder}, "
             f"or give another {setting} (overwrite=true replaces that run)")


def empty(folder: Path, entries: list[Path] | None = None) -> None:
    """Remove ``entries`` (None: everything in ``folder`` but its lock) for ``overwrite=true``."""
    removed = entries if entries is not None else [p for p in folder.iterdir() if p.name != run_lock.LOCK]
    try:
        for path in removed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    except OSError as err:
        run_lock.release(folder)
        sys.exit(f"error: overwrite=true cannot empty {folder} ({err.strerror}); remove its files yourself or give "
                 "another folder")
    log.info("overwrite=true: removed the earlier run from %s", folder)


class FinishWandbRun(Callback):
    """End the job's W&B run when the job ends.

    Under ``-m`` the basic launcher runs every job in one process, and Lightning's ``WandbLogger``
    reuses a W&B run still open in the process: without this, all jobs would log into the first one.
    """

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """The job's status is the W&B run's (a run a stop ended is already finished: xl.training.services.stops)."""
        wandb = sys.modules.get("wandb")  # imported only if the job logged to W&B
        if wandb is not None and wandb.run is not None:
            failed = getattr(job_return, "status", None) == JobStatus.FAILED
            wandb.finish(exit_code=1 if failed else 0)


class SweepSummary(Callback):
    """After ``-m``: the jobs' results as summary.csv/.md/.png in the sweep folder, and to W&B (see
    xl.training.services.sweep).
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
            log.warning("sweep summary: no job wrote %s; add xl.training.services.callbacks.JobSummary to the "
                        "callbacks group", RESULTS_FILE)
        else:
            log.info("sweep summary: %s", sweep_dir / "summary.md")
