"""The optimizer of a run: AdamW with linear warm-up then cosine decay (the paper's schedule), and its clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from xl.config.rules import check_optim


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to ``min_lr_ratio × lr`` (checked by xl.config.rules.check_optim)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_optim(self.lr, self.warmup_steps, self.min_lr_ratio)
        self.betas = tuple(self.betas)


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
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=o.betas, eps=o.eps, fused=not scaled, foreach=True if scaled else None,
    )


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, o: OptimConfig,
                           total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule over ``total`` optimizer steps, stepped once per step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, o.warmup_steps, total,
                                                                                   o.min_lr_ratio))


def clip(params: Iterable[torch.Tensor], value: float, algorithm: str | None) -> None:
    """Clip gradients as Lightning's ``gradient_clip_val``/``gradient_clip_algorithm`` say (norm by default)."""
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(list(params), value)
    else:
        torch.nn.utils.clip_grad_norm_(list(params), value)
