"""The recurrent memory's whole life: the update rule, the per-stage store, and checkpoint packing.

Transformer-XL (Dai et al., 2019) caches, for every layer n, the last ``mem_len`` inputs of that layer (layer
n-1's outputs; the embeddings for n = 1). Segment t+1 attends over ``StopGrad(memory) ∘ current``: the cache is
read-only context, so no gradient ever reaches it.

- :func:`update_memory` is the rule: keep the newest ``mem_len`` positions of ``old ∘ current``, detached.
- :func:`update_memory_attached` keeps the same positions but leaves them in the graph, so that a later
  segment's loss back-propagates into the segments that wrote them (truncated BPTT over several segments, as
  the Recurrent Memory Transformer trains its memory: Bulatov et al., 2022; ``memory.grad_segments``).
- :func:`update_compressive_memory` is the rule of the compressive memory (Rae et al., 2019): the states that
  leave the memory (:func:`evicted_states`) are compressed and appended to a second, compressed memory of
  ``cmem_len`` slots, oldest dropped. A layer's memory tensor then holds ``compressed ∘ memory``, and
  :func:`split_memory` tells the two apart from its length alone: the compressed part only grows once the memory
  is full, so a memory longer than ``mem_len`` is ``mem_len`` states after ``length - mem_len`` compressed slots.
  Everything that handles one tensor per layer (the store, checkpoints, cached keys/values) thus serves both.
- :class:`MemoryStore` holds one memory per stage (train/val/test/predict), so that validation never touches the
  training memory. It checks rows, follows the model to whatever device and dtype it is moved to, and releases
  an evaluation stage's memory (and its cached keys/values) as soon as that evaluation ends.
- :meth:`MemoryStore.pack` / :meth:`MemoryStore.unpack` move the training memory of every rank in and out of a
  checkpoint (only rank 0 writes the file, so the ranks' rows are gathered first).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

STAGES = ("train", "val", "test", "predict")
KV = list[tuple[Tensor, Tensor]]


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


def split_memory(mem: Tensor, mem_len: int, cmem_len: int) -> tuple[Tensor, Tensor]:
    """``(compressed, memory)`` views of one layer's ``compressed ∘ memory`` tensor [B, C+M, d]."""
    compressed = max(0, mem.size(1) - mem_len)
    if compressed > cmem_len:
        raise ValueError(f"a memory of {mem.size(1)} positions is longer than mem_len + cmem_len = "
                         f"{mem_len} + {cmem_len}; reset the memory after changing either")
    return mem[:, :compressed], mem[:, compressed:]


def evicted_states(mem: Tensor, h: Tensor, mem_len: int, cmem_len: int) -> Tensor:
    """The states of ``memory ∘ h`` (oldest first, detached) that the new memory of ``mem_len`` does not keep."""
    memory = split_memory(mem, mem_len, cmem_len)[1]
    leaving = memory.size(1) + h.size(1) - mem_len
    if leaving <= 0:
        return h.new_zeros(h.size(0), 0, h.size(2)).detach()
    from_m = min(leaving, memory.size(1))
    return torch.cat([memory[:, :from_m].to(h.dtype), h[:, :leaving - from_m]], dim=1).detach()


def update_compressive_memory(
    mems: list[Tensor], layer_inputs: list[Tensor], compressed: list[Tensor], mem_len: int, cmem_len: int,
    dtype: torch.dtype | None = None,
) -> list[Tensor]:
    """New ``compressed ∘ memory`` per layer: the memory by :func:`update_memory`, the compressed memory the
    newest ``cmem_len`` slots of ``old compressed ∘ compressed`` (``compressed``: the evicted states' compression),
    cut from the graph."""
    new = []
    with torch.no_grad():
        for m, h, c in zip(mems, layer_inputs, compressed, strict=True):
            old_c, old_m = split_memory(m, mem_len, cmem_len)
            dtype_ = dtype or m.dtype
            slots = torch.cat([old_c.to(dtype_), c.to(dtype_)], dim=1)
            memory = update_memory([old_m], [h], mem_len, dtype_)[0]
            new.append(torch.cat([slots[:, max(0, slots.size(1) - cmem_len):], memory], dim=1).detach())
    return new


def nbytes(tensors: list[Tensor] | KV | None) -> int:
    """Bytes held by a memory (per-layer tensors) or by its cached (keys, values) pairs."""
    if not tensors:
        return 0
    flat = [t for item in tensors for t in (item if isinstance(item, tuple) else (item,))]
    return sum(t.numel() * t.element_size() for t in flat)


class MemoryStore:
    """One memory per stage, each with the keys/values an evaluation projected from it.

    Tensors stay where they were put (a checkpoint restores them on the CPU, before Lightning moves the module);
    :meth:`read` moves them to the model's device and storage dtype the first time a stage reads them there.
    """

    def __init__(self) -> None:
        self.mems: dict[str, list[Tensor] | None] = dict.fromkeys(STAGES)
        self.kv: dict[str, KV | None] = dict.fromkeys(STAGES)

    def reset(self, stage: str) -> None:
        """Forget a stage's memory: its streams restart, or its evaluation ended (frees the memory at once)."""
        self.mems[stage] = self.kv[stage] = None

    def read(
        self, stage: str, rows: int, device: torch.device, dtype: torch.dtype, warn: Callable[[str], None]
    ) -> tuple[list[Tensor] | None, KV | None]:
        """The stage's memory and cached keys/values for a batch of ``rows`` on ``device``; None when empty.

        A memory with other rows than the batch belongs to other streams: it is dropped (with ``warn``), not
        broadcast. One on another device or in another storage dtype is moved there once and kept there.
        """
        mems = self.mems[stage]
        if mems is None:
            return None, None
        if mems[0].size(0) != rows:
            warn(f"{stage} memory holds {mems[0].size(0)} rows but the batch has {rows}; "
                 "the streams changed, so the memory restarts empty")
            self.reset(stage)
            return None, None
        if mems[0].device != device or mems[0].dtype != dtype:
            self.mems[stage] = mems = [m.to(device, dtype) for m in mems]
            self.kv[stage] = None  # projected in the old dtype/device: projected again from the moved memory
        return mems, self.kv[stage]

    def write(self, stage: str, mems: list[Tensor], kv: KV | None = None) -> None:
        self.mems[stage], self.kv[stage] = mems, kv

    def nbytes(self, stage: str) -> int:
        """Bytes a stage holds: its memory and its cached keys/values."""
        return nbytes(self.mems[stage]) + nbytes(self.kv[stage])

    def pack(self, all_gather: Callable[[Tensor], Tensor], world_size: int) -> Tensor | None:
        """The training memory of every rank as one CPU tensor [world, n_layer, B, M, d] (every rank calls this)."""
        mems = self.mems["train"]
        if mems is None:
            return None
        stacked = torch.stack([m.detach() for m in mems])  # [n_layer, B, M, d]; a window's graph is not saved
        gathered = all_gather(stacked) if world_size > 1 else stacked[None]
        return gathered.cpu()

    def unpack(self, packed: Tensor | None, rank: int) -> None:
        """Give this rank back its own rows of a packed training memory (left on the CPU until read)."""
        self.write("train", None if packed is None else list(packed[rank].unbind(0)))
