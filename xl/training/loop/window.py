"""Gradients through windows of ``memory.grad_segments`` segments (truncated BPTT over k segments), in one place.

With k > 1 the memory the first k-1 segments of a window write stays in the graph; the window's last segment writes
it detached; the k losses are back-propagated together when the window closes, and the optimizer steps once per
window (per ``accumulate_grad_batches`` windows): for the fit the trainer's accumulation is multiplied by k, so
global steps, the LR schedule, clipping, DDP's gradient sync and the non-finite skip all act once per optimizer step,
as they do for accumulated batches. Windows restart at every epoch (with the streams); an epoch's last window may be
shorter. The Lightning module calls :class:`GradientWindow` from its hooks (``training_step``, ``backward``,
``setup``, ``teardown``, ``on_train_start``, ``on_train_end``), so Lightning's own accumulation, clipping,
precision plugins and checkpointed loop state serve the windows unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor


class GradientWindow:
    """The open window of ``k`` segments: its losses, whether the current segment closes it, and the trainer
    accumulation it set for the fit."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.losses: list[Tensor] = []  # of the open window, back-propagated when it closes
        self.closes = True  # the current segment is the last of its window
        self.accumulation: tuple[L.Trainer, int, int] | None = None  # (trainer, its own setting, the one set)

    def open_segment(self, batch_idx: int, trainer: L.Trainer) -> bool:
        """Before a training segment: whether it is the last of its window (the k-th, or the last before an
        optimizer step, such as the end of an epoch); the forward keeps its memory in the graph unless it is. A fit
        resumed inside a window finishes that window without the segments before the checkpoint (their graph is not
        saved), as accumulated gradients are not; the forward is exact."""
        if self.k == 1:
            return True
        position = batch_idx % self.k
        if position and not self.losses:
            rank_zero_warn(f"resumed inside a window of memory.grad_segments={self.k} segments: its first "
                           f"{position} segment(s), before the checkpoint, add nothing to its gradient")
        steps = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or batch_idx + 1 >= trainer.num_training_batches
        self.closes = position == self.k - 1 or steps
        return self.closes

    def backward(self, loss: Tensor, backward: Callable[[Tensor], None]) -> None:
        """Keep the segment's loss; when the window closes, back-propagate the sum of its losses (the segments'
        graphs are joined by the attached memory, so one backward pass serves them all)."""
        if self.k == 1:
            backward(loss)
            return
        self.losses.append(loss)
        if self.closes:
            window, self.losses = self.losses, []
            backward(torch.stack(window).sum())

    def start_fit(self, trainer: L.Trainer) -> None:
        """The trainer accumulates k times its own setting for this fit: one optimizer step per window."""
        self.losses = []
        if self.k == 1:
            return
        if trainer.strategy.handles_gradient_accumulation or any(
                isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            raise ValueError("memory.grad_segments > 1 sets the trainer's gradient accumulation itself; it cannot be "
                             "combined with a strategy or callback that changes it")
        own = trainer.accumulate_grad_batches
        earlier = self.accumulation
        if earlier is not None and earlier[0] is trainer and own == earlier[2]:
            own = earlier[1]  # an earlier fit of this trainer ended without its teardown
        trainer.accumulate_grad_batches = own * self.k
        self.accumulation = (trainer, own, trainer.accumulate_grad_batches)

    def end_fit(self) -> None:
        """Give the trainer its own accumulation back."""
        if self.accumulation is not None:
            trainer, own, _ = self.accumulation
            trainer.accumulate_grad_batches = own
            self.accumulation = None

    def drop(self) -> bool:
        """A fit stopped inside a window (a signal): forget its losses; True if the memory must be cut from the
        graph."""
        self.losses = []
        return self.k > 1
