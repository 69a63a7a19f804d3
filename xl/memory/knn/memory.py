"""``memory=knn``: the retrieval memory of Memorizing Transformers (Wu et al., 2022) as a memory variant.

Every layer keeps the Transformer-XL cache of ``mem_len`` positions (:mod:`xl.memory.cache`; ``mem_len = 0``: none);
each retrieval layer (``memory.knn_layers``) also keeps, per batch row and per head, a store of ``memory.knn_size``
keys and values (:mod:`xl.memory.knn.store`) of the positions that left its local window, and extends its attention
(:attr:`xl.model.memory.Context.extend`): each query retrieves its ``memory.knn_top_k`` best entries
(:mod:`xl.memory.knn.search`) and the gated retrieval attention (:mod:`xl.memory.knn.attention`) mixes them with the
local heads. The query is the layer's content query before Transformer-XL's biases.

State, rows first: the cache's ``n_layer`` tensors [B, M, d], then per retrieval layer (in increasing order) the
store's ``keys`` [B, H, N, D], ``values`` [B, H, N, D] (the memory's storage dtype) and ``count`` [B] (int64).

What enters the store: after each segment, the keys and values that the layer's attention computed for the positions
leaving the window (:func:`xl.model.eviction.leaving`, the cache's rule), detached; a row whose document begins
forgets its entries (:func:`xl.memory.knn.store.write`). The store's tensors are written in place: the state a
forward pass returns holds the same store tensors as the state it was given.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from xl.memory.cache import CacheMemory
from xl.memory.knn import store
from xl.memory.knn.attention import RetrievalGate, default_layers
from xl.memory.knn.search import SEARCHES, Workspace, entry_ages, gather, search
from xl.model.eviction import leaving
from xl.model.memory import Context, Memory, Segment, Size, Update
from xl.model.memory_settings import MemoryConfig
from xl.settings.bounds import Bound, at_least, is_int, one_of, setting

if TYPE_CHECKING:
    from collections.abc import Callable

    from xl.memory.knn.decoding import KnnDecoder
    from xl.model.config import XLConfig
    from xl.model.documents import Documents
    from xl.model.transformer import TransformerXL

LAYERS = Bound("null (the layer three quarters up) or a non-empty list of distinct layer indices >= 0",
               lambda v: v is None or (len(v) > 0 and all(is_int(i) and i >= 0 for i in v) and len(set(v)) == len(v)))
STATE_PER_LAYER = 3  # keys, values, count


@dataclass
class KnnConfig(MemoryConfig):
    """``memory=knn``: a retrieval store in chosen layers, beside the cache (``memory.mem_len=0``: the store alone)."""

    knn_layers: list[int] | None = setting(None, bound=LAYERS, help="the layers that retrieve, counted from 0; null: "
                                                                    "the one three quarters up (ceil(3 n_layer/4)-1)")
    knn_size: int = setting(65536, bound=at_least(1), help="entries of the store per row, per head and per layer; "
                                                           "the oldest are overwritten when it is full")
    knn_top_k: int = setting(32, bound=at_least(1), help="entries each query retrieves and attends over")
    knn_search: str = setting("exact", bound=one_of(*SEARCHES),
                              help="exact (batched products, on the store's device) or faiss (faiss-cpu, on the CPU)")
    knn_recency: bool = setting(False, help="a learned bias per head for each rank of the retrieved entries by age "
                                            "(newest first), added to their scores; false: no order, as the paper")
    knn_age: bool = setting(False, help="a learned slope per head times log(1 + age) of each retrieved entry (the "
                                        "entries written after it), added to its score; false: none, as the paper")

    name = "knn"
    evaluation_settings = ("knn_size", "knn_top_k", "knn_search")

    def __post_init__(self) -> None:
        if self.knn_layers is not None and not isinstance(self.knn_layers, str):
            self.knn_layers = list(self.knn_layers)  # a list from Hydra's ListConfig too (a checkpoint records it)
        super().__post_init__()
        if self.knn_top_k > self.knn_size:
            raise ValueError(f"memory.knn_top_k={self.knn_top_k} exceeds memory.knn_size={self.knn_size}, the entries "
                             "a store holds; lower memory.knn_top_k or raise memory.knn_size")
        if self.knn_search == "faiss" and importlib.util.find_spec("faiss") is None:
            raise ValueError("memory.knn_search=faiss needs faiss, which is not installed: pip install faiss-cpu "
                             "(the knn extra), or set memory.knn_search=exact")

    def memory(self, config: XLConfig) -> KnnMemory:
        return KnnMemory(config)

    def check_context(self, same_length: bool) -> None:
        if same_length:
            raise ValueError("same_length would let a query's window drop keys that have not yet entered the store; "
                             "set memory.same_length=false and memory.eval_same_length=false with memory=knn")

    def held(self, mem_len: int, grad_segments: int, n_layer: int) -> list[int]:
        """A retrieval layer also reads its store: the ``knn_size`` positions that left the cache before it."""
        layers = default_layers(n_layer) if self.knn_layers is None else self.knn_layers
        return [mem_len + self.knn_size * (layer in layers) for layer in range(n_layer)]

    def check_window(self, grad_segments: int, mem_len: int) -> None:
        if grad_segments > 1:
            raise ValueError("the retrieval store takes no gradient, and windows of several segments are not "
                             "implemented for it; set memory.grad_segments=1 with memory=knn")


class KnnMemory(Memory):
    """The cache in every layer, and a retrieval store with its gate in each retrieval layer."""

    def __init__(self, config: XLConfig) -> None:
        super().__init__(config)
        self.settings: KnnConfig = config.memory
        layers = self.settings.knn_layers
        layers = default_layers(config.n_layer) if layers is None else tuple(sorted(layers))
        if layers[-1] >= config.n_layer:
            raise ValueError(f"memory.knn_layers={list(layers)} names a layer the model lacks: its {config.n_layer} "
                             f"layers are 0 … {config.n_layer - 1}; change memory.knn_layers or model.n_layer")
        self.layers = layers
        self.cache = CacheMemory(config)
        self.gates: nn.ModuleList | None = None
        # One set of buffers for every retrieval layer (they run one after another, with one shape).
        self.workspace = Workspace()

    def build(self) -> dict[str, nn.Module]:
        settings = self.settings
        self.gates = nn.ModuleList(RetrievalGate(self.config.n_head, settings.knn_top_k, settings.knn_recency,
                                                 settings.knn_age) for _ in self.layers)
        return {"retrieval": self.gates}

    # ---- state -----------------------------------------------------------------------------------------------------
    def init(self, batch: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        cfg = self.config
        stores = [t for _ in self.layers
                  for t in store.empty(batch, cfg.n_head, self.settings.knn_size, cfg.d_head, dtype=dtype,
                                       device=device)]
        return self.cache.init(batch, device, dtype) + stores

    def stores(self, state: list[Tensor]) -> list[list[Tensor]]:
        """The retrieval layers' stores in a state: one ``[keys, values, count]`` list per layer (the state's
        tensors, not copies)."""
        n = self.config.n_layer
        return [state[n + STATE_PER_LAYER * i:n + STATE_PER_LAYER * (i + 1)] for i in range(len(self.layers))]

    def context(self, state: list[Tensor]) -> Context:
        n = self.config.n_layer
        context = self.cache.context(state[:n])
        context.extend = self.extensions(state)
        return context

    def extensions(self, state: list[Tensor]) -> list[Callable[[Tensor, Tensor, Documents | None], Tensor] | None]:
        """Per layer, the retrieval attention over its store in ``state`` (None for the other layers)."""
        out: list = [None] * self.config.n_layer
        for layer, gate, entries in zip(self.layers, self.gates, self.stores(state), strict=True):
            out[layer] = self.retrieval(entries, gate)
        return out

    def retrieval(self, entries: list[Tensor], gate: RetrievalGate) -> Callable[[Tensor, Tensor, Documents | None],
                                                                                Tensor]:
        """The extension of one layer's attention: the gated attention over each query's best entries of
        ``entries``; a query whose document began inside its segment sees none (:func:`store.sees_store`)."""
        settings, workspace = self.settings, self.workspace

        def extend(queries: Tensor, local: Tensor, documents: Documents | None) -> Tensor:
            # On the CPU reading how full the store is costs nothing: an empty store leaves the local heads as they
            # are, and a filling one is searched over its filled slots only.
            limit = int(store.fill(entries).max()) if entries[store.KEYS].device.type == "cpu" else None
            if limit == 0:  # the gate still joins the graph, as on a device: DDP needs every parameter at every step
                return gate.untouched(local) if torch.is_grad_enabled() else local
            visible = None if documents is None else store.sees_store(documents.pos)
            found = search(settings.knn_search, queries, entries, settings.knn_top_k, visible, limit, workspace)
            # Without gradient the retrieved entries are used up within the layer: gathered into the workspace.
            keys, values = gather(entries, found, None if torch.is_grad_enabled() else workspace)
            ages = entry_ages(entries, found) if gate.ordered else None
            return gate(queries, local, keys, values, found.valid, ages)

        return extend

    # ---- sizes -----------------------------------------------------------------------------------------------------
    def store_values(self, seg_len: int | None = None) -> int:
        """Values one row holds in its stores, all retrieval layers together (keys and values), and with a segment of
        ``seg_len`` positions (None: not counted) the exact search's scores of that segment and the retrieved keys
        and values of each retrieval layer (a training step keeps every layer's for its backward pass)."""
        cfg, N, r = self.config, self.settings.knn_size, len(self.layers)
        stores = r * 2 * cfg.n_head * N * cfg.d_head
        if seg_len is None:
            return stores
        scores = cfg.n_head * seg_len * N if self.settings.knn_search == "exact" else 0
        return stores + scores + r * 2 * cfg.n_head * seg_len * self.settings.knn_top_k * cfg.d_head

    def size(self, mem_len: int, seg_len: int | None = None) -> Size:
        """The cache's vectors, and the stores' values (and a segment's scores and retrieved entries) counted in
        vectors of ``d_model`` values, rounded up; the counts (8 bytes per row and layer) are not counted.
        Evaluation carries the cache's keys/values; the store is searched, never cached."""
        stores = math.ceil(self.store_values(seg_len) / self.config.d_model)
        return Size(vectors=self.config.n_layer * mem_len + stores, keys=mem_len)

    # ---- one segment -----------------------------------------------------------------------------------------------
    def update(self, state: list[Tensor], segment: Segment) -> Update:
        n, documents = self.config.n_layer, segment.documents
        held = state[0].size(1)
        cache = self.cache.update(state[:n], segment.but(attached=False))
        gone = leaving(held + segment.layer_inputs[0].size(1), segment.mem_len)
        doc_start = store.doc_start_of_leaving(None if documents is None else documents.pos, held)
        stores = []
        for layer, entries in zip(self.layers, self.stores(state), strict=True):
            k, v = segment.kv[layer]
            stores += store.write(entries, k[:, :, :gone], v[:, :, :gone], doc_start)
        return Update(cache.state + stores, cache.kv)

    # ---- decoding --------------------------------------------------------------------------------------------------
    def decoder(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int,
                same_length: bool) -> KnnDecoder:
        """The generic decoder, with the stores written as positions leave its window
        (:class:`xl.memory.knn.decoding.KnnDecoder`)."""
        from xl.memory.knn.decoding import KnnDecoder  # generation only

        return KnnDecoder(model, batch_size, window, clamp_len, same_length)
