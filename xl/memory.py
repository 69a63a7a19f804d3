"""The bytes a memory holds (the formula for any configuration: xl.footprint)."""

from __future__ import annotations

import torch


def memory_bytes(mems: list[torch.Tensor]) -> int:
    """Bytes actually held by a memory (list of per-layer tensors)."""
    return sum(m.numel() * m.element_size() for m in mems)
