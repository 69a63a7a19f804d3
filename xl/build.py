"""Turn a composed Hydra config into the objects of a run.

``train.py`` and the other entry points all build their data, module, loggers and trainer here,
so a setting means the same thing everywhere. The schema (xl/config.py) has already checked every
key's name and type; here are the checks a type cannot express: ranges, relations between keys, the
arguments of ``_target_`` classes, the device, and whether the run fits in the device's memory. They
all run before the corpus is tokenised or anything is written, each raising :class:`ConfigError` (or
the data's or checkpoint's error) with one sentence naming the setting.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import get_object, instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from omegaconf import DictConfig, OmegaConf, open_dict

from xl.checkpoint import Checkpoint, CheckpointError, check_compatible
from xl.compressive import COMPRESSION_FNS
from xl.config import ConfigError
from xl.console import TRAINER_DEFAULTS
from xl.data import DataError, make_tokenizer
from xl.footprint import NAMES, PRECISION_BYTES, SETTINGS, GiB, RunFootprint, available_memory, run_footprint, verdict
from xl.lit import OptimConfig, XLLitModule
from xl.memory import packed_size
from xl.model import MEM_DTYPES, XLConfig

log = logging.getLogger(__name__)


@dataclass
class Run:
    datamodule: Any
    module: XLLitModule
    trainer: L.Trainer
    ckpt_path: str | None = None  # resolved and checked checkpoint to resume or evaluate


# ---- ranges: what a type cannot say -------------------------------------------------------------------------


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: _int(v) and v >= low


def _batches(v: Any) -> bool:
    """Lightning's limit_*_batches: a count, or a fraction of the epoch."""
    return (_int(v) and v >= 0) or (isinstance(v, float) and 0.0 <= v <= 1.0)


def _devices(v: Any) -> bool:
    """Lightning's trainer.devices: a count, -1 (all), "auto", indices "0,1", or a list of indices."""
    if isinstance(v, str):
        return v == "auto" or bool(re.fullmatch(r"\d+(,\d+)*,?", v))
    if OmegaConf.is_list(v):
        return len(v) > 0 and all(_int(i) and i >= 0 for i in v)
    return v == -1 or (_int(v) and v >= 1)


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# (key, what it must be, test). A key absent from the config (a removed callback, no logger) is skipped.
RANGES: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("memory.mem_len", "an integer >= 0", _at_least(0)),
    ("memory.eval_mem_len", "null or an integer >= 0", lambda v: v is None or v >= 0),
    ("memory.clamp_len", "-1 (no clamping) or a positive integer", lambda v: v == -1 or v > 0),
    ("memory.eval_clamp_len", "null, -1 (no clamping) or a positive integer", lambda v: v is None or v == -1 or v > 0),
    ("memory.mem_dtype", f"one of {', '.join(sorted(MEM_DTYPES))}", lambda v: v in MEM_DTYPES),
    ("memory.doc_boundaries", "reset or ignore", lambda v: v in ("reset", "ignore")),
    ("memory.grad_segments", "an integer >= 1", _at_least(1)),
    ("memory.cmem_len", "an integer >= 0", _at_least(0)),
    ("memory.cmem_rate", "an integer >= 1", _at_least(1)),
    ("memory.cmem_fn", f"one of {', '.join(COMPRESSION_FNS)}", lambda v: v in COMPRESSION_FNS),
    ("optim.weight_decay", "a number >= 0", lambda v: v >= 0),
    ("optim.eps", "a number > 0", lambda v: v > 0),
    ("optim.betas", "two numbers in [0, 1)", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v)),
    ("trainer.accelerator", "one of auto, cpu, gpu, cuda, mps", lambda v: v in ("auto", "cpu", "gpu", "cuda", "mps")),
    ("trainer.devices", "a count >= 1, -1 (all), auto, or a list of device indices", _devices),
    ("trainer.num_nodes", "an integer >= 1", _at_least(1)),
    ("trainer.precision", f"one of auto, {', '.join(PRECISION_BYTES)}", lambda v: v == "auto" or v in PRECISION_BYTES),
    ("trainer.max_steps", "-1 (no limit) or an integer >= 0", _at_least(-1)),
    ("trainer.max_epochs", "null, -1 (no limit) or an integer >= 0", lambda v: v is None or v >= -1),
    ("trainer.limit_train_batches", "a count >= 0 or a fraction in [0, 1]", _batches),
    ("trainer.limit_val_batches", "a count >= 0 or a fraction in [0, 1]", _batches),
    ("trainer.limit_test_batches", "a count >= 0 or a fraction in [0, 1]", _batches),
    ("trainer.val_check_interval", "a count of batches >= 1 or a fraction in (0, 1]",
     lambda v: (_int(v) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0)),
    ("trainer.check_val_every_n_epoch", "null or an integer >= 1", lambda v: v is None or v >= 1),
    ("trainer.gradient_clip_val", "null or a number >= 0", lambda v: v is None or v >= 0),
    ("trainer.accumulate_grad_batches", "an integer >= 1", _at_least(1)),
    ("trainer.log_every_n_steps", "an integer >= 1", _at_least(1)),
    ("trainer.num_sanity_val_steps", "-1 (all) or an integer >= 0", _at_least(-1)),
    ("trainer.deterministic", "true, false or warn", lambda v: isinstance(v, bool) or v == "warn"),
    ("callbacks.model_checkpoint.mode", "min or max", lambda v: v in ("min", "max")),
    ("callbacks.model_checkpoint.save_top_k", "-1 (all) or an integer >= 0", _at_least(-1)),
    ("callbacks.model_checkpoint.save_last", "true, false, null or link",
     lambda v: v is None or isinstance(v, bool) or v == "link"),
    ("callbacks.model_checkpoint.every_n_train_steps", "null or an integer >= 0", lambda v: v is None or v >= 0),
    ("callbacks.lr_monitor.logging_interval", "step, epoch or null", lambda v: v in (None, "step", "epoch")),
    ("callbacks.progress_bar.refresh_rate", "an integer >= 0", _at_least(0)),
    ("compile.mode", f"null or one of {', '.join(COMPILE_MODES[1:])}", lambda v: v in COMPILE_MODES),
    ("seed", "an integer in [0, 2**32)", lambda v: 0 <= v < 2**32),
    ("max_nonfinite_steps", "an integer >= 1", _at_least(1)),
)
ABSENT = object()


