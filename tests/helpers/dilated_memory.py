"""A memory variant written from scratch against :class:`xl.model.memory.Memory`, outside the package, as a user would
add one: a dilated memory. Before the window of the last ``mem_len`` states, each layer keeps every ``stride``-th
older state (of each group of ``stride`` states that leaves the window, the newest), up to ``far_len`` of them: the
distant past at a coarser grain, with no weights, as dilated attention over a history does. It subclasses no
variant of the package, and its config file lives on Hydra's search path (``tests/helpers/conf/memory/dilated.yaml``):

    python train.py hydra.searchpath=[file://tests/helpers/conf] memory=dilated

Its kept states are slots of ``stride`` positions each to the model (``Context.slots``/``rate``): they sit before the
window, and a document boundary hides one unless all its group is in the query's document. The package's default
decoder serves it through :meth:`DilatedMemory.slots`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xl.model.eviction import leaving
from xl.model.memory import Context, Memory, Segment, Size, Slots, Update
from xl.model.memory_settings import MemoryConfig
from xl.settings.bounds import at_least, setting


@dataclass
class DilatedConfig(MemoryConfig):
    far_len: int = setting(8, bound=at_least(1), help="states kept per layer before the window, one of each group")
    stride: int = setting(2, bound=at_least(1), help="states per group leaving the window, of which the newest is "
                                                     "kept; divides data.tgt_len and memory.mem_len")

    name = "dilated"
    evaluation_settings = ("far_len",)

    def memory(self, config) -> DilatedMemory:
        return DilatedMemory(config)

    def check_context(self, same_length: bool) -> None:
        if same_length:
            raise ValueError("same_length would hide the dilated states; set memory.same_length=false and "
                             "memory.eval_same_length=false with memory=dilated")

    def check_window(self, grad_segments: int, mem_len: int) -> None:
        if grad_segments > 1:
            raise ValueError("the dilated memory is detached; set memory.grad_segments=1 with memory=dilated")

    def held(self, mem_len: int, grad_segments: int, n_layer: int) -> list[int]:
        # the oldest group kept: far_len groups before the window, of which its newest state
        return [mem_len + (self.far_len - 1) * self.stride + 1] * n_layer

    def check_lengths(self, lengths: dict[str, int]) -> None:
        for key, length in lengths.items():
            if length % self.stride:
                raise ValueError(f"memory.stride={self.stride} must divide {key}={length}; change either")


class DilatedMemory(Memory):
    """State: each layer's kept states [B, ≤ far_len, d], then each layer's window [B, ≤ mem_len, d]."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.stride, self.far_len = self.settings.stride, self.settings.far_len

    def init(self, batch: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        return [torch.zeros(batch, 0, self.config.d_model, device=device, dtype=dtype)
                for _ in range(2 * self.config.n_layer)]

    def context(self, state: list[Tensor]) -> Context:
        n = self.config.n_layer
        far = state[0].size(1)
        return Context([[f, m] for f, m in zip(state[:n], state[n:], strict=True)], far + state[n].size(1),
                       ((far, self.stride),))

    def size(self, mem_len: int, seg_len: int | None = None) -> Size:
        per_layer = self.far_len + mem_len + (self.stride - 1 if seg_len is not None and seg_len % self.stride else 0)
        return Size(vectors=self.config.n_layer * per_layer, keys=per_layer)

    def update(self, state: list[Tensor], segment: Segment) -> Update:
        n, dtype = self.config.n_layer, segment.dtype
        held, L = state[n].size(1), segment.layer_inputs[0].size(1)
        gone = leaving(held + L, segment.mem_len, self.stride)  # whole groups of stride states leave
        far, near = [], []
        with torch.no_grad():
            for f, m, h in zip(state[:n], state[n:], segment.layer_inputs, strict=True):
                leaving_states = torch.cat([m[:, :gone].to(dtype), h[:, :max(0, gone - held)].to(dtype)], 1)
                kept = leaving_states[:, self.stride - 1::self.stride]  # the newest of each group
                far.append(torch.cat([f, kept], 1)[:, -self.far_len:])
                near.append(torch.cat([m[:, gone:].to(dtype), h[:, max(0, gone - held):].to(dtype)], 1))
        return Update(far + near)  # kv None: the model projects the new state's keys/values where it needs them

    def slots(self) -> Slots:
        return Slots(self.stride, self.far_len, lambda layer, groups: groups[:, :, -1])
