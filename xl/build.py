"""Turn a composed Hydra config into the objects of a run.

``train.py`` and the other entry points all build their data, module, loggers and trainer here,
so a setting means the same thing everywhere. Every check of user input that can be done before
long work starts is done here and raises :class:`ConfigError` with one sentence naming the setting.
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
from omegaconf import DictConfig, OmegaConf, open_dict

from xl.checkpoint import Checkpoint, CheckpointError, check_compatible
from xl.data import DataError
from xl.lit import XLLitModule

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting the user can fix; the message names it."""


@dataclass
class Run:
    datamodule: Any
    module: XLLitModule
    trainer: L.Trainer
    ckpt_path: str | None = None  # resolved and checked checkpoint to resume or evaluate


def check_device(cfg: DictConfig) -> None:
    """Resolve ``precision=auto``; refuse precisions and device counts this machine cannot honour."""
    t = cfg.trainer
    accelerator = str(t.get("accelerator", "auto"))
    has_cuda = torch.cuda.is_available()
    if accelerator in ("gpu", "cuda") and not has_cuda:
        raise ConfigError(f"trainer.accelerator={accelerator} but no CUDA GPU is visible; use trainer=cpu")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not has_cuda)
    if str(t.get("precision")) == "auto":
        # GPUs: bf16 autocast where the GPU has bf16 (Ampere on), else fp16 with loss scaling. CPUs: fp32,
        # which is the fast choice there (FACTS.md: bf16 matmuls are far slower without AMX/AVX-512).
        choice = "32-true" if on_cpu else "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
        with open_dict(cfg):
            t.precision = choice
        log.info("precision=auto: using %s", choice)
    precision = str(t.get("precision", "32-true"))
    if on_cpu and precision in ("16-mixed", "16-true", "16"):
        raise ConfigError(
            f"precision={precision} needs a CUDA GPU (on CPU Lightning would silently switch to bf16); "
            "use precision=32-true on CPU"
        )
    devices = t.get("devices", 1)
    if not on_cpu and isinstance(devices, int) and devices > torch.cuda.device_count():
        raise ConfigError(
            f"trainer.devices={devices} but only {torch.cuda.device_count()} GPU(s) are visible; lower trainer.devices"
        )


def model_config(cfg: DictConfig, vocab_size: int) -> dict[str, Any]:
    """XLConfig fields: the model group's shape, the memory group's context, the data's vocabulary."""
    return {
        **OmegaConf.to_container(cfg.model, resolve=True),
        "vocab_size": vocab_size,
        "mem_len": cfg.memory.mem_len,
        "clamp_len": cfg.memory.clamp_len,
        "same_length": cfg.memory.same_length,
        "mem_dtype": cfg.memory.mem_dtype,
    }


def build_datamodule(cfg: DictConfig) -> Any:
    """Instantiate the data group and tokenise/cache the corpus now, so bad data fails first."""
    try:
        datamodule = instantiate(cfg.data)
    except InstantiationException as err:  # Hydra wraps the real error; report that one
        cause = err.__cause__
        if isinstance(cause, DataError):
            raise cause from None
        raise ConfigError(f"invalid data setting: {cause or err}") from err
    try:
        datamodule.prepare_data()
    except OSError as err:  # e.g. a full disk: the cache writes atomically, so nothing half-written is kept
        raise DataError(
            f"cannot write the token cache ({err.strerror or err}); free disk space or set data.cache_dir"
        ) from err
    for split, info in datamodule.cache.meta["splits"].items():
        if info.get("unknown"):
            top = ", ".join(f"{symbol!r}×{n}" for symbol, n in info.get("unknown_top", []))
            log.warning("%d %s symbols of the %s split are not in the vocabulary and read as <unk> (%s)",
                        info["unknown"], datamodule.unit, split, top)
    return datamodule


def build_module(cfg: DictConfig, datamodule: Any) -> XLLitModule:
    try:
        module = XLLitModule(
            model=model_config(cfg, datamodule.vocab_size),
            optim=OmegaConf.to_container(cfg.optim, resolve=True),
            eval_mem_len=cfg.memory.eval_mem_len,
            eval_same_length=cfg.memory.eval_same_length,
            eval_clamp_len=cfg.memory.get("eval_clamp_len"),
            unit=datamodule.unit,
            max_nonfinite_steps=cfg.max_nonfinite_steps,
            grad_segments=cfg.memory.get("grad_segments", 1),
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid model/memory/optim setting: {err}") from err
    compile_cfg = cfg.get("compile") or {}
    if compile_cfg.get("enabled"):
        compile_model(module.model, mode=compile_cfg.get("mode"), backend=compile_cfg.get("backend", "inductor"))
    return module


def compile_model(model: torch.nn.Module, mode: str | None = None, backend: str = "inductor") -> None:
    """``torch.compile`` in place (``nn.Module.compile``): parameter names, hence checkpoints, stay the plain model's.

    torch 2.13 (CPU, inductor): with a warm AOTAutograd cache the compiled training graph of this model came
    back with corrupt view shapes (a failure, or a crash, on every run after the first); with the FX graph
    cache alone it is correct, so only the autograd cache is turned off.
    """
    torch._functorch.config.enable_autograd_cache = False
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
        loggers.append(instantiate(logger_cfg))
    return loggers


def build_callbacks(cfg: DictConfig, with_logger: bool = True) -> list[Any]:
    """The callbacks group; without a logger, those that only feed a logger are left out."""
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    if not with_logger:
        callbacks = [c for c in callbacks if not isinstance(c, (LearningRateMonitor, ThroughputMonitor))]
    return callbacks


def build_trainer(cfg: DictConfig) -> L.Trainer:
    loggers = build_loggers(cfg)
    trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=build_callbacks(cfg, bool(loggers)))
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return trainer


def check_checkpoint(cfg: DictConfig, module: XLLitModule) -> str | None:
    """Resolve ``ckpt_path`` (a file or a run folder) and refuse one that cannot serve this run."""
    if not cfg.get("ckpt_path"):
        return None
    checkpoint = Checkpoint.open(cfg.ckpt_path)
    path = checkpoint.path
    check_compatible(checkpoint.model_config, module.config.to_dict(), resuming=bool(cfg.train), path=path)
    memory = checkpoint.train_memory
    if cfg.train and memory is not None and memory.size(2) != cfg.data.batch_size:
        raise CheckpointError(
            f"ckpt_path={path} was trained with data.batch_size={memory.size(2)} (this run: {cfg.data.batch_size}); "
            "resume with the checkpoint's batch size"
        )
    return str(path)


def check_splits(cfg: DictConfig, datamodule: Any, trainer: L.Trainer) -> None:
    """Cut every split's streams for this trainer's world size now: one too short for a batch fails here."""
    datamodule.trainer = trainer
    for stage in ("fit", "test") if cfg.get("test") else ("fit",):
        datamodule.setup(stage)


def build_run(cfg: DictConfig) -> Run:
    """Everything a run needs, validated in order of cost: device, data, model, checkpoint, trainer."""
    check_device(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build_datamodule(cfg)
    module = build_module(cfg, datamodule)
    ckpt_path = check_checkpoint(cfg, module)
    trainer = build_trainer(cfg)
    check_splits(cfg, datamodule, trainer)
    return Run(datamodule, module, trainer, ckpt_path)