def check_ranges(cfg: DictConfig) -> None:
    """Every rule of RANGES whose key the config has."""
    for key, expected, ok in RANGES:
        value = OmegaConf.select(cfg, key, default=ABSENT)
        if value is not ABSENT and not ok(value):
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            raise ConfigError(f"{key} must be {expected}, got {shown!r}")


def check_memory(memory: DictConfig) -> None:
    """same_length needs a memory: the attention window is mem_len keys wide (in training and in evaluation)."""
    if memory.same_length and memory.mem_len == 0:
        raise ConfigError("memory.same_length=True needs mem_len > 0 (the window is memory.mem_len keys wide); "
                          "set memory.mem_len or memory.same_length=false")
    eval_mem_len = memory.mem_len if memory.eval_mem_len is None else memory.eval_mem_len
    eval_same = memory.same_length if memory.eval_same_length is None else memory.eval_same_length
    if eval_same and eval_mem_len == 0:
        raise ConfigError("same_length in evaluation needs an evaluation memory, but memory.eval_mem_len is 0; "
                          "set memory.eval_mem_len > 0 or memory.eval_same_length=false")
    if memory.cmem_len and eval_same:
        raise ConfigError("same_length (in training or evaluation) would hide the compressed memory; "
                          "set memory.same_length=false and memory.eval_same_length=false with memory.cmem_len > 0")


def check_compression_rate(cfg: DictConfig) -> None:
    """Once the memory is full each segment evicts its length in states: a rate that divides it compresses them
    in whole groups (a partial group would be padded, :mod:`xl.compressive`)."""
    memory, data = cfg.memory, cfg.data
    if not memory.cmem_len:
        return
    for key in ("tgt_len", "eval_tgt_len"):
        length = data.get(key)
        if length is not None and length % memory.cmem_rate:
            raise ConfigError(f"memory.cmem_rate={memory.cmem_rate} must divide data.{key}={length} (each segment "
                              f"evicts that many states, compressed in groups of cmem_rate); change either")


GROUP_OF_FIELD = {"mem_len": "memory", "clamp_len": "memory", "same_length": "memory", "mem_dtype": "memory",
                  "cmem_len": "memory", "cmem_rate": "memory", "cmem_fn": "memory"}


def model_error(err: Exception) -> ConfigError:
    """XLConfig names its fields ``XLConfig.X``; the user knows them as ``model.X`` or ``memory.X``."""
    return ConfigError(re.sub(r"XLConfig\.(\w+)", lambda m: f"{GROUP_OF_FIELD.get(m.group(1), 'model')}.{m.group(1)}",
                              str(err)))


