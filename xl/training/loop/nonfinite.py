"""Non-finite training steps, in one place: which step is a fault (decided on the device, the same on every rank,
without a host sync), the counts kept on the device, and the error that stops a run after too many in a row.

The policy: a non-finite loss or gradient never reaches the weights (the optimizer skips the update: the fused
AdamW reads ``found_inf``; under 16-mixed the GradScaler skips it), the memory it wrote is cleaned (the Lightning
module zeroes its non-finite entries in place), the epoch metric leaves it out, a warning counts the skipped steps
once per logging interval, and ``max_nonfinite_steps`` faults in a row stop the run with :class:`NonFiniteError`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
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


class NonFiniteSteps(nn.Module):
    """The device-side counts of faulty steps (in a row, the worst run, the total, and whether a loss since the last
    optimizer step was not finite), read on the host once per logging interval. A module so that the counts move
    with the Lightning module to its device; its buffers are not saved in checkpoints."""

    def __init__(self, max_in_row: int) -> None:
        super().__init__()
        if max_in_row < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {max_in_row}")
        self.max_in_row = max_in_row
        self.in_row = 0  # read on the host
        self.total = 0
        for name in ("bad_in_row", "bad_worst", "bad_total"):
            self.register_buffer(name, torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("bad_loss", torch.zeros((), dtype=torch.bool), persistent=False)

    def loss(self, loss: Tensor) -> None:
        """Note a step's loss (no host sync)."""
        self.bad_loss = self.bad_loss | ~torch.isfinite(loss.detach())

    def before_optimizer_step(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                              scaler: GradScaler | None) -> None:
        """Skip an update whose loss or gradients are not finite (:func:`step_fault`) and count it, on the device."""
        grads = [p.grad for p in params if p.grad is not None]
        loss_bad, self.bad_loss = self.bad_loss, torch.zeros_like(self.bad_loss)
        bad = step_fault(grads, loss_bad, optimizer, scaler)
        if bad is None:
            return
        self.bad_in_row = (self.bad_in_row + 1) * bad
        self.bad_worst = torch.maximum(self.bad_worst, self.bad_in_row)
        self.bad_total = self.bad_total + bad

    def check(self, step: int) -> None:
        """Read the counts (once per logging interval): warn of newly skipped steps, or stop the run."""
        total, worst = int(self.bad_total), int(self.bad_worst)
        if total > self.total:
            rank_zero_warn(f"{total - self.total} step(s) with a non-finite loss or gradient were skipped "
                           f"(found by step {step})")
            self.total = total
        self.in_row = int(self.bad_in_row)
        if worst >= self.max_in_row:
            raise NonFiniteError(f"non-finite loss or gradient for {worst} steps in a row (found by step {step}); "
                                 "lower optim.lr or set trainer.gradient_clip_val")
