"""What every memory variant provides: the interface that the model's forward pass and the decoder call.

A memory variant answers, for one segment, "what does layer n attend over before the segment?" (:meth:`Memory.context`)
and "what is kept after it?" (:meth:`Memory.update`). Its state is a list of tensors with the batch rows first
(``[B, ·, d_model]`` for the cached states; any shape and dtype otherwise, such as a store's keys and an int64
count per row), whose layout the variant defines; everything generic (the per-stage store, checkpoints, moving to a
device, counting bytes, cleaning non-finite entries) treats it as such a list.

A memory may also extend the attention of chosen layers (``Context.extend``): after a layer's local attention over
memory ∘ segment has produced the heads' outputs, the memory's function replaces them, given the same queries
(:mod:`xl.model.attention`); the model calls it where it is set, whatever the variant.

A layer attends over its memory pieces (``Context.pieces[n]``, oldest first) as over one key sequence placed just
before the segment, with relative distances counted in keys. Keys carry no position, so in evaluation the pieces'
keys and values are carried from one segment to the next instead of being projected again (``kv``).

Variants that add positions of their own to the segment (memory tokens that a segment reads at its start and writes
at its end) say so in :meth:`Memory.segment_inputs`, and take the outputs back out in :meth:`Memory.segment_outputs`.

The rule by which states leave a memory, :func:`xl.memory.eviction.leaving`, is shared by
the forward pass and the one-token decoder (:mod:`xl.model.decoding`), so that both keep the same memory whatever the
segment lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from xl.model.documents import Documents, document_mask, needs_mask

if TYPE_CHECKING:
    from collections.abc import Callable

    from xl.memory.settings import MemoryConfig
    from xl.model.config import XLConfig
    from xl.model.transformer import TransformerXL

KV = list[tuple[Tensor, Tensor]]


@dataclass
class Context:
    """What each layer of one segment attends over before the segment.

    ``pieces[n]``: layer n's memory tensors [B, ·, d], oldest first, attended as one sequence of ``length`` keys;
    the first ``slots`` of them are compressed slots, each summarising ``rate`` positions (what a document boundary
    hides is counted from that: :func:`xl.model.documents.key_offsets`).
    """

    pieces: list[list[Tensor]]
    length: int
    slots: int = 0
    rate: int = 1
    #: Per layer, None or the memory's extension of that layer's attention: a function ``(queries, local,
    #: documents) -> heads`` of the content queries before Transformer-XL's biases and the local attention's heads
    #: (all [B, H, L, D]) and the segment's :class:`~xl.model.documents.Documents` (None: one text per row, or a
    #: decoder that resets the memory's rows itself). None: no layer is extended.
    extend: list[Callable[[Tensor, Tensor, Documents | None], Tensor] | None] | None = None

    @property
    def reach(self) -> int:
        """How many positions before the segment the keys cover (a slot counts its rate)."""
        return self.length + self.slots * (self.rate - 1)


@dataclass
class Update:
    """A memory's answer after a segment: its new state, the new state's keys/values per layer when asked for (None:
    the forward projects them from the state), and the variant's own training loss (None if it has none)."""

    state: list[Tensor]
    kv: KV | None = None
    loss: Tensor | None = None


