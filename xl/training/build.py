"""Turn a composed Hydra config into the objects of a run.

``train.py`` and the other entry points all build their data, module, loggers and trainer here,
so a setting means the same thing everywhere. The schema (xl/config/schema.py) has already checked every
key's name and type at composition; :func:`build_run` then applies every rule of :mod:`xl.config.rules` (ranges,
relations between keys, ``_target_`` arguments, the device, whether the run fits the device's memory) before
the corpus is tokenised or anything is written, each broken rule one sentence naming the setting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.plugins import CheckpointIO
from omegaconf import DictConfig, OmegaConf, open_dict

from xl.config import machine
from xl.config.machine import check_device, run_estimate, uses_cuda
from xl.config.rules import ConfigError, check_config, config_key, model_values
from xl.data import DataError
from xl.data.metrics import FALLBACK_BITS
from xl.device.footprint import available_memory
from xl.device.headroom import setting_to_lower
from xl.memory.store import packed_size
from xl.model.config import XLConfig
from xl.model.memory_settings import eval_overrides
from xl.training.checkpoints.checkpoint import XL_KEY, Checkpoint, CheckpointError, check_compatible
from xl.training.checkpoints.checkpoint_io import AtomicCheckpointIO
from xl.training.checkpoints.init_from import check_data, load_weights, start_from
from xl.training.checkpoints.resume import Resume
from xl.training.loop.curriculum import Curriculum, CurriculumDataModule
from xl.training.loop.module import XLLitModule
from xl.training.services.console import TRAINER_DEFAULTS

log = logging.getLogger(__name__)


@dataclass
class Run:
    datamodule: Any
    module: XLLitModule
    trainer: L.Trainer
    ckpt_path: str | None = None  # resolved and checked checkpoint to resume or evaluate
    resume: Resume | None = None  # the fit this run continues (ckpt_path with train=true)


def model_error(err: Exception) -> ConfigError:
    """XLConfig names its fields ``XLConfig.X``; the user knows them as ``model.X`` or ``memory.X``."""
    message = str(err)
    for name in XLConfig.__dataclass_fields__:
        message = message.replace(f"XLConfig.{name}", config_key(name))
    return ConfigError(message)


def check_fits(cfg: DictConfig, vocab_size: int | None = None, warn: bool = True) -> None:
    """Refuse a run whose estimate (xl.device.footprint) exceeds the device's free memory, naming the setting; warn
    when it is close (:func:`xl.config.machine.check_fits`)."""
    try:
        footprint, processes = run_estimate(cfg, vocab_size)
    except (TypeError, ValueError) as err:  # the model with the data's vocabulary (its cutoffs)
        raise model_error(err) from None

    def need(trial: DictConfig) -> int:
        return run_estimate(trial, vocab_size)[0].total * processes

    machine.check_fits(footprint, processes, *available_memory(uses_cuda(cfg)), warn=warn,
                       lower=lambda: setting_to_lower(cfg, need))


def make_datamodule(cfg: DictConfig) -> Any:
    """Instantiate the data group (a curriculum's: one per stage): its settings are checked, nothing is read yet."""
    if cfg.get("curriculum") is not None:
        return CurriculumDataModule.from_config(cfg, lambda **stage: make_data(cfg, **stage))
    return make_data(cfg)


def make_data(cfg: DictConfig, **overrides: Any) -> Any:
    try:
        return instantiate(cfg.data, **overrides)
    except InstantiationException as err:  # Hydra wraps the real error; report that one
        cause = err.__cause__
        if isinstance(cause, DataError):
            raise cause from None
        raise ConfigError(f"invalid data setting: {cause or err}") from err


def prepare(datamodule: Any) -> Any:
    """Tokenise and cache the corpus now, so that bad data fails before the model and trainer exist."""
    datamodule.prepare_data()  # a cache that cannot be written is one sentence naming why (xl.data.cache)
    for split, info in datamodule.cache.meta["splits"].items():
        if info.get("unknown"):
            top = ", ".join(f"{symbol!r}×{n}" for symbol, n in info.get("unknown_top", []))
            log.warning("%d %s symbols of the %s split are not in the vocabulary and read as <unk> (%s); bits per "
                        "byte charge %d bits for each byte an <unk> stands for (%s/unk_share: their share)",
                        info["unknown"], datamodule.unit, split, top, FALLBACK_BITS, split)
    return datamodule


def build_datamodule(cfg: DictConfig) -> Any:
    """The data group's datamodule with its corpus tokenised and cached."""
    return prepare(make_datamodule(cfg))


def build_module(cfg: DictConfig, datamodule: Any) -> XLLitModule:
    try:
        module = XLLitModule(
            model=model_values(cfg, datamodule.vocab_size, datamodule.default_cutoffs),
            optim=OmegaConf.to_container(cfg.optim, resolve=True),
            **{f"eval_{name}": value for name, value in eval_overrides(cfg.memory).items()},
            unit=datamodule.unit,
            max_nonfinite_steps=cfg.max_nonfinite_steps,
            doc_boundaries=cfg.memory.get("doc_boundaries") or "ignore",
            grad_segments=cfg.memory.get("grad_segments", 1),
        )
    except (TypeError, ValueError) as err:  # the vocabulary's: check_config saw the rest
        raise model_error(err) from err
    compile_cfg = cfg.get("compile") or {}
    if compile_cfg.get("enabled"):
        compile_model(module.model, mode=compile_cfg.get("mode"), backend=compile_cfg.get("backend", "inductor"))
    return module


def compile_model(model: torch.nn.Module, mode: str | None = None, backend: str = "inductor") -> None:
    """``torch.compile`` in place (``nn.Module.compile``): parameter names, hence checkpoints, stay the plain model's.

    torch 2.13 (CPU, inductor): with a warm AOTAutograd cache the compiled training graph of this model comes
    back with corrupt view shapes (a failure, or a crash, on every run after the first). torch's public switch,
    ``torch.compiler.config.force_disable_caches``, turns every compile cache off for the process, so each run
    compiles afresh (tests/unit/training/test_lit.py, run twice over a warm cache: correct both times).
    """
    torch.compiler.config.force_disable_caches = True
    model.compile(mode=mode, backend=backend)


def run_identity(cfg: DictConfig) -> tuple[str, str | None]:
    """(name, group): the run is named after its overrides; a sweep's runs share its folder as group."""
    name, group = cfg.get("run_name"), None
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        name = name or hydra_cfg.job.override_dirname or "default"
        if hydra_cfg.mode == RunMode.MULTIRUN:
            group = str(Path(hydra_cfg.sweep.dir))
    return name or "default", group


def build(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """``instantiate(node)``, with a failure of the target's own checks reported as one sentence naming ``key``."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ConfigError(f"{key}: {str(cause).splitlines()[0]}") from err


def build_loggers(cfg: DictConfig) -> list[Any]:
    if not cfg.get("logger"):
        return []
    name, group = run_identity(cfg)
    loggers = []
    for key, logger_cfg in cfg.logger.items():
        if key == "wandb":
            logger_cfg = logger_cfg.copy()
            with open_dict(logger_cfg):
                logger_cfg.name = logger_cfg.get("name") or name
                logger_cfg.group = logger_cfg.get("group") or group
        loggers.append(build(logger_cfg, f"logger.{key}"))
    return loggers


def build_callbacks(cfg: DictConfig, with_logger: bool = True) -> list[Any]:
    """The callbacks group; without a logger, those that only feed a logger are left out."""
    callbacks = [build(c, f"callbacks.{key}") for key, c in (cfg.get("callbacks") or {}).items()]
    if not with_logger:
        callbacks = [c for c in callbacks if not isinstance(c, (LearningRateMonitor, ThroughputMonitor))]
    return callbacks


def make_trainer(cfg: DictConfig, preloaded: Checkpoint | None = None, **kwargs: Any) -> L.Trainer:
    """The trainer group's Trainer (``kwargs``: its loggers and callbacks), quiet (xl/training/services/console.py) and
    writing its checkpoints with :class:`xl.training.checkpoints.checkpoint_io.AtomicCheckpointIO` (``preloaded``: a
    checkpoint already read, which Lightning is handed instead of reading it again): every entry point builds its
    Trainer here."""
    quiet = {k: v for k, v in TRAINER_DEFAULTS.items() if k not in cfg.trainer}
    plugins = [build(p, "trainer.plugins") for p in cfg.trainer.get("plugins") or []]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO(preloaded and (preloaded.path, preloaded.state)))
    return build(cfg.trainer, "trainer", plugins=plugins, **quiet, **kwargs)


def build_trainer(cfg: DictConfig, preloaded: Checkpoint | None = None, resumed: Checkpoint | None = None) -> L.Trainer:
    """The run's Trainer; ``preloaded``: the checkpoint a fit resumes from; ``resumed``: the checkpoint of the run
    this command continues (a fit's, or the test of a run whose training is complete): its loggers continue from
    its step."""
    loggers = build_loggers(cfg)
    resumed = resumed or preloaded
    for logger in loggers if resumed is not None else []:
        if hasattr(logger, "continue_from"):  # xl.training.services.loggers
            logger.continue_from(resumed.global_step or 0, (resumed.state.get(XL_KEY) or {}).get("step_row"))
    callbacks, stages = build_callbacks(cfg, bool(loggers)), {}
    if cfg.get("curriculum") is not None:  # a new stage's loaders take effect at the next epoch
        callbacks, stages = [*callbacks, Curriculum()], {"reload_dataloaders_every_n_epochs": 1}
    trainer = make_trainer(cfg, preloaded, logger=loggers or False, callbacks=callbacks, **stages)
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return trainer


def check_checkpoint(cfg: DictConfig, module: XLLitModule, datamodule: Any, checkpoint: Checkpoint) -> str:
    """Refuse a checkpoint (of a resume, or one to test) that cannot serve this run."""
    path = checkpoint.path
    checkpoint.check_tokenizer(datamodule.vocab_size, datamodule.tokenizer_fingerprint, "ckpt_path")
    check_compatible(checkpoint.model_config, module.config.to_dict(), resuming=bool(cfg.train), path=path)
    checkpoint.check_weights(module.model, "ckpt_path")
    memory = checkpoint.train_memory
    rows = None if memory is None else packed_size(memory)[1]
    if cfg.train and rows is not None and rows != cfg.data.batch_size:
        raise CheckpointError(
            f"ckpt_path={path} was trained with data.batch_size={rows} (this run: {cfg.data.batch_size}); "
            "resume with the checkpoint's batch size"
        )
    return str(path)


def check_splits(cfg: DictConfig, datamodule: Any, trainer: L.Trainer) -> None:
    """Cut every split's streams for this trainer's world size now: one too short for a batch fails here."""
    datamodule.trainer = trainer
    for stage in ("fit", "test") if cfg.get("test") else ("fit",):
        datamodule.setup(stage)


def build_run(cfg: DictConfig) -> Run:
    """Everything a run needs, validated in order of cost: settings, device, data settings, size, corpus,
    model, checkpoint, trainer."""
    resume = Resume.open(cfg)  # ckpt_path with train=true: its checkpoint, read once
    initial = start_from(cfg)  # init_from: the model's shape is the checkpoint's
    check_config(cfg)
    check_device(cfg)
    datamodule = make_datamodule(cfg)
    if resume is not None:
        resume.check_data(cfg, datamodule.identity)  # before the corpus is read
    check_fits(cfg, warn=False)  # with the smallest vocabulary the data can give: before tokenising
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    prepare(datamodule)
    check_data(initial, datamodule)
    check_fits(cfg, datamodule.vocab_size)
    module = build_module(cfg, datamodule)
    load_weights(initial, module)
    checkpoint = resume.checkpoint if resume else Checkpoint.open(cfg.ckpt_path) if cfg.get("ckpt_path") else None
    ckpt_path = check_checkpoint(cfg, module, datamodule, checkpoint) if checkpoint else None
    trainer = build_trainer(cfg, checkpoint if resume and not resume.finished else None, resume and checkpoint)
    check_splits(cfg, datamodule, trainer)
    return Run(datamodule, module, trainer, ckpt_path, resume)
