"""Train a Transformer-XL: ``python train.py [group=option] [key=value ...]`` (Hydra).

Compose the config, build data/module/trainer (xl/build.py), fit, test the best checkpoint,
and say where everything went. ``-m`` sweeps, e.g. ``python train.py -m memory.mem_len=0,64,128``.
"""

from __future__ import annotations

import errno
import logging
import sys

from omegaconf import DictConfig

from xl.build import build_run
from xl.callbacks import exit_if_preempted
from xl.config import entry_point
from xl.lit import NonFiniteError

log = logging.getLogger("train")


def fit_and_test(cfg: DictConfig) -> dict[str, float]:
    run = build_run(cfg)  # a bad setting ends the command with one sentence (xl.config.entry_point)
    trainer, module, datamodule = run.trainer, run.module, run.datamodule
    if cfg.train:
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=run.ckpt_path, weights_only=True)
        except NonFiniteError as err:
            sys.exit(f"error: {err}")
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            run_dir = trainer.default_root_dir
            sys.exit(f"error: disk full while training ({err.strerror}); the last complete checkpoint in "
                     f"{run_dir} is intact; free space and resume with ckpt_path={run_dir}")
        exit_if_preempted(trainer)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    if cfg.test:
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        ckpt = best or (None if cfg.train else run.ckpt_path)
        for results in trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, verbose=False, weights_only=True):
            metrics.update({k: float(v) for k, v in results.items()})
    report(trainer, metrics)
    return metrics


def report(trainer, metrics: dict[str, float]) -> None:
    lines = [f"  {k:<10} {v:.4f}" for k, v in sorted(metrics.items())]
    ckpt = trainer.checkpoint_callback
    if ckpt is not None and ckpt.best_model_path:
        lines.append(f"  best checkpoint: {ckpt.best_model_path}")
    if ckpt is not None and ckpt.last_model_path:
        lines.append(f"  last checkpoint: {ckpt.last_model_path}")
    lines.append(f"  run folder: {trainer.default_root_dir}")
    log.info("results\n%s", "\n".join(lines))


@entry_point("config")
def main(cfg: DictConfig) -> float | None:
    metrics = fit_and_test(cfg)
    # The objective of sweepers (e.g. Optuna): validation loss of the run.
    return metrics.get("val/loss")


if __name__ == "__main__":
    main()
