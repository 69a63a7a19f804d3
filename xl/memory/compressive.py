"""The compressive memory (Rae et al., 2019): the Transformer-XL memory, and before it the compression of what left it.

Per layer, the states that leave the memory are compressed ``rate`` to 1 (:class:`xl.memory.compressor.Compressor`) into
a compressed memory of ``cmem_len`` slots, oldest dropped. A layer attends over ``compressed ∘ memory ∘ segment`` as
over one longer key sequence, distances counted in slots.

States leave in whole groups of ``rate`` (:func:`xl.model.eviction.leaving`): those beyond ``mem_len`` are grouped
oldest first, counted from the stream's start, and up to ``rate - 1`` of them wait in the memory, visible as ordinary
positions, until their group is complete. No group is ever padded, so the memory after any text is the same whatever
segments it was read in, and the one-token decoder keeps exactly the forward pass's memory. With segments and a
``mem_len`` that the rate divides, the memory holds exactly ``mem_len`` states after each segment.

State: per layer the compressed slots [B, C, d] (C ≤ cmem_len), then per layer the memory's states [B, S, d]
(S < mem_len + rate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from xl.memory.compressor import COMPRESSION_FNS, Compressor, reconstruction_loss
from xl.model.eviction import leaving
from xl.model.memory import Context, Memory, Segment, Size, Slots, Update
from xl.model.memory_settings import MemoryConfig
from xl.settings.bounds import at_least, one_of, setting

if TYPE_CHECKING:
    from xl.model.config import XLConfig


@dataclass
class CompressiveConfig(MemoryConfig):
    """``memory=compressive``: compressed slots before the memory."""

    cmem_len: int = setting(64, bound=at_least(1), help="compressed slots per layer, attended before the memory")
    cmem_rate: int = setting(2, bound=at_least(1),
                             help="evicted states per compressed slot; divides data.tgt_len and memory.mem_len")
    cmem_fn: str = setting("conv", bound=one_of(*COMPRESSION_FNS),
                           help="mean (pooling, no weights) or conv (learned, attention-reconstruction loss)")

    name = "compressive"
    loss_name = "recon_loss"  # the compressor's reconstruction loss (Rae et al., 2019), train/recon_loss
    evaluation_settings = ("cmem_len",)

    def memory(self, config: XLConfig) -> CompressiveMemory:
        return CompressiveMemory(config)

    def check_context(self, same_length: bool) -> None:
        if same_length:
            raise ValueError("same_length would hide the compressed memory (its window is mem_len keys wide); set "
                             "memory.same_length=false and memory.eval_same_length=false with memory=compressive")

    def check_window(self, grad_segments: int, mem_len: int) -> None:
        if grad_segments > 1:
            raise ValueError("the compressed memory is always detached, so gradients cannot cross segments "
                             "through it; set memory.grad_segments=1 with memory=compressive")

    def held(self, mem_len: int, grad_segments: int, n_layer: int) -> list[int]:
        """The slots before the memory: each summarises ``cmem_rate`` positions."""
        return [mem_len + self.cmem_len * self.cmem_rate] * n_layer

    def check_lengths(self, lengths: dict[str, int]) -> None:
        """Once the memory is full each segment evicts its length in states, and the memory's own length decides
        where the groups fall: a rate that divides both compresses whole groups."""
        for key, length in lengths.items():
            if length % self.cmem_rate:
                what = "each segment evicts that many states" if key.startswith("data.") else \
                    "the memory holds that many states"
                raise ValueError(f"memory.cmem_rate={self.cmem_rate} must divide {key}={length} ({what}, compressed "
                                 "in groups of cmem_rate); change either")


class CompressiveMemory(Memory):
    """Compressed slots before the Transformer-XL memory; the learned compressor's reconstruction loss as its own."""

    def __init__(self, config: XLConfig) -> None:
        super().__init__(config)
        self.settings: CompressiveConfig = config.memory
        self.rate, self.slot_len = self.settings.cmem_rate, self.settings.cmem_len
        self.compressor: Compressor | None = None

    def build(self) -> dict[str, nn.Module]:
        cfg = self.config
        self.compressor = Compressor(cfg.n_layer, cfg.d_model, self.rate, self.settings.cmem_fn)
        return {"compressor": self.compressor}

    def init(self, batch: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        d = self.config.d_model
        return [torch.zeros(batch, 0, d, dtype=dtype, device=device) for _ in range(2 * self.config.n_layer)]

    def adopt(self, state: list[Tensor], batch: int, mem_len: int) -> list[Tensor]:
        n_layer, cmem_len = self.config.n_layer, self.slot_len
        state = super().adopt(state, batch, mem_len)
        slots, states = state[0].size(1), state[n_layer].size(1)
        if any(m.size(1) != slots for m in state[:n_layer]):
            raise ValueError(f"the memory's layers hold {[m.size(1) for m in state[:n_layer]]} compressed slots; "
                             f"every layer holds as many; reset the memory with init_mems({batch})")
        if slots > cmem_len or states >= mem_len + self.rate and slots:
            raise ValueError(f"a memory of {slots} compressed slots and {states} states does not fit mem_len + "
                             f"cmem_len = {mem_len} + {cmem_len}; reset the memory after changing either")
        return state

    def context(self, state: list[Tensor]) -> Context:
        n = self.config.n_layer
        slots = state[0].size(1)
        return Context([[c, m] for c, m in zip(state[:n], state[n:], strict=True)], slots + state[n].size(1),
                       ((slots, self.rate),))

    def size(self, mem_len: int, seg_len: int | None = None) -> Size:
        """Slots and states of every layer once both are full: states leave in whole groups, so after segments whose
        length the rate divides the memory holds ``mem_len`` rounded up to a multiple of the rate (a segment of
        another length may leave up to ``rate - 1`` more waiting)."""
        rate = self.rate
        waiting = -mem_len % rate if seg_len is None or seg_len % rate == 0 else rate - 1
        per_layer = self.slot_len + mem_len + waiting
        return Size(vectors=self.config.n_layer * per_layer, keys=per_layer)

    def update(self, state: list[Tensor], segment: Segment) -> Update:
        n, dtype, layer_inputs = self.config.n_layer, segment.dtype, segment.layer_inputs
        old_slots, old_states = state[:n], state[n:]
        C, S, L = old_slots[0].size(1), old_states[0].size(1), layer_inputs[0].size(1)
        gone = leaving(S + L, segment.mem_len, self.rate)
        with torch.no_grad():
            evicted = [torch.cat([m[:, :gone].to(h.dtype), h[:, :max(0, gone - S)]], 1)
                       for m, h in zip(old_states, layer_inputs, strict=True)]
            states = [torch.cat([m[:, gone:].to(dtype), h[:, max(0, gone - S):].to(dtype)], 1)
                      for m, h in zip(old_states, layer_inputs, strict=True)]
        compressor = self.compressor
        with torch.set_grad_enabled(torch.is_grad_enabled() and compressor.learned):
            made = [compressor(i, e) for i, e in enumerate(evicted)]
        loss = None
        if made[0].requires_grad and gone:
            loss = reconstruction_loss(segment.layers, layer_inputs, evicted, made)
        new = min(gone // self.rate, self.slot_len)  # new slots kept
        kept = min(C, self.slot_len - new)  # old slots kept
        with torch.no_grad():
            slots = [torch.cat([c[:, C - kept:].to(dtype), s[:, s.size(1) - new:].to(dtype)], 1)
                     for c, s in zip(old_slots, made, strict=True)]
        kept_kv = None
        if segment.keep_kv:  # kept slots' and states' keys sliced from the layer's, the new slots' projected
            kept_kv = []
            for layer, ((k, v), s) in enumerate(zip(segment.kv, slots, strict=True)):
                k_new, v_new = segment.layers.project(layer, s[:, s.size(1) - new:])
                kept_kv.append((torch.cat([k[:, :, C - kept:C], k_new, k[:, :, C + gone:]], dim=2),
                                torch.cat([v[:, :, C - kept:C], v_new, v[:, :, C + gone:]], dim=2)))
        return Update(slots + states, kept_kv, loss)

    def slots(self) -> Slots:
        compressor = self.compressor
        with torch.no_grad():
            matrices = [compressor.matrix(n) if compressor.learned else None for n in range(self.config.n_layer)]

        @torch.no_grad()
        def make(layer: int, groups: Tensor) -> Tensor:
            B, G, rate, d = groups.shape
            return compressor(layer, groups.reshape(B, G * rate, d), matrices[layer])

        return Slots(self.rate, self.slot_len, make)
