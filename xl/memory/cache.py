"""The Transformer-XL memory (Dai et al., 2019): per layer, a cache of that layer's inputs at the last positions.

For every layer n the cache holds the last ``mem_len`` inputs of that layer (layer n-1's outputs; the embeddings for
n = 1). Segment t+1 attends over ``StopGrad(memory) ∘ current``: the cache is read-only context, so no gradient ever
reaches it. State: one tensor [B, M, d] per layer, M ≤ mem_len.

- :func:`update_memory` is the rule: keep the newest ``mem_len`` positions of ``old ∘ current``, detached.
- :func:`update_memory_attached` keeps the same positions but leaves them in the graph, so that a later segment's
  loss back-propagates into the segments that wrote them (truncated BPTT over several segments, as the Recurrent
  Memory Transformer trains its memory: Bulatov et al., 2022; ``memory.grad_segments``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from xl.model.eviction import leaving
from xl.model.memory import Context, Memory, Segment, Size, Update
from xl.model.memory_settings import MemoryConfig

if TYPE_CHECKING:
    from xl.model.config import XLConfig


def update_memory(
    mems: list[Tensor], layer_inputs: list[Tensor], mem_len: int, dtype: torch.dtype | None = None
) -> list[Tensor]:
    """New memory = last ``mem_len`` positions of ``old ∘ current`` per layer, cut from the graph.

    ``dtype``: the storage dtype (default: that of the old memory).
    """
    with torch.no_grad():
        # Fresh tensors: callers may clean them in place.
        return [m.detach() for m in update_memory_attached(mems, layer_inputs, mem_len, dtype)]


def update_memory_attached(
    mems: list[Tensor], layer_inputs: list[Tensor], mem_len: int, dtype: torch.dtype | None = None
) -> list[Tensor]:
    """The positions :func:`update_memory` keeps, still in the graph: gradients flow back through them into the
    segments that computed them (and, through ``mems``, into earlier ones that were also kept attached)."""
    new = []
    for m, h in zip(mems, layer_inputs, strict=True):
        # Copy only what is kept: the newest positions of h, then as many of m's as still fit.
        from_h = min(mem_len, h.size(1))
        from_m = min(mem_len - from_h, m.size(1))
        dtype_ = dtype or m.dtype
        new.append(torch.cat([m[:, m.size(1) - from_m:].to(dtype_), h[:, h.size(1) - from_h:].to(dtype_)], dim=1))
    return new


@dataclass
class CacheConfig(MemoryConfig):
    """``memory=default`` (and ``short``, ``long``, ``none``): the cache has no settings beyond the shared context."""

    name = "cache"

    def memory(self, config: XLConfig) -> CacheMemory:
        return CacheMemory(config)


class CacheMemory(Memory):
    """The plain Transformer-XL memory: the cached layer inputs of the last ``mem_len`` positions."""

    def init(self, batch: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        d = self.config.d_model
        return [torch.zeros(batch, 0, d, dtype=dtype, device=device) for _ in range(self.config.n_layer)]

    def context(self, state: list[Tensor]) -> Context:
        return Context([[m] for m in state], state[0].size(1))

    def size(self, mem_len: int, seg_len: int | None = None) -> Size:
        return Size(vectors=self.config.n_layer * mem_len, keys=mem_len)

    def update(self, state: list[Tensor], segment: Segment) -> Update:
        rule = update_memory_attached if segment.attached else update_memory
        new = rule(state, segment.layer_inputs, segment.mem_len, segment.dtype)
        if not segment.keep_kv:
            return Update(new)
        gone = leaving(state[0].size(1) + segment.layer_inputs[0].size(1), segment.mem_len)  # the keys kept: the last
        return Update(new, [(k[:, :, gone:], v[:, :, gone:]) for k, v in segment.kv])
