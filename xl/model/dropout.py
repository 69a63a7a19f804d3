"""Dropout whose mask costs less to draw on CPU.

On CPU (torch 2.13) the random draw, not the multiply, is what dropout costs: ``bernoulli_`` and
``uniform_`` run serially on one thread and spend about 4 ns per element converting each draw, so at
config S the masks took 9% of a training step. Two cheaper exact ways are used instead:

- small p (the usual 0.1): the gaps between dropped elements of a Bernoulli(p) sequence are independent
  and geometric, so drawing the gaps takes about n·p random numbers instead of n;
- larger p: raw 64-bit integers, split into one 32-bit field per element, compared against a threshold
  (half the generator work of ``uniform_`` and no per-element conversion in the serial loop).

Other devices draw ``torch.rand`` (their generators run in parallel).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

# Below this p, drawing the gaps beats drawing every element: at config S's sizes on a 2-core AVX2 CPU the gap
# draw costs ~1.5 ms + p × 15 ms per million elements, the integer draw ~5 ms.
SPARSE_BELOW = 0.25


def dropped_positions(n: int, p: float, chunk: int | None = None) -> Tensor:
    """Sorted indices, among ``n``, of the elements a Bernoulli(p) draw drops (CPU, int64).

    The gap from one drop to the next is Geometric(p) on {1, 2, …}, drawn by inversion from a float64
    uniform u: ``floor(log(1 - u) / log(1 - p)) + 1``. Gaps are drawn ``chunk`` at a time until they pass n
    (by default enough to pass it but once in a billion draws).
    """
    log_keep = math.log1p(-p)
    count = chunk or int(n * p + 6 * math.sqrt(n * p * (1 - p)) + 16)
    chunks, last = [], -1.0
    while last < n:
        gaps = torch.rand(count, dtype=torch.float64).neg_().log1p_().div_(log_keep).floor_().add_(1)
        positions = gaps.cumsum_(0).add_(last)
        chunks.append(positions)
        last = positions[-1].item()
    positions = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return positions[: torch.searchsorted(positions, float(n))].long()


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, dtype: torch.dtype, device: torch.device,
              kept: float | None = None) -> Tensor:
    """A tensor of 0 and ``kept`` (default 1/(1-p)): each element independently kept (non-zero) with
    probability 1 - p.

    Dense CPU path: a signed 32-bit field b is kept when ``float(b) >= p·2³² - 2³¹``; rounding b to float32
    moves the threshold by at most 2⁷, so the keep probability is 1 - p within 2⁻²⁵ (``torch.rand``
    resolves p to 2⁻²⁴).
    """
    kept = 1.0 / (1.0 - p) if kept is None else kept
    if device.type != "cpu":
        return torch.rand(shape, device=device).ge_(p).mul_(kept).to(dtype)
    n = math.prod(shape)
    if p < SPARSE_BELOW:
        mask = torch.full(shape, kept, device=device)
        return mask.view(-1).index_fill_(0, dropped_positions(n, p), 0.0).view(shape).to(dtype)
    raw = torch.empty((n + 1) // 2, dtype=torch.int64, device=device).random_(-(2**63), None)
    draws = raw.view(torch.int32)[:n].view(shape).to(torch.float32)
    return draws.ge_(p * 2.0**32 - 2.0**31).mul_(kept).to(dtype)


class ReLUDropout(torch.autograd.Function):
    """``relu(u)`` with each element then kept with probability 1 - p and *not* rescaled (fold 1/(1-p) into
    the product that makes u), in place on u.

    Against ReLU then :class:`Dropout`: no ReLU output, no mask and no product tensor; on CPU below
    ``SPARSE_BELOW`` the dropped positions are zeroed directly. The backward needs only the output: the
    gradient passes where it is positive, that is where u was positive and the element kept (ReLU's own
    backward, which also passes nothing at u = 0).
    """

    @staticmethod
    def forward(ctx, u: Tensor, p: float) -> Tensor:
        ctx.mark_dirty(u)
        out = u.relu_()
        if out.device.type == "cpu" and p < SPARSE_BELOW and out.is_contiguous():
            out.view(-1).index_fill_(0, dropped_positions(out.numel(), p), 0.0)
        else:
            out.mul_(keep_mask(out.shape, p, out.dtype, out.device, kept=1.0))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, out, 0), None


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same distribution: keep with probability 1 - p, scale by 1/(1-p)) with the mask of
    :func:`keep_mask`. The mask is computed in float32, so low-precision inputs keep the exact p."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        return x * keep_mask(x.shape, self.p, x.dtype, x.device)