class Memory:
    """One memory variant. Subclasses define the state's layout and the update rule; the defaults serve memories that
    attend over their state as it is and add no positions to the segment."""

    #: Decoder geometry (:mod:`xl.model.decoding`): states that leave the window make ``rate`` to 1 slots, of which
    #: the newest ``slot_len`` are kept before the window (0: states that leave are dropped).
    rate = 1
    slot_len = 0

    def __init__(self, config: XLConfig) -> None:
        self.config = config
        self.settings: MemoryConfig = config.memory  # the variant's own settings, and its rules (check_context, ...)

    @property
    def name(self) -> str:
        return self.settings.name

    # ---- parameters and checks -----------------------------------------------------------------------------------
    def build(self) -> dict[str, nn.Module]:
        """Modules with the variant's own weights, registered on the model under these names after all its other
        modules (so that a seed gives the same main weights with any memory). Called once, by the model."""
        return {}

    # ---- state -----------------------------------------------------------------------------------------------------
    def init(self, batch: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        """The empty state of ``batch`` rows (learned initial values where the variant has them)."""
        raise NotImplementedError

    def adopt(self, state: list[Tensor], batch: int, mem_len: int) -> list[Tensor]:
        """The state checked against a batch of ``batch`` rows (a state of another layout that the variant can read,
        such as one from an older checkpoint, is converted); raises ValueError with what to do otherwise."""
        d = self.config.d_model
        for t in state:
            if t.dim() != 3 or t.size(0) != batch or t.size(2) != d:
                raise ValueError(f"memory of shape {tuple(t.shape)} does not fit a batch of {batch} rows "
                                 f"(expected [{batch}, positions, {d}]); reset the memory with init_mems({batch})")
        return state

    def context(self, state: list[Tensor]) -> Context:
        raise NotImplementedError

    def vectors(self, mem_len: int, seg_len: int | None = None) -> int:
        """Vectors of d_model values the state holds per row, all layers together, once full (the footprint), for
        segments of ``seg_len`` (None: segments whose length the memory's rate divides)."""
        raise NotImplementedError

    def segment_positions(self, seg_len: int) -> int:
        """Positions the layers run over for a segment of ``seg_len`` tokens (with those :meth:`segment_inputs`
        adds)."""
        return seg_len

    def keys(self, mem_len: int, seg_len: int | None = None) -> int:
        """Keys a layer attends over before a segment once the memory is full: what evaluation's cached keys and
        values hold per layer (by default the state's vectors of one layer)."""
        return self.vectors(mem_len, seg_len) // self.config.n_layer

    # ---- one segment -----------------------------------------------------------------------------------------------
    def segment_inputs(self, state: list[Tensor], h: Tensor, documents: Documents | None = None) -> Tensor:
        """The first layer's input [B, L', d] from the embedded segment [B, L, d]: the variant's own positions added
        (``documents``: where the rows' documents begin, for a variant whose added positions restart with them)."""
        return h

    def segment_outputs(self, h: Tensor) -> Tensor:
        """The last layer's outputs of the segment's own tokens, [B, L, d], from those of :meth:`segment_inputs`."""
        return h

    def mask(self, mask: Tensor, documents: Documents | None, context: Context) -> Tensor:
        """The additive attention mask [L', M+L'] (or [B, 1, L', M+L'] per row): with ``documents``, keys of another
        document than a query's are hidden too (a compressed slot unless all it summarises is in the query's)."""
        if needs_mask(documents, context.reach):
            return document_mask(mask, documents.pos, context.length, context.slots, context.rate)
        return mask

    def update(self, state: list[Tensor], layer_inputs: list[Tensor], outputs: Tensor, *, mem_len: int,
               attached: bool, dtype: torch.dtype, layers: nn.ModuleList, kv: KV, keep_kv: bool,
               documents: Documents | None = None) -> Update:
        """The state after a segment, from each layer's inputs over the segment's positions ``layer_inputs`` and the
        last layer's ``outputs``; ``attached``: keep it in the graph (gradients reach this segment from the next; the
        model asks it only of a memory whose config's ``check_window`` allows windows of two segments);
        ``dtype``: the storage dtype. ``kv``: each layer's keys/values [B, H, M+L', D] over memory ∘ segment, as its
        attention computed them (in the graph); ``keep_kv``: return the new state's keys/values (:attr:`Update.kv`)
        when they can be taken from ``kv``. ``documents``: where the segment's documents begin (None: one text per
        row)."""
        raise NotImplementedError

    # ---- evaluation and decoding -----------------------------------------------------------------------------------
    def decoder(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int, same_length: bool) -> Any:
        """The one-token decoder of a model with this memory (:meth:`xl.model.transformer.TransformerXL.decoder`): by
        default :class:`xl.model.decoding.IncrementalDecoder`, which serves every memory whose state is slots before a
        window of states (:attr:`rate`, :attr:`slot_len`, :meth:`slot_maker`); a variant that rewrites its memory
        otherwise returns its own, with the same ``prefill`` / ``feed`` / ``reset_rows``."""
        from xl.model.decoding import IncrementalDecoder  # generation only

        return IncrementalDecoder(model, batch_size, window, clamp_len, same_length)

    def project_kv(self, context: Context, layers: nn.ModuleList) -> KV:
        """Keys and values [B, H, M, D] of each layer's memory pieces, projected."""
        out = []
        for layer, pieces in zip(layers, context.pieces, strict=True):
            projected = [layer.attn.project_memory(p) for p in pieces]
            out.append((torch.cat([k for k, _ in projected], 2), torch.cat([v for _, v in projected], 2)))
        return out

    def slot_maker(self) -> Callable[[int, Tensor], Tensor] | None:
        """For the decoder: a function (layer, groups [B, G, rate, d]) → slots [B, G, d] with the weights as they are
        now (None: this memory keeps no slots)."""
        return None

    def states(self, context: Context, layer: int) -> Tensor:
        """A layer's single states (the memory after its slots), [B, S, d]: what the decoder may compress later."""
        return context.pieces[layer][-1]
