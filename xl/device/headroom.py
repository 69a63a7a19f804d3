"""How a run's estimated footprint (:class:`xl.device.footprint.RunFootprint`) compares with the memory a device has:
the verdict, the words that name each part of the footprint, and the setting to lower (used by
:func:`xl.config.machine.check_fits` and by ``python -m xl.footprint``)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from xl.settings.bounds import is_int

if TYPE_CHECKING:
    from xl.device.footprint import RunFootprint

WARN_FRACTION = 0.8  # of the device's free memory: above it a run is warned about, above all of it refused
GiB = 2**30
# The settings that shrink each part of a run's footprint (xl.device.footprint.RunFootprint), and the parts' names.
SETTINGS = {"train_memory": "memory.mem_len or data.batch_size",
            "eval_memory": "memory.eval_mem_len or data.eval_batch_size",
            "parameters": "the model (model.n_layer, model.d_model, model.d_inner)",
            "activations": "data.tgt_len, data.batch_size, memory.mem_len or memory.grad_segments"}
NAMES = {"train_memory": "training memory", "eval_memory": "evaluation memory and its keys/values",
         "parameters": "weights, gradients and AdamW state", "activations": "one training step's activations"}
SIZE_GROUPS = ("model", "memory", "data")  # the groups whose integer settings size the run


def verdict(footprint: RunFootprint, available: int, processes: int = 1) -> str:
    """Whether the run fits: ``fits``, ``close`` (above WARN_FRACTION of the available memory) or ``too big``."""
    need = footprint.total * processes
    return "too big" if need > available else "close" if need > WARN_FRACTION * available else "fits"


def setting_to_lower(cfg: DictConfig, need: Callable[[DictConfig], int]) -> str | None:
    """The integer setting of the model, memory and data groups, above its schema's default, whose default would
    shrink ``need(cfg)`` (the bytes the run needs) the most, with its value and what the default would need:
    ``model.n_head (100000; 4 would need about 42 MiB)``. None when no setting above its default shrinks it.

    The part of the footprint that is largest (activations, say) is shaped by several settings at once; the one
    that has moved furthest from an ordinary run is the one to name."""
    best: tuple[int, str] | None = None
    total = need(cfg)
    for group in SIZE_GROUPS:
        node = cfg.get(group)
        schema = OmegaConf.get_type(node) if OmegaConf.is_dict(node) else None
        for field in dataclasses.fields(schema) if dataclasses.is_dataclass(schema) else ():
            value, default = node.get(field.name), field.default
            if not is_int(value) or not (default is None or (is_int(default) and value > default)):
                continue
            trial = copy.deepcopy(cfg)
            trial[group][field.name] = default
            try:
                smaller = need(trial)
            except (TypeError, ValueError):  # the default breaks a rule between settings: not a choice to offer
                continue
            if smaller < total and (best is None or smaller < best[0]):
                shown = "null" if default is None else default
                best = (smaller, f"{group}.{field.name} ({value}; {shown} would need about {size_text(smaller)})")
    return None if best is None else best[1]


def size_text(n_bytes: int) -> str:
    return f"{n_bytes / GiB:,.1f} GiB" if n_bytes >= GiB / 10 else f"{n_bytes / 2**20:,.0f} MiB"
