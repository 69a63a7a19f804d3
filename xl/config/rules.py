"""Every rule a config must satisfy, in one place, each broken rule one sentence naming the setting to change.

:func:`check_config` checks a composed config once, before any work: the bounds the schemas declare beside each field
(:mod:`xl.config.schema`, :mod:`xl.settings.bounds`), keys added with ``+``, the rules between settings (the model's
shape, the memory's variants, the compression rate, windows of ``grad_segments``) and those of the trainer, its
callbacks and loggers (with the bounds, the strategy's name, which Lightning would refuse only when the trainer is
built, over several sentences; :func:`check_trainer`: the arguments each ``_target_`` takes, a misspelt
``+trainer.X`` among them; the metric a callback monitors, which Lightning would refuse at the first validation, as
a traceback; the compile backend) and the schedule's (:mod:`xl.config.schedule`: an endless training split, a
curriculum's stages, a searching sweeper's objective). :mod:`xl.config.machine` adds what the machine allows. The
model's rules live with the model (:mod:`xl.model.config`), which applies them all to every
:class:`~xl.model.config.XLConfig` when it is made, so a Python user gets the same sentences; here the schema bounds
each field alone, and the model's rules between fields (:func:`~xl.model.config.check_shape`) and of the context
(:meth:`~xl.model.memory_settings.MemoryContext.check`, in training and in evaluation) run once on a composed config's
values, named as the user writes them.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from xl.config.schedule import check_schedule
from xl.data.tokenizers import make_tokenizer
from xl.model import memory_settings
from xl.model.config import CONTEXT_FIELDS, check_shape
from xl.settings.bounds import schema_bounds, shown

log = logging.getLogger(__name__)

# Where each XLConfig field is set in a composed config (the rest are model.X; vocab_size comes from the data).
GROUP_OF_FIELD = {**{name: "memory" for name in CONTEXT_FIELDS}, "vocab_size": "data"}


class ConfigError(ValueError):
    """A setting the user can fix; the message names it."""


def config_key(name: str) -> str:
    return f"{GROUP_OF_FIELD.get(name, 'model')}.{name}"


def eval_key(name: str) -> str:
    """The evaluation's override of a context field (``memory.eval_mem_len``)."""
    return f"memory.eval_{name}"


# ---- the trainer, its callbacks and loggers ------------------------------------------------------------------
def check_trainer(cfg: DictConfig) -> None:
    check_arguments(cfg.trainer, "trainer")
    check_arguments(cfg.trainer.get("strategy"), "trainer.strategy")
    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            check_arguments(node, f"{group}.{name}")
    check_monitors(cfg.get("callbacks"), cfg.data.tokenizer)
    check_schedule(cfg)
    check_compile(cfg.compile)


def check_arguments(node: Any, key: str) -> None:
    """Refuse keys that ``node``'s ``_target_`` does not take (e.g. a misspelt ``+trainer.X``), naming them."""
    if not OmegaConf.is_dict(node) or "_target_" not in node:
        return
    from hydra.utils import get_object  # (Hydra is not imported with the rules, which the model uses too)

    target_path = node["_target_"]
    try:
        target = get_object(target_path)
    except Exception:
        raise ValueError(f"{key}._target_={target_path} cannot be imported; give a full import path") from None
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to check against
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    for name in node:
        if not str(name).startswith("_") and name not in parameters:
            raise ValueError(f"{key}.{name} is not an argument of {target_path}; remove it")


# Lightning's strategy registry by release (``StrategyRegistry.available_strategies()``, tested equal to the installed
# one): a misspelt name is refused before Lightning and torch are imported. Another release reads its registry.
STRATEGIES = {"2.6": (
    "ddp", "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true", "ddp_fork",
    "ddp_fork_find_unused_parameters_false", "ddp_fork_find_unused_parameters_true", "ddp_notebook",
    "ddp_notebook_find_unused_parameters_false", "ddp_notebook_find_unused_parameters_true", "ddp_spawn",
    "ddp_spawn_find_unused_parameters_false", "ddp_spawn_find_unused_parameters_true", "deepspeed", "deepspeed_stage_1",
    "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload",
    "deepspeed_stage_3_offload_nvme", "fsdp", "fsdp_cpu_offload", "single_device", "single_tpu", "single_xla", "xla",
    "xla_debug")}