def xl_config(cfg: DictConfig, vocab_size: int | None = None) -> XLConfig:
    """The model's XLConfig (validated); ``vocab_size`` defaults to :func:`vocabulary_bound`."""
    values = model_config(cfg, vocab_size or vocabulary_bound(cfg))
    try:
        return XLConfig.from_dict(values)
    except (TypeError, ValueError) as err:
        raise model_error(err) from None


def vocabulary_bound(cfg: DictConfig) -> int:
    """The smallest vocabulary the data can give, before its tokenizer is fitted (byte: exactly 256)."""
    tokenizer = make_tokenizer(cfg.data.tokenizer, **(cfg.data.tokenizer_kwargs or {}))
    cutoffs = cfg.model.cutoffs
    return max(tokenizer.vocab_size, cutoffs[-1] + 1 if cutoffs else 0)


def check_arguments(node: Any, key: str) -> None:
    """Refuse keys that ``node``'s ``_target_`` does not take (e.g. a misspelt ``+trainer.X``), naming them."""
    if not OmegaConf.is_dict(node) or "_target_" not in node:
        return
    try:
        target = get_object(node._target_)
    except Exception:
        raise ConfigError(f"{key}._target_={node._target_} cannot be imported; give a full import path") from None
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to check against
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    for name in node:
        if not str(name).startswith("_") and name not in parameters:
            raise ConfigError(f"{key}.{name} is not an argument of {node._target_}; remove it")


def check_added_keys(cfg: DictConfig) -> None:
    """Keys added with ``+`` to a group that takes only its schema's (model, memory, optim)."""
    for group in ("model", "memory", "optim"):
        node = cfg[group]
        known = [f.name for f in fields(OmegaConf.get_type(node))]
        for name in node:
            if name not in known:
                raise ConfigError(f"{group}.{name} is not a setting; {group} has {', '.join(known)}")


def check_settings(cfg: DictConfig) -> None:
    """Every check of the training config that needs neither data nor device, in one sentence each."""
    check_added_keys(cfg)
    check_ranges(cfg)
    check_memory(cfg.memory)
    check_compression_rate(cfg)
    xl_config(cfg)
    try:
        OptimConfig(**OmegaConf.to_container(cfg.optim, resolve=True))
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    check_arguments(cfg.trainer, "trainer")
    check_arguments(cfg.trainer.get("strategy"), "trainer.strategy")
    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            check_arguments(node, f"{group}.{name}")
    if cfg.compile.enabled:
        from torch._dynamo import list_backends

        if cfg.compile.backend not in list_backends(exclude_tags=()):
            raise ConfigError(f"compile.backend must be one of {', '.join(list_backends(exclude_tags=()))}, "
                              f"got {cfg.compile.backend!r}")


def uses_cuda(cfg: DictConfig) -> bool:
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def check_device(cfg: DictConfig) -> bool:
    """Resolve ``precision=auto``; refuse precisions and device counts this machine cannot honour.

    Returns whether the run uses CUDA GPUs.
    """
    t = cfg.trainer
    accelerator = str(t.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator} but no CUDA GPU is visible; use trainer=cpu")
    on_cpu = not uses_cuda(cfg)
    if str(t.get("precision")) == "auto":
        # GPUs: bf16 autocast where the GPU has bf16 (Ampere on), else fp16 with loss scaling. CPUs: fp32,
        # the fast choice there (bf16 matmuls are far slower without AMX/AVX-512).
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
    return not on_cpu


# ---- does it fit ----------------------------------------------------------------------------------------------
def run_estimate(cfg: DictConfig, vocab_size: int | None = None) -> tuple[RunFootprint, int]:
    """xl.footprint's estimate for one device of this run, and how many processes share that device's memory
    (on CPU, every process of the machine; on GPUs, one). ``vocab_size`` defaults to :func:`vocabulary_bound`."""
    data, memory = cfg.data, cfg.memory
    config = xl_config(cfg, vocab_size)
    eval_batch = data.batch_size if data.eval_batch_size is None else data.eval_batch_size
    eval_mem_len = memory.mem_len if memory.eval_mem_len is None else memory.eval_mem_len
    precision = str(cfg.trainer.precision)
    footprint = run_footprint(config, batch_size=data.batch_size, tgt_len=data.tgt_len, eval_batch_size=eval_batch,
                              eval_mem_len=eval_mem_len, precision=precision if precision in PRECISION_BYTES
                              else "32-true")
    devices = cfg.trainer.devices
    processes = 1 if uses_cuda(cfg) else devices if _int(devices) and devices > 0 else 1
    return footprint, processes


