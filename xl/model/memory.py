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
at its end) set :attr:`Memory.positions`, one optional pair of hooks (:class:`SegmentPositions`).

The interface, in one place (:class:`Memory`): weights (``build``); the state (``init``, ``adopt``, ``context``,
``size``); one segment (``update``, which receives a :class:`Segment` record of what the segment did and may ask the
model's layers through :class:`Layers`; ``positions``, where the variant adds positions); decoding (``decoder``, and
``slots`` for the default decoder).

The rule by which states leave a memory, :func:`xl.model.eviction.leaving`, is shared by
the forward pass and the one-token decoder (:mod:`xl.model.decoding`), so that both keep the same memory whatever the
segment lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from xl.model.documents import Documents, document_mask, needs_mask

if TYPE_CHECKING:
    from collections.abc import Callable

    from xl.model.config import XLConfig
    from xl.model.decoding import Decoder
    from xl.model.memory_settings import MemoryConfig
    from xl.model.transformer import TransformerXL

KV = list[tuple[Tensor, Tensor]]


@dataclass
class Context:
    """What each layer of one segment attends over before the segment.

    ``pieces[n]``: layer n's memory tensors [B, ·, d], oldest first, attended as one sequence of ``length`` keys;
    ``spans``: the first keys that each stand for more than one position (a summary of several states), as runs
    ``(keys, positions per key)``, oldest first; the keys after them hold one position each, and () means all do.
    What a document boundary hides is counted from them (:func:`xl.model.documents.key_offsets`).
    """

    pieces: list[list[Tensor]]
    length: int
    spans: tuple[tuple[int, int], ...] = ()
    #: Per layer, None or the memory's extension of that layer's attention: a function ``(queries, local,
    #: documents) -> heads`` of the content queries before Transformer-XL's biases and the local attention's heads
    #: (all [B, H, L, D]) and the segment's :class:`~xl.model.documents.Documents` (None: one text per row, or a
    #: decoder that resets the memory's rows itself). None: no layer is extended.
    extend: list[Callable[[Tensor, Tensor, Documents | None], Tensor] | None] | None = None

    @property
    def reach(self) -> int:
        """How many positions before the segment the keys cover (a key of ``spans`` counts its positions)."""
        return self.length + sum(keys * (width - 1) for keys, width in self.spans)

    @property
    def spanning(self) -> int:
        """How many of the first keys stand for more than one position (those of ``spans``)."""
        return sum(keys for keys, _ in self.spans)


@dataclass
class Update:
    """A memory's answer after a segment: its new state, the new state's keys/values per layer when asked for (None:
    the forward projects them from the state), and the variant's own training loss (None if it has none)."""

    state: list[Tensor]
    kv: KV | None = None
    loss: Tensor | None = None