def strategy_names() -> list[str]:
    """The names Lightning's strategy registry holds: this release's known list, else the registry itself."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = ".".join(version("lightning").split(".")[:2])
    except PackageNotFoundError:
        release = None
    if release in STRATEGIES:
        return sorted(STRATEGIES[release])
    from lightning.pytorch.strategies import StrategyRegistry

    return sorted(StrategyRegistry.available_strategies())


def check_strategy(strategy: Any) -> None:
    """A strategy given by name must be ``auto`` or a name of Lightning's registry (a mapping names its class); the
    sentence lists the registry's families (``ddp``), not each variant (``ddp_spawn_find_unused_parameters_true``)."""
    if not isinstance(strategy, str) or strategy == "auto":
        return
    names = strategy_names()
    if strategy not in names:
        families = [n for n in names if not any(n.startswith(f"{m}_") for m in names)]
        close = difflib.get_close_matches(strategy, names, n=1)
        raise ValueError(f"trainer.strategy must be auto, a mapping with a _target_ or a Lightning strategy "
                         f"({', '.join(families)}, and variants), got {strategy!r}"
                         + (f"; did you mean {close[0]}?" if close else ""))


def check_monitors(callbacks: Any, tokenizer: str) -> None:
    """Every callback that monitors a metric (the checkpoint's ``monitor``, an added early stop's) names one that
    the run logs."""
    for name, node in (callbacks or {}).items():
        monitor = node.get("monitor") if OmegaConf.is_dict(node) else None
        if monitor is None:
            continue
        from xl.data.metrics import logged_metrics  # (torch: composing a config starts without it)

        names = logged_metrics(tokenizer)
        if monitor not in names:
            null = "null (the latest checkpoint)" if name == "model_checkpoint" else "null"
            raise ValueError(f"callbacks.{name}.monitor={monitor} is not a metric of this run; choose one of "
                             f"{', '.join(names)}, or {null}")


def check_compile(compile_cfg: Any) -> None:
    if compile_cfg.enabled:
        import torch

        backends = torch.compiler.list_backends(exclude_tags=())
        if compile_cfg.backend not in backends:
            raise ValueError(f"compile.backend must be one of {', '.join(backends)}, got {compile_cfg.backend!r}")


# ---- a composed config ----------------------------------------------------------------------------------------
def check_bounds(cfg: DictConfig) -> None:
    """Every bound the schemas declare, for each key the config has (a removed callback or logger is skipped), and
    a strategy's name (one of Lightning's)."""
    for key, value, bound in schema_bounds(cfg):
        if not bound.allows(value):
            raise ConfigError(f"{key} must be {bound.says}, got {shown(value)!r}")
    try:
        check_strategy(OmegaConf.select(cfg, "trainer.strategy"))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_added_keys(cfg: DictConfig) -> None:
    """Keys added with ``+`` to a group that takes only its schema's (model, optim; the memory's are its variant's,
    :func:`xl.model.memory_settings.typed`)."""
    for group in ("model", "optim"):
        node = cfg[group]
        known = [f.name for f in dataclasses.fields(OmegaConf.get_type(node))]
        for name in node:
            if name not in known:
                raise ConfigError(f"{group}.{name} is not a setting; {group} has {', '.join(known)}")


def check_memory(cfg: DictConfig) -> None:
    """The memory's context in training and in evaluation (:meth:`xl.model.memory_settings.MemoryContext.check`:
    same_length needs a memory, and the variant's rules against the context), then the lengths the variant must
    divide up (:class:`xl.model.memory_settings.MemoryConfig`)."""
    memory = cfg.memory
    lengths = {key: OmegaConf.select(cfg, key) for key in ("data.tgt_len", "data.eval_tgt_len", "memory.mem_len",
                                                          "memory.eval_mem_len")}
    try:
        variant = memory_settings.variant(memory, cfg)
        trained = memory_settings.MemoryContext.of(memory).check(variant, config_key)
        trained.evaluated(memory_settings.eval_overrides(memory)).check(variant, eval_key)
        variant.check_lengths({key: length for key, length in lengths.items() if length is not None})
    except ValueError as err:
        raise ConfigError(str(err)) from None


