"""The rules of the trainer group, the callbacks and the loggers, checked before any work (:func:`check_trainer`).

The arguments of each ``_target_`` (a misspelt ``+trainer.X``), the strategy's name (Lightning's own refusal comes
only when the trainer is built, over several sentences), the metric a callback monitors (Lightning's comes at the
first validation, as a traceback) and the compile backend. Each broken rule raises ``ValueError`` with one sentence
naming the setting; :func:`xl.config.rules.check_config` reports it as a ``ConfigError``.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from omegaconf import DictConfig, OmegaConf


def check_trainer(cfg: DictConfig) -> None:
    check_arguments(cfg.trainer, "trainer")
    check_strategy(cfg.trainer.get("strategy"))
    check_arguments(cfg.trainer.get("strategy"), "trainer.strategy")
    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            check_arguments(node, f"{group}.{name}")
    check_monitors(cfg.get("callbacks"), cfg.data.tokenizer)
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


def check_strategy(strategy: Any) -> None:
    """A strategy given by name must be ``auto`` or a name of Lightning's registry (a mapping names its class)."""
    if not isinstance(strategy, str) or strategy == "auto":
        return
    from lightning.pytorch.strategies import StrategyRegistry

    names = sorted(StrategyRegistry.available_strategies())
    if strategy not in names:
        close = difflib.get_close_matches(strategy, names, n=1)
        raise ValueError(f"trainer.strategy must be auto, one of {', '.join(names)}, or a mapping with a _target_, "
                         f"got {strategy!r}" + (f"; did you mean {close[0]}?" if close else ""))


def logged_metrics(tokenizer: str) -> list[str]:
    """The metrics a training run logs at each validation and training step for ``data.tokenizer``, validation first:
    the figures that :class:`xl.training.metrics.LMMetrics` gives a batch, with a byte-length table (the data module
    always has one)."""
    import torch  # (here, not at the top: composing a config starts without torch; see xl.config.rules)

    from xl.data.tokenizers import TOKENIZERS
    from xl.training.metrics import LMMetrics

    metrics, target = LMMetrics(TOKENIZERS[tokenizer].unit), torch.zeros(1, 1, dtype=torch.long)
    # A tokenizer that can meet text its vocabulary lacks (char, word: <unk>) also logs the share of bytes spelled.
    has_unk = hasattr(TOKENIZERS[tokenizer], "unknown_bytes")
    metrics.set_token_bytes(torch.ones(1, dtype=torch.long), 1, 0 if has_unk else None)
    return [name for stage in ("val", "train") for name in metrics.update(stage, torch.zeros(()), target)]


def check_monitors(callbacks: Any, tokenizer: str) -> None:
    """Every callback that monitors a metric (the checkpoint's ``monitor``, an added early stop's) names one that
    the run logs."""
    for name, node in (callbacks or {}).items():
        monitor = node.get("monitor") if OmegaConf.is_dict(node) else None
        if monitor is None:
            continue
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