class Layers(Protocol):
    """What a memory may ask of the model's layers, by layer index, with the weights as they are: no module is handed
    over (the model passes this view to :meth:`Memory.update`; :class:`xl.model.transformer.LayerView`)."""

    def project(self, layer: int, states: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s keys and values [B, H, T, D] of memory states [B, T, d]."""
        ...

    def content_attention(self, layer: int, x: Tensor, states: Tensor) -> Tensor:
        """Layer ``layer``'s content attention (no position term) of queries from ``x`` [B, L, d] over ``states``
        [B, T, d], its weights held fixed (detached): the heads' outputs [B, H, L, D]."""
        ...

    def final_norm(self, states: Tensor) -> Tensor:
        """The model's final layer norm (before the head; the identity without ``pre_lnorm``) of last-layer states
        [B, T, d], in the graph."""
        ...


@dataclass
class Segment:
    """What one segment did, handed to :meth:`Memory.update`: each layer's inputs over the segment's positions
    (``layer_inputs``, with those :attr:`Memory.positions` adds) and the last layer's ``outputs``; ``kv``: each
    layer's keys/values [B, H, M+L', D] over memory ∘ segment, as its attention computed them (in the graph);
    ``documents``: where the segment's documents begin (None: one text per row); ``layers``: the model's layers, to
    ask (:class:`Layers`).

    What is asked of the new state: ``mem_len`` positions of memory; ``attached``: keep it in the graph (gradients
    reach this segment from the next; asked only of a memory whose config's ``check_window`` allows windows of two
    segments); ``dtype``: its storage dtype; ``keep_kv``: return its keys/values (:attr:`Update.kv`) when they can be
    taken from ``kv``."""

    layer_inputs: list[Tensor]
    outputs: Tensor
    kv: KV
    layers: Layers
    mem_len: int
    dtype: torch.dtype
    attached: bool = False
    keep_kv: bool = False
    documents: Documents | None = None

    def but(self, **changes: Any) -> Segment:
        """This record with ``changes`` (a variant handing part of a segment to the memory beneath it)."""
        return replace(self, **changes)


@dataclass
class Size:
    """A full memory's size per row: ``vectors`` of d_model values, all layers together (the footprint), and the
    ``keys`` a layer attends over before a segment (what evaluation's cached keys and values hold per layer)."""

    vectors: int
    keys: int


@dataclass
class Slots:
    """For the one-token decoder (:mod:`xl.model.decoding`): states that leave its window make slots of ``rate``
    states each, of which the newest ``kept`` stay before the window, made by ``make(layer, groups [B, G, rate, d])
    -> [B, G, d]`` with the weights as they are now."""

    rate: int
    kept: int
    make: Callable[[int, Tensor], Tensor]


class SegmentPositions(Protocol):
    """The optional pair of hooks of a memory that adds positions of its own to every segment (memory tokens read at
    its start and written at its end): the layers run over ``before + L + after`` positions, and the segment's own
    outputs are the ``L`` between them."""

    before: int
    after: int

    def inputs(self, state: list[Tensor], h: Tensor, documents: Documents | None) -> Tensor:
        """The first layer's input [B, before + L + after, d] from the embedded segment [B, L, d] (``documents``:
        where the rows' documents begin, for added positions that restart with them)."""
        ...

    def mask(self, mask: Tensor, documents: Documents | None, context: Context) -> Tensor:
        """The additive attention mask over the added positions too, [L', M+L'] or per row [B, 1, L', M+L'] (causal
        given; with ``documents``, keys of another document than a query's hidden)."""
        ...


def segment_positions(memory: Memory, seg_len: int) -> int:
    """Positions the layers run over for a segment of ``seg_len`` tokens, with those ``memory`` adds."""
    added = memory.positions
    return seg_len + (added.before + added.after if added is not None else 0)


def document_mask_of(mask: Tensor, documents: Documents | None, context: Context) -> Tensor:
    """The causal mask [L, M+L] with the keys of another document than a query's hidden (per row: [B, 1, L, M+L];
    a key that stands for several positions unless all of them are in the query's document): the mask of a memory
    that adds no positions."""
    if needs_mask(documents, context.reach):
        return document_mask(mask, documents.pos, context.length, context.spans)
    return mask


class Memory:
    """One memory variant. Subclasses define the state's layout and the update rule; the defaults serve memories that
    attend over their state as it is and add no positions to the segment."""

    def __init__(self, config: XLConfig) -> None:
        self.config = config
        self.settings: MemoryConfig = config.memory  # the variant's own settings, and its rules (check_context, ...)

    # ---- parameters ------------------------------------------------------------------------------------------------
    def build(self) -> dict[str, nn.Module]:
        """Modules with the variant's own weights, registered on the model under these names after all its other
        modules (so that a seed gives the same main weights with any memory). Called once, by the model."""
        return {}

    # ---- state -----------------------------------------------------------------------------------------------------
    def init(self, batch: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        """The empty state of ``batch`` rows (learned initial values where the variant has them)."""
        raise NotImplementedError

    def adopt(self, state: list[Tensor], batch: int, mem_len: int) -> list[Tensor]:
        """The state checked against the layout :meth:`init` gives ``batch`` rows: as many tensors, each of its rank
        and kind (floating or integer) and of its sizes, but for the positions (dimension 1) of a tensor that starts
        empty, and each layer's context as long as the others'; ValueError in one sentence otherwise. A variant with
        rules of its own (bounds on what it holds) adds them after this."""
        like = self.init(batch, torch.device("meta"), torch.float32)
        reset = f"reset the memory with init_mems({batch})"
        if len(state) != len(like):
            raise ValueError(f"expected {len(like)} memory tensors for the {self.settings.name} memory, got "
                             f"{len(state)}; {reset}")
        for t, ref in zip(state, like, strict=True):
            grows = ref.dim() >= 2 and ref.size(1) == 0  # its positions come and go
            expected = ["positions" if grows and i == 1 else str(n) for i, n in enumerate(ref.shape)]
            if (t.dim() != ref.dim() or t.is_floating_point() != ref.is_floating_point()
                    or any(e not in ("positions", str(n)) for e, n in zip(expected, t.shape, strict=True))):
                kind = "floating" if ref.is_floating_point() else "integer"
                raise ValueError(f"memory of shape {tuple(t.shape)} does not fit a batch of {batch} rows (expected a "
                                 f"{kind} [{', '.join(expected)}]); {reset}")
        context = self.context(state)
        lengths = [sum(piece.size(1) for piece in pieces) for pieces in context.pieces]
        if any(n != context.length for n in lengths):
            raise ValueError(f"the memory's layers hold {lengths} positions; every layer holds as many; {reset}")
        return state

    def context(self, state: list[Tensor]) -> Context:
        """What each layer attends over before the segment, from the state."""
        raise NotImplementedError

    def size(self, mem_len: int, seg_len: int | None = None) -> Size:
        """A full memory's size per row (the footprint), for segments of ``seg_len`` (None: segments whose length the
        memory's rate divides)."""
        raise NotImplementedError

    # ---- one segment -----------------------------------------------------------------------------------------------
    #: Positions the variant adds to every segment (memory tokens): None, or the pair of hooks that adds them.
    positions: SegmentPositions | None = None

    def update(self, state: list[Tensor], segment: Segment) -> Update:
        """The state after a segment, from what the segment did (:class:`Segment`)."""
        raise NotImplementedError

    # ---- decoding --------------------------------------------------------------------------------------------------
    def decoder(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int,
                same_length: bool) -> Decoder:
        """The one-token decoder of a model with this memory (:meth:`xl.model.transformer.TransformerXL.decoder`): by
        default :class:`xl.model.decoding.IncrementalDecoder`, which serves every memory whose state is (optional)
        slots before a window of states (:meth:`slots`), each layer's states the last of its context's pieces; a
        variant that rewrites its memory otherwise returns its own subclass of :class:`xl.model.decoding.Decoder`."""
        from xl.model.decoding import IncrementalDecoder  # generation only

        return IncrementalDecoder(model, batch_size, window, clamp_len, same_length)

    def slots(self) -> Slots | None:
        """For the default decoder: how states that leave its window become slots (None: they are dropped)."""
        return None
