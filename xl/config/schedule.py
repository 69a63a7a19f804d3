"""The rules of a training's schedule: an endless training split (``data.train_samples=stream``), a curriculum's
stages (:mod:`xl.config.curriculum`), and, under a searching sweeper such as Optuna, that the objective it minimises is
computed at all. :func:`check_schedule` checks them once, from :func:`xl.config.rules.check_trainer`; each broken rule
is a ``ValueError`` of one sentence."""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from xl.config.curriculum import check_curriculum
from xl.settings.bounds import is_int


def check_schedule(cfg: DictConfig) -> None:
    check_endless(cfg)
    if cfg.get("curriculum") is not None:
        from xl.data.metrics import logged_metrics

        check_curriculum(cfg, [m for m in logged_metrics(cfg.data.tokenizer) if m.startswith("val/")])
    check_sweep_objective(cfg)


def check_endless(cfg: DictConfig) -> None:
    """A training split made while training (``data.train_samples=stream``) has no end to take a fraction of."""
    if cfg.data.get("train_samples") != "stream":
        return
    for key in ("limit_train_batches", "val_check_interval"):
        value = cfg.trainer.get(key)
        if isinstance(value, float) and not (key == "limit_train_batches" and value == 1.0):
            raise ValueError(f"trainer.{key} must be a count of segments with data.train_samples=stream, whose "
                             f"epoch never ends; got {value!r}")


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def check_sweep_objective(cfg: DictConfig) -> None:
    """A sweeper that searches (Optuna: every sweeper but Hydra's basic one) minimises what each job returns, the
    validation loss: refuse, in the first job and before any work, a sweep in which no validation would run."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or hydra_cfg.sweeper.get("_target_") == BASIC_SWEEPER:
        return
    trainer = cfg.trainer
    if not cfg.train:
        raise ValueError("the sweeper minimises each job's val/loss, which train=false never computes; "
                          "set train=true")
    if trainer.limit_val_batches == 0:
        raise ValueError("the sweeper minimises each job's val/loss, which trainer.limit_val_batches=0 never "
                          "computes; set trainer.limit_val_batches above 0")
    interval, every_epoch, max_steps = trainer.val_check_interval, trainer.check_val_every_n_epoch, trainer.max_steps
    if not is_int(interval) or every_epoch is not None or max_steps < 0:
        return  # by fractions of an epoch: how many the steps cover depends on the data
    per_step = trainer.accumulate_grad_batches * (cfg.memory.get("grad_segments") or 1)  # segments per step
    if interval > max_steps * per_step:
        raise ValueError(f"the sweeper minimises each job's val/loss, but no validation runs within "
                          f"trainer.max_steps={max_steps}; set trainer.val_check_interval to at most "
                          f"{max_steps * per_step}")
