"""A new run that starts from a checkpoint's weights: ``python train.py init_from=RUN`` (fine-tuning).

``init_from`` is a run folder or checkpoint of ours, or a folder ``python -m xl.convert`` wrote. Its model shape
(layers, widths, heads, the adaptive clusters and what they share) is the new run's: it replaces the model group's
values (a line says which), and a shape setting given on the command line (``model.X=…``) that differs from the
checkpoint's is refused in one sentence. Everything else is the new run's own: dropout, the memory (weights of its
own that the checkpoint lacks keep their initial values; the checkpoint's memory's own are left out), the evaluation
context, the optimizer and its schedule (fresh), the data position (the start of the corpus), the run folder. The data
must give the checkpoint's tokenizer (for a converted model: ``data.tokenizer=word data.tokenizer_file=RUN/vocab.json``)
or the run is refused before any training step. A run that continues (``ckpt_path``, or a requeued job) starts from
its own checkpoint, which already holds what ``init_from`` gave it; a converted folder has no training state to
continue, so ``ckpt_path`` naming one is refused with a pointer to ``init_from``.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from xl.training.checkpoints.checkpoint import SHAPE_FIELDS, Checkpoint, CheckpointError

log = logging.getLogger(__name__)
SETTING = "init_from"
MODEL_SHAPE = tuple(f for f in SHAPE_FIELDS if f != "vocab_size")  # the vocabulary comes from the data


def command_line_model_keys() -> set[str]:
    """The model settings the command line gives one by one (``model.X=…``); none when the config was not composed
    from a command line (the Python API)."""
    if not HydraConfig.initialized():
        return set()
    overrides = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    return {o.key_or_group.split(".", 1)[1] for o in overrides
            if o.key_or_group.startswith("model.") and not o.is_delete()}


def plain(value: Any) -> Any:
    """A setting as plain Python: a config list, a list and a tuple of the same values all become one list."""
    value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return list(value) if isinstance(value, (list, tuple)) else value


def start_from(cfg: DictConfig) -> Checkpoint | None:
    """Open ``cfg.init_from`` (None when unset) and give ``cfg.model`` its shape; refuse a conflicting setting."""
    resume = cfg.get("ckpt_path")
    path = cfg.get(SETTING)
    if not path:
        return None
    if resume:  # a resumed (or requeued) fine-tune continues from its own checkpoint
        log.info("%s=%s was this run's start; it continues from ckpt_path=%s", SETTING, path, cfg.ckpt_path)
        return None
    checkpoint = Checkpoint.open(path, SETTING)
    saved = checkpoint.model_config
    given = command_line_model_keys()
    model = cfg.model
    for key in MODEL_SHAPE:
        theirs = plain(saved[key])
        if key in given and key in model and model[key] is not None and plain(model[key]) != theirs:
            raise CheckpointError(f"model.{key}={plain(model[key])} conflicts with {SETTING}={path}, whose model has "
                                  f"{key}={theirs!r} (the shape comes from the checkpoint); remove model.{key} or set "
                                  f"it to {theirs!r}")
    replaced = [f"{k}={plain(saved[k])!r}" for k in MODEL_SHAPE  # (null: the group leaves it to the data)
                if model.get(k) is not None and plain(model[k]) != plain(saved[k])]
    with open_dict(cfg):
        for key in MODEL_SHAPE:
            model[key] = plain(saved[key])
    if replaced:
        log.warning("%s=%s: the model's shape is the checkpoint's, not the model group's (%s)", SETTING, path,
                    ", ".join(replaced))
    return checkpoint


def check_data(checkpoint: Checkpoint | None, datamodule: Any) -> None:
    """Refuse data whose tokenizer is not the checkpoint's (once the data's vocabulary is known, before the model)."""
    if checkpoint is not None:
        checkpoint.check_tokenizer(datamodule.vocab_size, datamodule.tokenizer_fingerprint, SETTING)


def memory_modules(model_config: dict[str, Any]) -> tuple[str, ...]:
    """The names of the modules that hold the own weights of the memory a checkpoint's model was built with (the
    variant's :meth:`~xl.model.memory.Memory.build`, on that model's config)."""
    from xl.model.config import XLConfig

    config = XLConfig.from_dict(model_config)
    return tuple(config.memory.memory(config).build())


def load_weights(checkpoint: Checkpoint | None, module: Any) -> None:
    """Copy the checkpoint's weights into ``module.model``, every tensor checked first. The memory is the new run's:
    weights of its own that the checkpoint lacks (a run with another memory) keep this run's initial values, as the
    Recurrent Memory Transformer adds its memory tokens to a trained model; weights of the checkpoint's memory (under
    the modules its memory builds) that this model lacks are left out. Any other weight that does not fit is refused.
    A line says which."""
    if checkpoint is None:
        return
    model = module.model
    saved, wanted = checkpoint.model_weights(), model.state_dict()
    children = {name for name, _ in model.named_children()}
    theirs = set(memory_modules(checkpoint.model_config)) - children
    left_out = sorted(k for k in saved if k.split(".", 1)[0] in theirs)
    fresh = sorted(k for k in wanted if k.split(".", 1)[0] in model.memory_modules and k not in saved)
    weights = {k: v for k, v in saved.items() if k not in left_out}
    checkpoint.check_weights(model, SETTING, weights, fresh)
    model.load_state_dict({**weights, **{k: wanted[k] for k in fresh}})
    if fresh or left_out:
        log.warning("%s=%s: the memory is this run's (%s)", SETTING, checkpoint.path, "; ".join(
            part for part in (fresh and f"its own weights start fresh: {', '.join(fresh)}",
                              left_out and f"the checkpoint's memory weights are left out: {', '.join(left_out)}")
            if part))
