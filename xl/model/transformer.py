"""Transformer-XL language model: segment-level recurrence with relative positions.

Layer n of a segment attends over what its memory holds before the segment, then over the segment itself. What the
memory holds and how it changes after a segment is the memory variant's business (:mod:`xl.memory`: the plain
Transformer-XL cache, the compressive memory); the forward pass asks it through one interface and never branches on
the variant.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xl.model.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax, widen
from xl.model.attention import RelMultiHeadAttention
from xl.model.config import XLConfig
from xl.model.documents import Documents
from xl.model.dropout import Dropout
from xl.model.layers import XLLayer
from xl.model.memory import Segment, document_mask_of, segment_positions
from xl.model.memory_settings import MemoryContext
from xl.model.positions import attention_mask, sinusoid

if TYPE_CHECKING:
    from xl.model.decoding import Decoder
    from xl.model.memory import Context

CONTEXT_CACHE_SIZE = 16  # position tables and masks kept per model, least recently used dropped first


@dataclass
class XLOutput:
    logits: Tensor | None  # [B, L, vocab]; None when only the loss was asked for
    mems: list[Tensor]  # the memory's new state (xl.memory: one tensor per layer for the plain cache), detached
    # unless detach_memory=False
    loss: Tensor | None = None  # token mean over targets != ignore_index; 0 (no gradient) where there is none
    kv: list[tuple[Tensor, Tensor]] | None = None  # with cache_kv: the new memory's keys/values per layer
    aux_loss: Tensor | None = None  # the memory's own training loss, added to the loss (MemoryConfig.loss_name)


class LayerView:
    """What a memory may ask of the model's layers (:class:`xl.model.memory.Layers`), without being handed them."""

    def __init__(self, layers: nn.ModuleList, final_norm: nn.Module | None = None) -> None:
        self._layers = layers
        self._final_norm = nn.Identity() if final_norm is None else final_norm  # None: a model without one

    def project(self, layer: int, states: Tensor) -> tuple[Tensor, Tensor]:
        return self._layers[layer].attn.project_memory(states)

    def content_attention(self, layer: int, x: Tensor, states: Tensor) -> Tensor:
        return self._layers[layer].attn.content_attention(x, states)

    def final_norm(self, states: Tensor) -> Tensor:
        return self._final_norm(states)

    def project_context(self, context: Context) -> list[tuple[Tensor, Tensor]]:
        """Keys and values [B, H, M, D] of each layer's memory pieces (oldest first), projected."""
        out = []
        for n, pieces in enumerate(context.pieces):
            projected = [self.project(n, p) for p in pieces]
            out.append((torch.cat([k for k, _ in projected], 2), torch.cat([v for _, v in projected], 2)))
        return out


