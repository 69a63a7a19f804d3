"""Non-finite training steps: which step is a fault (decided on the device, the same on every rank, without a host
sync), and the error that stops a run after too many in a row."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.amp import GradScaler


class NonFiniteError(RuntimeError):
    """Training produced non-finite losses or gradients too many steps in a row."""


def agree_across_ranks(flag: Tensor) -> Tensor:
    """``flag`` if any rank raised it: one all-reduce on the device, so the host does not wait."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(torch.uint8)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.bool()


def step_fault(grads: list[Tensor], loss_bad: Tensor, optimizer: torch.optim.Optimizer,
               scaler: GradScaler | None) -> Tensor | None:
    """1 if the optimizer step about to run is a fault, else 0 (a device tensor); None without gradients.

    Without a loss scaler, a step whose gradients are not finite is skipped: the fused AdamW kernel reads
    ``found_inf`` (the flag torch's GradScaler sets for it) and leaves weights, moments and step count untouched
    when it is set. Under 16-mixed the GradScaler skips overflowing steps itself and lowers its scale: a few in a row
    at the start are how it finds the scale, so only a non-finite loss (``loss_bad``), or an overflow at a scale
    already <= 1, counts as a fault there. Every rank decides the same: the flags are reduced across ranks (sharded
    strategies give each rank part of the gradients only), as collectives on the device.
    """
    if not grads:
        return None
    bad = agree_across_ranks(~torch.isfinite(torch.nn.utils.get_total_norm(grads)))
    if scaler is None:
        optimizer.found_inf = bad.float()
        return bad.long()
    scale = scaler.scale(torch.ones((), device=bad.device))  # the current scale, read on the device
    return (agree_across_ranks(loss_bad) | (bad & (scale <= 1))).long()
