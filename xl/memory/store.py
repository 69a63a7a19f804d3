"""Where a run keeps its memories: one per stage, moved with the model, freed after evaluation, packed into checkpoints.

- :class:`MemoryStore` holds one memory state per stage (train/val/test/predict), so that validation never touches the
  training memory. It checks rows, follows the model to whatever device and dtype it is moved to, and releases an
  evaluation stage's memory (and its cached keys/values) as soon as that evaluation ends.
- :meth:`MemoryStore.pack` / :meth:`MemoryStore.unpack` move the training memory of every rank in and out of a
  checkpoint (only rank 0 writes the file, so the ranks' rows are gathered first).

A state is a list of tensors with the batch rows first whatever the memory variant (:mod:`xl.model.memory`): cached
states [B, ·, d], or tensors of any other shape and dtype (a retrieval store's keys [B, H, N, D], its int64 counts
[B]); the store serves all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from xl.model.memory import KV

STAGES = ("train", "val", "test", "predict")
def nbytes(tensors: list[Tensor] | KV | None) -> int:
    """Bytes held by a memory (per-layer tensors) or by its cached (keys, values) pairs."""
    if not tensors:
        return 0
    flat = [t for item in tensors for t in (item if isinstance(item, tuple) else (item,))]
    return sum(t.numel() * t.element_size() for t in flat)


def packed_size(packed: Tensor | list[Tensor]) -> tuple[int, int]:
    """Processes (ranks) and batch rows per rank of a memory packed by :meth:`MemoryStore.pack`."""
    return (packed.size(0), packed.size(2)) if isinstance(packed, Tensor) else tuple(packed[0].shape[:2])


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
            # Floating state to the storage dtype; integer bookkeeping (a store's counts) keeps its own.
            self.mems[stage] = mems = [m.to(device, dtype) if m.is_floating_point() else m.to(device) for m in mems]
            self.kv[stage] = None  # projected in the old dtype/device: projected again from the moved memory
        return mems, self.kv[stage]

    def write(self, stage: str, mems: list[Tensor], kv: KV | None = None) -> None:
        self.mems[stage], self.kv[stage] = mems, kv

    def nbytes(self, stage: str) -> int:
        """Bytes a stage holds: its memory and its cached keys/values."""
        return nbytes(self.mems[stage]) + nbytes(self.kv[stage])

    def pack(self, all_gather: Callable[[Tensor], Tensor], world_size: int) -> Tensor | list[Tensor] | None:
        """The training memory of every rank, on the CPU (every rank calls this): one tensor [world, n, B, M, d] when
        the state's n tensors have one shape and dtype, else one tensor [world, B, ...] per state tensor."""
        mems = self.mems["train"]
        if mems is None:
            return None
        mems = [m.detach() for m in mems]  # a window's graph is not saved
        if all(m.shape == mems[0].shape and m.dtype == mems[0].dtype for m in mems):
            stacked = torch.stack(mems)
            return (all_gather(stacked) if world_size > 1 else stacked[None]).cpu()
        return [(all_gather(m) if world_size > 1 else m[None]).cpu() for m in mems]

    def unpack(self, packed: Tensor | list[Tensor] | None, rank: int) -> None:
        """Give this rank back its own rows of a packed training memory (left on the CPU until read)."""
        if packed is None:
            self.write("train", None)
        elif isinstance(packed, Tensor):
            self.write("train", list(packed[rank].unbind(0)))
        else:
            self.write("train", [t[rank] for t in packed])