class TransformerXL(nn.Module):
    """Decoder-only LM. ``model(input_ids [B, L], mems)`` → :class:`XLOutput`."""

    def __init__(self, config: XLConfig) -> None:
        super().__init__()
        self.config = config
        if config.cutoffs:
            self.embed: nn.Module = AdaptiveEmbedding.of(config)
        else:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.emb_scale = math.sqrt(config.d_model)
        self.drop = Dropout(config.dropout)
        self.layers = nn.ModuleList(XLLayer(config) for _ in range(config.n_layer))
        # Pre-LN leaves the residual stream un-normalised; normalise once before the head.
        self.final_norm = nn.LayerNorm(config.d_model) if config.pre_lnorm else nn.Identity()
        if config.cutoffs:
            # Its forward gives log-probabilities, which serve as logits (softmax of log p is p).
            self.head: nn.Module = AdaptiveLogSoftmax.of(config)
        else:
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(functools.partial(self._init_weights, std=config.init_std))
        if config.tie_weights and config.cutoffs:
            self.head.tie_to(self.embed, projections=config.tie_projs)
        elif config.tie_weights:
            self.head.weight = self.embed.weight
        # The memory variant (xl.memory) and its own weights (the compressive memory's compressor), registered after
        # every other module, so that a seed gives the same main weights with any memory.
        self.memory = config.memory.memory(config)
        built = self.memory.build()
        for name, module in built.items():
            self.add_module(name, module)
        #: The names of the modules that hold the memory's own weights (a fine-tune from a run with another memory
        #: starts them fresh: xl.training.checkpoints.init_from).
        self.memory_modules: tuple[str, ...] = tuple(built)
        # Position tables and masks depend only on lengths: built once per shape, not per step.
        # Bounded: training and segment evaluation use a handful of shapes while the memory fills, but a
        # caller that varies the length every call (the vanilla baseline's growing window) must not keep them all.
        self._context_cache: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()

    @staticmethod
    def _init_weights(module: nn.Module, std: float) -> None:
        """Transformer-XL's normal initialisation with standard deviation ``std`` (``XLConfig.init_std``) of the
        linear layers' and embeddings' weights and the attention's position biases; the linear biases zero."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, RelMultiHeadAttention):
            nn.init.normal_(module.r_w_bias, 0.0, std)
            nn.init.normal_(module.r_r_bias, 0.0, std)

    def init_mems(self, batch_size: int) -> list[Tensor]:
        """The memory's empty state (the plain cache: n_layer tensors [B, 0, d_model]) in its storage dtype."""
        return self.memory.init(batch_size, self.device, self.config.memory_dtype(self.dtype))

    def decoder(self, batch_size: int, window: int | None = None, *, clamp_len: int | None = None,
                same_length: bool | None = None) -> Decoder:
        """A one-token decoder for generation, beside the forward pass (see :mod:`xl.model.decoding`).

        ``decoder.prefill(tokens [B, T], seg_len)`` reads a text with this model's forward, in segments with a
        memory of ``window`` positions, and returns the logits [B, vocab] after its last token;
        ``decoder.feed(tokens [B])`` then reads one token per row and returns the logits after it: exactly
        this forward of that one token over the memory carried from the previous call, with
        ``mem_len=window`` and this ``clamp_len``/``same_length``. Each new token attends over the last
        ``window`` positions and itself (with ``same_length``: ``window`` keys, itself included). None: the
        config's value. With a compressed memory the new token also attends over the compressed slots, which the
        decoder fills as states leave the window (:mod:`xl.model.decoding` says how). The model is put in evaluation
        mode; build a new decoder after changing the weights.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        context = MemoryContext.of({"mem_len": window, "clamp_len": clamp_len, "same_length": same_length},
                                   self.config).check(self.memory.settings)  # the decoders trust it
        return self.memory.decoder(self, batch_size, context.mem_len, context.clamp_len, context.same_length)

    @property
    def device(self) -> torch.device:
        """Where the weights are (all on one device)."""
        return self.layers[0].attn.r_w_bias.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: that of the layer states outside autocast."""
        return self.layers[0].attn.r_w_bias.dtype

    def _context(self, q_len: int, m_len: int, clamp_len: int, window: int | None) -> tuple[Tensor, Tensor]:
        """Relative position embeddings [M+L, d] (distances M+L-1 … 0) and the additive mask."""
        device, dtype = self.device, self.dtype
        key = (q_len, m_len, clamp_len, window, device, dtype)
        if key in self._context_cache:
            self._context_cache.move_to_end(key)
            return self._context_cache[key]
        # Built as ordinary tensors even under torch.inference_mode (Lightning evaluates in it): the same tables
        # serve later training steps, and autograd cannot save inference tensors for the backward.
        with torch.inference_mode(False), torch.no_grad():
            distances = torch.arange(m_len + q_len - 1, -1, -1, device=device)
            if clamp_len > 0:
                distances = distances.clamp(max=clamp_len)
            value = (sinusoid(distances, self.config.d_model).to(dtype),
                     attention_mask(q_len, m_len, window, device).to(dtype))
        self._context_cache[key] = value
        if len(self._context_cache) > CONTEXT_CACHE_SIZE:
            self._context_cache.popitem(last=False)  # least recently used
        return value

    def forward(
        self,
        input_ids: Tensor,
        mems: list[Tensor] | None = None,
        targets: Tensor | None = None,
        *,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
        return_logits: bool = True,
        ignore_index: int = -100,
        cache_kv: bool = False,
        kv: list[tuple[Tensor, Tensor]] | None = None,
        documents: Documents | None = None,
        detach_memory: bool = True,
    ) -> XLOutput:
        """Run one segment over the memory ``mems`` (the state of :attr:`memory`; None: empty).

        ``mem_len``/``clamp_len``/``same_length`` override the config for this call (evaluation
        with a longer memory, as in the paper). With ``targets`` the token-mean cross-entropy is
        returned; ``return_logits=False`` then frees the logits as soon as the loss is computed.

        ``cache_kv`` (evaluation only: the weights must not change between calls) also returns the new
        memory's projected keys and values, to pass back as ``kv`` with that memory: each segment then
        projects only its own positions instead of memory ∘ segment. Exact, since keys and values carry
        no position. ``kv=None`` with a non-empty memory projects the memory once.

        ``documents`` (:class:`xl.model.documents.Documents`, positions [B, L] of the inputs in their documents): each
        token attends only to earlier tokens of its own document, in the memory and in the segment (a compressed
        slot only if all it summarises lies in the token's document); the memory must hold the positions just
        before this segment in every row (as the returned ``mems`` do). None: every row is one text.

        ``detach_memory=False`` returns the new memory still in the graph (for the memories that allow it): the
        next segment's loss then back-propagates into this one (truncated BPTT over several segments).
        ``aux_loss`` is the memory's own training loss, if it has one (such as the compressive memory's
        reconstruction loss, which trains its compressor).
        """
        cfg, memory = self.config, self.memory
        context = MemoryContext.of({"mem_len": mem_len, "clamp_len": clamp_len, "same_length": same_length}, cfg)
        mem_len, clamp_len, same_length = context.mem_len, context.clamp_len, context.same_length
        assert mem_len >= 0 and (clamp_len == -1 or clamp_len > 0), "lengths are checked where they are set"
        # What a caller asks of the memory that its variant may refuse: same_length, and (detach_memory=False) the
        # next segment's gradient reaching this one, a window of two segments.
        if same_length and (mem_len != cfg.mem_len or not cfg.same_length):  # a context XLConfig did not check
            context.check(memory.settings)
        if not detach_memory:
            memory.settings.check_window(2, mem_len)
        B = input_ids.size(0)
        state = self.init_mems(B) if mems is None else memory.adopt(mems, B, mem_len)
        context = memory.context(state)
        M = context.length
        if cache_kv and torch.is_grad_enabled():
            raise ValueError("cache_kv is for evaluation (under torch.no_grad()): the cached keys and values "
                             "would be stale after the next optimizer step")
        layers = LayerView(self.layers, self.final_norm)
        if cache_kv and kv is None and M:
            kv = layers.project_context(context)
        if kv is not None and (len(kv) != cfg.n_layer or any(k.size(2) != M for k, _ in kv)):
            raise ValueError(f"kv must be the {cfg.n_layer} (keys, values) pairs returned with this memory "
                             f"(each over {M} positions)")
        if documents is not None and documents.pos.shape != input_ids.shape:
            raise ValueError(f"documents.pos must be [B, L] = {list(input_ids.shape)} like the inputs, "
                             f"got {tuple(documents.pos.shape)}")

        added = memory.positions  # positions the memory adds to the segment (memory tokens), or None
        pos_emb, mask = self._context(segment_positions(memory, input_ids.size(1)), M, clamp_len,
                                      mem_len if same_length else None)
        mask = document_mask_of(mask, documents, context) if added is None else added.mask(mask, documents, context)
        # The position embeddings' dropout mask is drawn before the inputs', so that a seed trains as it always has.
        pos_emb = self.drop(pos_emb)
        h = self.drop(self.embed(input_ids) * self.emb_scale)
        if added is not None:
            h = added.inputs(state, h, documents)
        mem_dtype = cfg.memory_dtype(h.dtype)
        # A memory stored rounded (mem_dtype) must be seen by the next segment through keys/values of the rounded
        # states, as it would be without the cache: those are projected from the new memory, not sliced from here.
        slice_kv = cache_kv and mem_dtype == h.dtype
        # The memory's extensions of the layers' attention (xl.model.memory.Context.extend), given this segment's
        # documents.
        extend = [None if e is None else functools.partial(e, documents=documents)
                  for e in context.extend] if context.extend else [None] * cfg.n_layer
        layer_inputs, layer_kv = [], []
        for layer, pieces, mem_kv, ext in zip(self.layers, context.pieces, kv or [None] * cfg.n_layer, extend,
                                              strict=True):
            layer_inputs.append(h)
            h, keys = layer(h, pieces, pos_emb, mask, mem_kv, ext)
            layer_kv.append(keys)
        update = memory.update(state, Segment(layer_inputs, h, layer_kv, layers, mem_len, mem_dtype,
                                              attached=not detach_memory, keep_kv=slice_kv, documents=documents))
        new_kv = update.kv
        if cache_kv and new_kv is None:
            new_kv = layers.project_context(memory.context(update.state))
        if added is not None:
            h = h[:, added.before:h.size(1) - added.after]  # the segment's own positions
        states = self.drop(self.final_norm(h))
        if cfg.cutoffs:
            # Adaptive softmax: the loss never materialises [B, L, vocab]; the logits only when asked for.
            loss = None if targets is None else self.head.nll(states, targets, ignore_index)
            logits = self.head(states) if return_logits else None
        else:
            logits = self.head(states)
            # bf16/fp16 logits are upcast for the loss; fp32/fp64 stay as they are.
            loss = None if targets is None else F.cross_entropy(
                widen(logits).flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
            if loss is not None:  # no scored target (a loss on answers alone): 0, not the mean's NaN
                loss = torch.where((targets != ignore_index).any(), loss, 0.0)
            logits = logits if return_logits else None
        return XLOutput(logits=logits, mems=update.state, loss=loss, kv=new_kv if cache_kv else None,
                        aux_loss=update.loss)


def count_parameters(config: XLConfig) -> int:
    """Parameters of a model with this config, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = TransformerXL(config)
    return sum(p.numel() for p in model.parameters())
