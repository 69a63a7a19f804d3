"""Non-finite training steps: the error that stops a run, and the flag every rank agrees on without a host sync."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class NonFiniteError(RuntimeError):
    """Training produced non-finite losses or gradients too many steps in a row."""


def agree_across_ranks(flag: Tensor) -> Tensor:
    """``flag`` if any rank raised it: one all-reduce on the device, so the host does not wait."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(torch.uint8)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.bool()
