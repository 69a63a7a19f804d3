"""The optimizer of a run: AdamW with linear warm-up then cosine decay (the paper's schedule), and its clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from xl.config.schema import OptimConfig

if TYPE_CHECKING:  # torch is imported by the functions that use it
    import torch
    from torch import nn


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear from 0 to 1 over ``warmup`` steps, then cosine down to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw(model: nn.Module, o: OptimConfig, scaled: bool) -> torch.optim.AdamW:
    """AdamW over ``model`` (weight decay on matrices only).

    Fused: one kernel for all parameters (on CPU, ~6x faster than the default foreach step at config S), and it
    honours the on-device skip of non-finite steps (``found_inf``, set by the Lightning module). Under 16-mixed
    (``scaled``) the GradScaler must unscale the gradients before clipping, which a fused optimizer would do inside
    its step: there the foreach implementation runs, and the scaler skips bad steps itself.
    """
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=not scaled, foreach=True if scaled else None,
    )


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, o: OptimConfig,
                           total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule over ``total`` optimizer steps, stepped once per step."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, o.warmup_steps, total,
                                                                                   o.min_lr_ratio))


def clip(params: Iterable[torch.Tensor], value: float, algorithm: str | None) -> None:
    """Clip gradients as Lightning's ``gradient_clip_val``/``gradient_clip_algorithm`` say (norm by default)."""
    import torch

    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(list(params), value)
    else:
        torch.nn.utils.clip_grad_norm_(list(params), value)
