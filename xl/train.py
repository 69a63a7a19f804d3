"""Train a Transformer-XL: ``python train.py [group=option] [key=value ...]`` (Hydra; also ``xl-train``).

Hydra composes the config (:func:`train_main`); :func:`fit_and_test` then reads top to bottom: check the settings,
build data/module/trainer (xl/training/build.py), fit, test the best checkpoint, and report where everything went.
``-m`` sweeps, e.g. ``python train.py -m memory.mem_len=0,64,128``.

``python train.py ckpt_path=RUN [key=value ...]`` continues the run in the folder RUN: its own settings (read from
``RUN/.hydra/overrides.yaml``) with the new ones on top, written into RUN, logged into the same W&B run.
``trainer.max_steps`` counts the run's steps in all, not steps added by the resume; a resume may change only what it
would use (xl.training.runs.RESUMABLE), and one whose training is complete but whose test is not runs the test. A
requeued SLURM job, which runs the same command into the same folder, continues from the folder's newest complete
checkpoint. A stop before the end (a signal, a full disk, non-finite steps) ends in one sentence
(xl/training/services/stops.py).
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf, open_dict

from xl.config.compose import entry_point, exit_on_user_error
from xl.config.rules import ConfigError, check_config
from xl.training.checkpoints import run_lock
from xl.training.runs import continue_run, holds_run, requeued, wandb_id
from xl.training.services import wandb_log
from xl.training.services.console import errors_logged, quiet_libraries, quiet_wandb, quiet_warnings

# Lightning and the training code are imported by the functions that train: composing, printing the config
# (--cfg job, --help) and reporting a bad key answer without them.

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from xl.training.build import Run

log = logging.getLogger("train")


def fit_and_test(cfg: DictConfig) -> dict[str, float]:
    """One run, top to bottom: check the settings, build the run, fit, test, report. Returns the validation and
    test metrics."""
    check(cfg)
    run = build(cfg)
    metrics = fit(cfg, run)
    saved = checkpoints(run.trainer)  # a test from the best checkpoint gives the callback that checkpoint's state
    metrics |= test(cfg, run)
    report(run, metrics, saved if any(saved) else checkpoints(run.trainer))
    return metrics


def check(cfg: DictConfig) -> None:
    """Every rule that needs neither torch nor Lightning, before either is imported."""
    if not cfg.train and not cfg.test:
        raise ConfigError("train=false and test=false leave nothing to do; set test=true to test ckpt_path")
    check_config(cfg, shape=not cfg.get("init_from"), trainer=False)


def build(cfg: DictConfig) -> Run:
    """The run's data, module and trainer (xl.training.build.build_run, each bad setting one sentence). A requeued
    SLURM job (``SLURM_RESTART_COUNT`` > 0) continues from its folder's newest checkpoint; the W&B logger gets the
    folder's W&B id, so every resume logs into the same W&B run."""
    from xl.training.build import build_run

    quiet_libraries()  # Lightning, imported just now, set its own log levels
    output_dir = Path(cfg.paths.output_dir)
    with open_dict(cfg):
        if requeued(cfg) and not cfg.get("ckpt_path") and holds_run(output_dir):
            log.info("requeued: continuing from %s", output_dir)
            cfg.ckpt_path = str(output_dir)
        wandb = OmegaConf.select(cfg, "logger.wandb")
        if wandb is not None:
            quiet_wandb(wandb.offline)
            if not wandb.get("id"):
                wandb.id = wandb_id(output_dir)
    if cfg.get("ckpt_path"):  # continuing into the run folder: its checkpoints are expected there
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    return build_run(cfg)


def fit(cfg: DictConfig, run: Run) -> dict[str, float]:
    """Train (unless the run continued is complete) and return the last validation metrics."""
    from xl.training.services.stops import stopping

    trainer = run.trainer
    if cfg.train and not (run.resume and run.resume.finished):
        with stopping(trainer, trainer.default_root_dir):
            trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


def test(cfg: DictConfig, run: Run) -> dict[str, float]:
    """Test the best checkpoint (a complete run's, the fit's, or ckpt_path with train=false); its metrics."""
    from xl.training.services.stops import stopping

    if not cfg.test:
        return {}
    trainer, callback = run.trainer, model_checkpoint(run.trainer)
    best = callback.best_model_path if callback else ""
    ckpt = str(run.resume.best_path()) if run.resume and run.resume.finished else best or (
        None if cfg.train else run.ckpt_path)
    with stopping(trainer, trainer.default_root_dir):
        results = trainer.test(run.module, datamodule=run.datamodule, ckpt_path=ckpt, verbose=False, weights_only=True)
    return {k: float(v) for values in results for k, v in values.items()}


def model_checkpoint(trainer) -> ModelCheckpoint | None:
    """The callbacks group's ModelCheckpoint (``trainer.checkpoint_callback`` may be another Checkpoint callback)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)


def checkpoints(trainer) -> tuple[str, str]:
    """(best, last): the paths the ModelCheckpoint holds now ("" where none)."""
    ckpt = model_checkpoint(trainer)
    return (ckpt.best_model_path, ckpt.last_model_path) if ckpt is not None else ("", "")


def report(run: Run, metrics: dict[str, float], saved: tuple[str, str]) -> None:
    """The results block: metrics, the checkpoints ``saved`` (best, last), and where the run and its logs are."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    trainer, module = run.trainer, run.module
    if not trainer.is_global_zero:  # one results block for a multi-process run
        return
    lines = [f"  {k:<10} {v:.4f}" for k, v in sorted(metrics.items())]
    params = sum(p.numel() for p in module.parameters())
    lines.append(f"  parameters: {params:,}")
    best, last = saved
    if best:
        lines.append(f"  best checkpoint: {best}")
    if last:
        lines.append(f"  last checkpoint: {last}")
    lines.append(f"  run folder: {trainer.default_root_dir}")
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            lines.append(f"  CSV log: {Path(logger.log_dir) / 'metrics.csv'}")
        elif isinstance(logger, TensorBoardLogger):
            lines.append(f"  TensorBoard log: {Path(logger.log_dir)} (tensorboard --logdir {Path(logger.root_dir)})")
        elif isinstance(logger, WandbLogger):
            wandb = logger.experiment
            where = wandb_upload(Path(wandb.dir).parent, wandb.id) if wandb.offline else wandb.url
            lines.append(f"  W&B run {wandb.id}: {where}")
    log.info("results\n%s", "\n".join(lines))


def wandb_upload(session: Path, run_id: str) -> str:
    """Where an offline W&B run is and the command that uploads all of it: each session (the first and every
    resume) is a folder ``offline-run-<start>-<id>``, and ``wandb sync`` given them all uploads them in order."""
    sessions = wandb_log.sessions(session.parent, run_id)
    return f"{len(sessions)} offline session(s) in {session.parent} (upload: wandb sync {' '.join(map(str, sessions))})"


@entry_point("config")
def train_main(cfg: DictConfig) -> float | None:
    with errors_logged():
        return fit_and_test(cfg).get("val/loss")


def main() -> None:
    """The command line (``xl-train``, which hands what it returns to sys.exit). Each job's validation loss, the
    objective of sweepers such as Optuna, is what :func:`train_main` returns to Hydra."""
    quiet_warnings()
    with exit_on_user_error():
        sys.argv[1:] = continue_run(sys.argv[1:])
    try:
        train_main()
    finally:
        run_lock.release()  # the run folder's lock (xl.training.hydra_callbacks.ClaimRunFolder), however the run ended


if __name__ == "__main__":
    main()
