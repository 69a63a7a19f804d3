"""The schema of the ``callbacks`` and ``logger`` groups: one dataclass per callback and per logger, each naming its
class (``_target_``) and the arguments ``conf/`` sets, with their bounds and help (:func:`xl.settings.bounds.setting`).

Both groups are mappings (``~callbacks.X`` removes one callback, ``logger=csv`` chooses one logger);
:data:`CALLBACKS` and :data:`LOGGERS` give the schema of each known entry, which :mod:`xl.config.schema` registers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xl.settings.bounds import Bound, at_least, is_int, one_of, optional, setting


@dataclass
class ModelCheckpointSchema:
    _target_: str = "xl.training.checkpoints.model_checkpoint.ModelCheckpoint"
    dirpath: str = setting("${paths.output_dir}/checkpoints", help="where checkpoints go")
    filename: str = setting("step{step:07d}", help="the name of a kept checkpoint")
    monitor: str | None = setting("val/loss", help="the metric that ranks checkpoints; null: the latest")
    mode: str = setting("min", bound=one_of("min", "max", words="min or max"), help="lower or higher is better")
    save_top_k: int = setting(1, bound=Bound("-1 (all) or an integer >= 0", lambda v: is_int(v) and v >= -1),
                              help="best checkpoints kept")
    save_last: bool | str | None = setting(
        True, bound=Bound("true, false, null or link", lambda v: v is None or isinstance(v, bool) or v == "link"),
        help="also keep last.ckpt")
    every_n_train_steps: int | None = setting(None, bound=optional(at_least(0)),
                                              help="also save every N optimizer steps (null: at each validation)")
    auto_insert_metric_name: bool = setting(False, help="Lightning's")
    enable_version_counter: bool = setting(
        False, help="false: a checkpoint of the same name is replaced, so last.ckpt is always the newest")


@dataclass
class LearningRateMonitorSchema:
    _target_: str = "lightning.pytorch.callbacks.LearningRateMonitor"
    logging_interval: str | None = setting("step", bound=one_of(None, "step", "epoch", words="step, epoch or null"),
                                           help="when the LR is logged")


@dataclass
class ThroughputMonitorSchema:
    _target_: str = "lightning.pytorch.callbacks.ThroughputMonitor"
    batch_size_fn: Any = setting(factory=lambda: {"_target_": "xl.training.loop.module.batch_rows", "_partial_": True},
                                 help="rows of a batch")
    length_fn: Any = setting(factory=lambda: {"_target_": "xl.training.loop.module.batch_tokens", "_partial_": True},
                             help="tokens of a batch: throughput in tokens/s")


@dataclass
class ProgressBarSchema:
    _target_: str = "xl.training.services.progress_bar.RunProgressBar"
    refresh_rate: int = setting(10, bound=at_least(0), help="steps between updates; 0: off")


@dataclass
class PreemptionSchema:
    _target_: str = "xl.training.services.callbacks.PreemptionCheckpoint"
    dirpath: str = setting("${paths.output_dir}/checkpoints", help="where SIGTERM's checkpoint goes")


@dataclass
class JobSummarySchema:
    _target_: str = "xl.training.services.callbacks.JobSummary"
    path: str = setting("${paths.output_dir}/results.json", help="the run's results")


# The callbacks group is a mapping (so that ``~callbacks.X`` removes one); each known entry has its schema.
CALLBACKS = {"model_checkpoint": ModelCheckpointSchema, "lr_monitor": LearningRateMonitorSchema,
             "throughput": ThroughputMonitorSchema, "progress_bar": ProgressBarSchema,
             "preemption": PreemptionSchema, "job_summary": JobSummarySchema}


@dataclass
class WandbSchema:
    _target_: str = "xl.training.services.loggers.WandbLogger"
    project: str = setting("xl", help="the W&B project")
    save_dir: str = setting("${paths.output_dir}", help="the run folder")
    offline: bool = setting(True, help="true: no account or network needed; wandb sync uploads later")
    name: str | None = setting(None, help="null: run_name, else the overrides")
    group: str | None = setting(None, help="null: the sweep folder under -m")
    id: str | None = setting(None, help="null: the run folder's own (its file wandb_id): a resume continues that run")
    tags: list[str] = setting("${tags}", help="the run's tags")
    log_model: bool | str = setting(False, help="upload checkpoints")


@dataclass
class CSVLoggerSchema:
    _target_: str = "xl.training.services.loggers.CSVLogger"
    save_dir: str = setting("${paths.output_dir}", help="the run folder")
    name: str = setting("csv", help="the subfolder")
    version: int | str | None = setting("", help="Lightning's")


@dataclass
class TensorBoardSchema:
    _target_: str = "lightning.pytorch.loggers.TensorBoardLogger"
    save_dir: str = setting("${paths.output_dir}", help="the run folder")
    name: str = setting("tensorboard", help="the subfolder")
    version: int | str | None = setting("", help="Lightning's")


LOGGERS = {"wandb": WandbSchema, "csv": CSVLoggerSchema, "tensorboard": TensorBoardSchema}