def model_values(cfg: DictConfig, vocab_size: int, fitted_cutoffs: list[int] | None = None) -> dict[str, Any]:
    """XLConfig's fields from a composed config: the model group's shape, the memory group's context, the data's
    vocabulary; ``model.cutoffs=null`` takes ``fitted_cutoffs`` (the data's, ``SegmentDataModule.default_cutoffs``)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if model.get("cutoffs") is None:
        model["cutoffs"] = fitted_cutoffs or []
    memory = cfg.memory
    return {**model, "vocab_size": vocab_size, **{name: memory[name] for name in CONTEXT_FIELDS},
            "memory": memory_settings.variant(memory, cfg).to_dict()}


def check_shape_settings(values: Mapping[str, Any], fitted: bool = False) -> None:
    """The rules between the model's fields (:func:`xl.model.config.check_shape`; the schema bounds each field alone)
    on a composed config's values, naming the keys as the user writes them; ``fitted``: the cutoffs are the data's,
    not known yet."""
    try:
        check_shape(SimpleNamespace(**values), key=config_key, fitted=fitted)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None


def vocabulary_bound(cfg: Any) -> int:
    """The smallest vocabulary a composed config's data can give, before its tokenizer is fitted (byte: exactly
    256)."""
    tokenizer = make_tokenizer(cfg.data.tokenizer, **(cfg.data.tokenizer_kwargs or {}))
    cutoffs = cfg.model.cutoffs
    return max(tokenizer.vocab_size, cutoffs[-1] + 1 if cutoffs else 0)


def check_config(cfg: DictConfig, shape: bool = True, trainer: bool = True) -> None:
    """Every rule of a training config that needs neither the corpus nor the device, one sentence for the first
    broken; the cutoffs are checked against :func:`vocabulary_bound`. ``shape=False`` leaves out the model's shape
    (init_from gives it later), ``trainer=False`` the trainer's rules, which import Lightning: train.py checks the
    rest before importing torch."""
    try:
        with open_dict(cfg):
            cfg.memory = memory_settings.typed(cfg.memory)  # (done already where xl.config.compose composed it)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_added_keys(cfg)
    check_bounds(cfg)
    check_memory(cfg)
    if shape:
        check_shape_settings(model_values(cfg, vocabulary_bound(cfg)), fitted=cfg.model.get("cutoffs") is None)
    if trainer:
        try:
            check_trainer(cfg)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def check_evaluate_config(cfg: DictConfig, model: Mapping[str, Any] | None = None, attn_len: int | None = None
                          ) -> None:
    """``python -m xl.evaluate``'s settings: the schema's bounds and the rule between them before the checkpoint is
    read; with its ``model`` config (and the vanilla window ``attn_len`` it gives), the rules that need it."""
    check_bounds(cfg)
    if cfg.per_document and cfg.vanilla:
        raise ConfigError("per_document=true reports the cached evaluation; set vanilla=false")
    variant = memory_settings.variant(model.get("memory")) if model is not None else None
    if variant is not None and cfg.vanilla and not variant.reads_afresh:
        raise ConfigError(f"vanilla=true reads each window afresh, but this model's {variant.name} memory is written "
                          "segment by segment; set vanilla=false")
    if attn_len is not None and attn_len < 1:
        raise ConfigError(f"attn_len must be >= 1 for vanilla=true, got {attn_len}")


def check_generate_config(cfg: DictConfig) -> None:
    """``python -m xl.generate``'s settings: the schema's bounds, and the rules between them (whether the warm-up
    file exists is checked when it is read)."""
    check_bounds(cfg)
    if cfg.warmup and cfg.get("warmup_text"):
        raise ConfigError("warmup (a file) and warmup_text (a text) both set; keep one")
    if not (cfg.prompt or cfg.warmup or cfg.get("warmup_text")):
        raise ConfigError("give a prompt ('prompt=\"...\"'), a warm-up file (warmup=PATH) or a warm-up text "
                          "('warmup_text=\"...\"')")


# ---- the machine --------------------------------------------------------------------------------------------------
# These rules ask torch about the machine; torch is imported when they run, not with the config package, so that
# composing a config (--help, --cfg job, a misspelt key) starts without it.
