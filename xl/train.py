"""Train a Transformer-XL: ``python train.py [group=option] [key=value ...]`` (Hydra; also ``xl-train``).

Compose the config, build data/module/trainer (xl/training/build.py), fit, test the best checkpoint,
and say where everything went. ``-m`` sweeps, e.g. ``python train.py -m memory.mem_len=0,64,128``.

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

log = logging.getLogger("train")


def prepare_run(cfg: DictConfig) -> None:
    """A requeued SLURM job (``SLURM_RESTART_COUNT`` > 0) continues from its folder's newest checkpoint; the W&B
    logger gets the folder's W&B id, so every resume logs into the same W&B run."""
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


def fit_and_test(cfg: DictConfig) -> dict[str, float]:
    if not cfg.train and not cfg.test:
        raise ConfigError("train=false and test=false leave nothing to do; set test=true to test ckpt_path")
    check_config(cfg, shape=not cfg.get("init_from"), trainer=False)  # before torch and Lightning are imported
    from xl.training.build import build_run
    from xl.training.services.stops import stopping

    quiet_libraries()  # Lightning, imported just now, set its own log levels
    prepare_run(cfg)
    if cfg.get("ckpt_path"):  # continuing into the run folder: its checkpoints are expected there
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    run = build_run(cfg)  # a bad setting ends the command with one sentence (xl.config.compose.entry_point)
    trainer, module, datamodule = run.trainer, run.module, run.datamodule
    run_dir = trainer.default_root_dir
    if cfg.train and not (run.resume and run.resume.finished):
        with stopping(trainer, run_dir):
            trainer.fit(module, datamodule=datamodule, ckpt_path=run.ckpt_path, weights_only=True)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    # The fit's checkpoints, before a test from one of them gives the callback the state that checkpoint recorded
    # (the best one, written before last.ckpt, records no last checkpoint).
    saved = checkpoints(trainer)
    if cfg.test:
        best = model_checkpoint(trainer).best_model_path if model_checkpoint(trainer) else ""
        ckpt = str(run.resume.best_path()) if run.resume and run.resume.finished else best or (
            None if cfg.train else run.ckpt_path)
        with stopping(trainer, run_dir):
            results = trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, verbose=False, weights_only=True)
        for values in results:
            metrics.update({k: float(v) for k, v in values.items()})
    report(trainer, module, metrics, saved if any(saved) else checkpoints(trainer))
    return metrics


def model_checkpoint(trainer) -> ModelCheckpoint | None:
    """The callbacks group's ModelCheckpoint (``trainer.checkpoint_callback`` may be another Checkpoint callback)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)


def checkpoints(trainer) -> tuple[str, str]:
    """(best, last): the paths the ModelCheckpoint holds now ("" where none)."""
    ckpt = model_checkpoint(trainer)
    return (ckpt.best_model_path, ckpt.last_model_path) if ckpt is not None else ("", "")


def report(trainer, module, metrics: dict[str, float], saved: tuple[str, str]) -> None:
    """The results block: metrics, the checkpoints ``saved`` (best, last), and where the run and its logs are."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

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
            run = logger.experiment
            where = wandb_upload(Path(run.dir).parent, run.id) if run.offline else run.url
            lines.append(f"  W&B run {run.id}: {where}")
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