def check_fits(cfg: DictConfig, vocab_size: int | None = None, warn: bool = True) -> None:
    """Refuse a run whose estimate exceeds the device's free memory, naming the setting; warn when it is close."""
    footprint, processes = run_estimate(cfg, vocab_size)
    available, where = available_memory(uses_cuda(cfg))
    judged = verdict(footprint, available, processes)
    if judged == "fits":
        return
    part = footprint.largest()
    shared = f" over {processes} processes" if processes > 1 else ""
    detail = (f"about {footprint.total * processes / GiB:,.1f} GiB ({NAMES[part]}: "
              f"{footprint.parts()[part] * processes / GiB:,.1f} GiB{shared}) against {available / GiB:,.1f} GiB "
              f"of {where}")
    if judged == "too big":
        raise ConfigError(f"this run needs {detail}; lower {SETTINGS[part]}")
    if warn:
        log.warning("this run needs %s, close to the limit (python -m xl.footprint --run ... itemises it)", detail)


def model_config(cfg: DictConfig, vocab_size: int, fitted_cutoffs: list[int] | None = None) -> dict[str, Any]:
    """XLConfig fields: the model group's shape, the memory group's context, the data's vocabulary;
    ``model.cutoffs=null`` takes ``fitted_cutoffs`` (the data's, :meth:`SegmentDataModule.default_cutoffs`)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if model.get("cutoffs") is None:
        model["cutoffs"] = fitted_cutoffs or []
    return {
        **model,
        "vocab_size": vocab_size,
        "mem_len": cfg.memory.mem_len,
        "clamp_len": cfg.memory.clamp_len,
        "same_length": cfg.memory.same_length,
        "mem_dtype": cfg.memory.mem_dtype,
        "cmem_len": cfg.memory.cmem_len,
        "cmem_rate": cfg.memory.cmem_rate,
        "cmem_fn": cfg.memory.cmem_fn,
    }


def make_datamodule(cfg: DictConfig) -> Any:
    """Instantiate the data group: its settings are checked, nothing is read yet."""
    try:
        return instantiate(cfg.data)
    except InstantiationException as err:  # Hydra wraps the real error; report that one
        cause = err.__cause__
        if isinstance(cause, DataError):
            raise cause from None
        raise ConfigError(f"invalid data setting: {cause or err}") from err


def prepare(datamodule: Any) -> Any:
    """Tokenise and cache the corpus now, so that bad data fails before the model and trainer exist."""
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


def build_datamodule(cfg: DictConfig) -> Any:
    """The data group's datamodule with its corpus tokenised and cached."""
    return prepare(make_datamodule(cfg))


def build_module(cfg: DictConfig, datamodule: Any) -> XLLitModule:
    try:
        module = XLLitModule(
            model=model_config(cfg, datamodule.vocab_size, datamodule.default_cutoffs),
            optim=OmegaConf.to_container(cfg.optim, resolve=True),
            eval_mem_len=cfg.memory.eval_mem_len,
            eval_same_length=cfg.memory.eval_same_length,
            eval_clamp_len=cfg.memory.get("eval_clamp_len"),
            unit=datamodule.unit,
            max_nonfinite_steps=cfg.max_nonfinite_steps,
            doc_boundaries=cfg.memory.get("doc_boundaries") or "ignore",
            grad_segments=cfg.memory.get("grad_segments", 1),
        )
    except (TypeError, ValueError) as err:  # the vocabulary's: check_settings saw the rest
        raise model_error(err) from err
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


def build_trainer(cfg: DictConfig) -> L.Trainer:
    loggers = build_loggers(cfg)
    quiet = {k: v for k, v in TRAINER_DEFAULTS.items() if k not in cfg.trainer}  # xl/console.py
    trainer = build(cfg.trainer, "trainer", logger=loggers or False, callbacks=build_callbacks(cfg, bool(loggers)),
                    **quiet)
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return trainer


def check_checkpoint(cfg: DictConfig, module: XLLitModule, datamodule: Any) -> str | None:
    """Resolve ``ckpt_path`` (a file or a run folder) and refuse one that cannot serve this run."""
    if not cfg.get("ckpt_path"):
        return None
    checkpoint = Checkpoint.open(cfg.ckpt_path)
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
    check_settings(cfg)
    check_device(cfg)
    datamodule = make_datamodule(cfg)
    check_fits(cfg, warn=False)  # with the smallest vocabulary the data can give: before tokenising
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    prepare(datamodule)
    check_fits(cfg, datamodule.vocab_size)
    module = build_module(cfg, datamodule)
    ckpt_path = check_checkpoint(cfg, module, datamodule)
    trainer = build_trainer(cfg)
    check_splits(cfg, datamodule, trainer)
    return Run(datamodule, module, trainer, ckpt_path)
