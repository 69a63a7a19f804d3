"""Transformer-XL language model: segment-level recurrence with relative positions.

Layer n of segment t attends over ``StopGrad(memory[n]) ∘ h[n-1]`` where ``memory[n]`` holds the
last ``mem_len`` inputs of layer n from earlier segments (layer n-1's outputs; the embedding for
n = 1). The memory update rule and its per-stage store live in :mod:`xl.memory`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xl.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax, widen
from xl.attention import RelMultiHeadAttention
from xl.compressive import Compressor, reconstruction_loss
from xl.documents import Documents, document_mask, needs_mask
from xl.dropout import Dropout, ReLUDropout
from xl.memory import evicted_states, split_memory, update_compressive_memory, update_memory, update_memory_attached
from xl.model_config import MEM_DTYPES, XLConfig, check_compressive, check_context  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from xl.decoding import IncrementalDecoder

CONTEXT_CACHE_SIZE = 16  # position tables and masks kept per model, least recently used dropped first


@dataclass
class XLOutput:
    logits: Tensor | None  # [B, L, vocab]; None when only the loss was asked for
    mems: list[Tensor]  # n_layer tensors [B, mem_len', d_model], detached unless detach_memory=False
    loss: Tensor | None = None  # token mean over targets != ignore_index
    kv: list[tuple[Tensor, Tensor]] | None = None  # with cache_kv: the new memory's keys/values per layer
    recon_loss: Tensor | None = None  # compressive memory with a learned compressor, under grad: its training loss


def sinusoid(positions: Tensor, d_model: int) -> Tensor:
    """Sinusoidal embedding of (relative) positions, as in Vaswani et al. and Dai et al."""
    # float64 so that every dtype gets the correctly rounded table; it is built once per shape.
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device) / d_model))
    angles = positions.double()[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def relative_embeddings(length: int, clamp_len: int, d_model: int, device: torch.device) -> Tensor:
    """Embeddings [length, d] of distances length-1 … 0 (the farthest key first); with ``clamp_len`` > 0,
    distances beyond it share its embedding."""
    distances = torch.arange(length - 1, -1, -1, device=device)
    return sinusoid(distances.clamp(max=clamp_len) if clamp_len > 0 else distances, d_model)


def attention_mask(q_len: int, m_len: int, window: int | None, device: torch.device) -> Tensor:
    """Additive [L, M+L] mask: 0 where query i (at key position M+i) may look, -inf elsewhere.

    Keys after the query are hidden; with ``window`` (same_length) so are keys at or beyond
    ``window`` positions back, so every query sees the same number of keys.
    """
    q_pos = torch.arange(m_len, m_len + q_len, device=device)[:, None]
    k_pos = torch.arange(m_len + q_len, device=device)[None, :]
    masked = k_pos > q_pos
    if window is not None:
        masked |= k_pos <= q_pos - window
    return torch.zeros(masked.shape, device=device).masked_fill(masked, float("-inf"))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_inner: int, dropout: float, pre_lnorm: bool) -> None:
        super().__init__()
        # One Sequential, so that parameter names (net.0, net.3) stay those of earlier checkpoints. The
        # forward runs it by hand: ReLU (and in training the first dropout) in place on the 2-D product, a
        # fresh tensor (on the view that linear returns for 3-D input, autograd would record CopySlices:
        # four extra passes in the backward).
        self.net = nn.Sequential(
            nn.Linear(d_model, d_inner), nn.ReLU(), Dropout(dropout),
            nn.Linear(d_inner, d_model), Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model)
        self.pre_lnorm = pre_lnorm

    def forward(self, h: Tensor) -> Tensor:
        fc1, _, drop1, fc2, drop2 = self.net
        p = drop1.p if self.training else 0.0
        # Dropout's 1/(1-p) taken by the product (relu(s·z) = s·relu(z)); ReLU and dropout then in place.
        scale = 1.0 / (1.0 - p)
        inner = torch.addmm(fc1.bias, self._rows(h), fc1.weight.t(), beta=scale, alpha=scale)
        inner = ReLUDropout.apply(inner, p) if p else inner.relu_()
        return self._residual(h, drop2(fc2(inner)).view(h.shape))

    def decode_one(self, h: Tensor) -> Tensor:
        """The evaluation forward for one position per row (incremental decoding). The first product runs as
        W·xᵀ: for a [d_inner, d] weight and 8 rows MKL computes it 1.9× faster that way than as x·Wᵀ (on a
        2-core AVX2 CPU)."""
        fc1, fc2 = self.net[0], self.net[3]
        inner = torch.addmm(fc1.bias[:, None], fc1.weight, self._rows(h).t()).t().relu_()
        return self._residual(h, fc2(inner).view(h.shape))

    def _rows(self, h: Tensor) -> Tensor:
        """The (pre-LN: normed) input as [B·L, d] rows."""
        return (self.layer_norm(h) if self.pre_lnorm else h).reshape(-1, h.size(-1))

    def _residual(self, h: Tensor, out: Tensor) -> Tensor:
        return h + out if self.pre_lnorm else self.layer_norm(h + out)


class XLLayer(nn.Module):
    def __init__(self, cfg: XLConfig) -> None:
        super().__init__()
        self.attn = RelMultiHeadAttention(cfg.d_model, cfg.n_head, cfg.d_head, cfg.dropout, cfg.dropatt, cfg.pre_lnorm)
        self.ff = FeedForward(cfg.d_model, cfg.d_inner, cfg.dropout, cfg.pre_lnorm)

    def forward(
        self, h: Tensor, mem: Tensor, pos_emb: Tensor, mask: Tensor, mem_kv: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        h, kv = self.attn(h, mem, pos_emb, mask, mem_kv)
        return self.ff(h), kv

    def decode_one(self, h: Tensor, keys: Tensor, values: Tensor, r: Tensor, qkv_weight: Tensor,
                   masked_keys: Tensor | None = None) -> Tensor:
        """The evaluation forward of one new position per row [B, 1, d] against cached keys and values
        (:meth:`RelMultiHeadAttention.decode_one` says what it is given)."""
        return self.ff.decode_one(self.attn.decode_one(h, keys, values, r, qkv_weight, masked_keys))


class TransformerXL(nn.Module):
    """Decoder-only LM. ``model(input_ids [B, L], mems)`` → :class:`XLOutput`."""

    def __init__(self, config: XLConfig) -> None:
        super().__init__()
        self.config = config
        if config.cutoffs:
            self.embed: nn.Module = AdaptiveEmbedding(config.vocab_size, config.d_model, config.cutoffs, config.div_val)
        else:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.emb_scale = math.sqrt(config.d_model)
        self.drop = Dropout(config.dropout)
        self.layers = nn.ModuleList(XLLayer(config) for _ in range(config.n_layer))
        # Pre-LN leaves the residual stream un-normalised; normalise once before the head.
        self.final_norm = nn.LayerNorm(config.d_model) if config.pre_lnorm else nn.Identity()
        if config.cutoffs:
            # Its forward gives log-probabilities, which serve as logits (softmax of log p is p).
            self.head: nn.Module = AdaptiveLogSoftmax(config.vocab_size, config.d_model, config.cutoffs, config.div_val)
        else:
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_weights and config.cutoffs:
            self.head.tie_to(self.embed, projections=config.tie_projs)
        elif config.tie_weights:
            self.head.weight = self.embed.weight
        # Built after every other module, so that a seed gives the same main weights with or without it.
        self.compressor = (Compressor(config.n_layer, config.d_model, config.cmem_rate, config.cmem_fn)
                           if config.cmem_len else None)
        # Position tables and masks depend only on lengths: built once per shape, not per step.
        # Bounded: training and segment evaluation use a handful of shapes while the memory fills, but a
        # caller that varies the length every call (the vanilla baseline's growing window) must not keep them all.
        self._context_cache: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, RelMultiHeadAttention):
            nn.init.normal_(module.r_w_bias, 0.0, 0.02)
            nn.init.normal_(module.r_r_bias, 0.0, 0.02)

    def init_mems(self, batch_size: int) -> list[Tensor]:
        """Empty memory: n_layer tensors [B, 0, d_model] in the cache's storage dtype."""
        dtype = self.config.memory_dtype(self.dtype)
        return [torch.zeros(batch_size, 0, self.config.d_model, dtype=dtype, device=self.device)
                for _ in range(self.config.n_layer)]

    def decoder(self, batch_size: int, window: int | None = None, *, clamp_len: int | None = None,
                same_length: bool | None = None) -> IncrementalDecoder:
        """A one-token decoder for generation, beside the forward pass (see :mod:`xl.decoding`).

        ``decoder.prefill(tokens [B, T], seg_len)`` reads a text with this model's forward, in segments with a
        memory of ``window`` positions, and returns the logits [B, vocab] after its last token;
        ``decoder.feed(tokens [B])`` then reads one token per row and returns the logits after it: exactly
        this forward of that one token over the memory carried from the previous call, with
        ``mem_len=window`` and this ``clamp_len``/``same_length``. Each new token attends over the last
        ``window`` positions and itself (with ``same_length``: ``window`` keys, itself included). None: the
        config's value. With a compressed memory the new token also attends over the compressed slots, which the
        decoder fills as states leave the window (:mod:`xl.decoding` says how). The model is put in evaluation
        mode; build a new decoder after changing the weights.
        """
        from xl.decoding import IncrementalDecoder  # xl.decoding builds on this module

        cfg = self.config
        return IncrementalDecoder(self, batch_size, cfg.mem_len if window is None else window,
                                  cfg.clamp_len if clamp_len is None else clamp_len,
                                  cfg.same_length if same_length is None else same_length)

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
        """Run one segment.

        ``mem_len``/``clamp_len``/``same_length`` override the config for this call (evaluation
        with a longer memory, as in the paper). With ``targets`` the token-mean cross-entropy is
        returned; ``return_logits=False`` then frees the logits as soon as the loss is computed.

        ``cache_kv`` (evaluation only: the weights must not change between calls) also returns the new
        memory's projected keys and values, to pass back as ``kv`` with that memory: each segment then
        projects only its own positions instead of memory ∘ segment. Exact, since keys and values carry
        no position. ``kv=None`` with a non-empty memory projects the memory once.

        With ``cmem_len`` > 0 (Rae et al., 2019; :mod:`xl.compressive`) each layer's memory is ``compressed ∘
        memory`` (:func:`xl.memory.split_memory`), attended as one longer memory, and the returned one holds the
        evicted states' compression too; ``recon_loss`` is the compressor's training loss when it has weights and
        gradients are on. With ``documents`` a query sees a compressed slot only if all the slot summarises lies in
        its document (:func:`xl.documents.key_offsets`).

        ``documents`` (:class:`xl.documents.Documents`, positions [B, L] of the inputs in their documents): each
        token attends only to earlier tokens of its own document, in the memory and in the segment; the memory
        must hold the positions just before this segment in every row (as the returned ``mems`` do). None: every
        row is one text.

        ``detach_memory=False`` returns the new memory still in the graph (:func:`xl.memory.update_memory_attached`):
        the next segment's loss then back-propagates into this one (truncated BPTT over several segments).
        """
        cfg = self.config
        mem_len = cfg.mem_len if mem_len is None else mem_len
        clamp_len = cfg.clamp_len if clamp_len is None else clamp_len
        same_length = cfg.same_length if same_length is None else same_length
        check_context(mem_len, clamp_len, same_length)
        if cfg.cmem_len:
            check_compressive(cfg.cmem_len, cfg.cmem_rate, cfg.cmem_fn, same_length)
        B, L = input_ids.shape
        if mems is None:
            mems = self.init_mems(B)
        if len(mems) != cfg.n_layer:
            raise ValueError(f"expected {cfg.n_layer} memory tensors (one per layer), got {len(mems)}")
        M = mems[0].size(1)
        for m in mems:
            if m.size(0) != B or m.size(1) != M or m.size(2) != cfg.d_model:
                raise ValueError(
                    f"memory of shape {tuple(m.shape)} does not fit a batch of {B} rows "
                    f"(expected [{B}, {M}, {cfg.d_model}]); reset the memory with init_mems({B})"
                )
        if cache_kv and torch.is_grad_enabled():
            raise ValueError("cache_kv is for evaluation (under torch.no_grad()): the cached keys and values "
                             "would be stale after the next optimizer step")
        if cache_kv and kv is None and M:
            kv = [layer.attn.project_memory(m) for layer, m in zip(self.layers, mems, strict=True)]
        if kv is not None and (len(kv) != cfg.n_layer or any(k.size(2) != M for k, _ in kv)):
            raise ValueError(f"kv must be the {cfg.n_layer} (keys, values) pairs returned with this memory "
                             f"(each over {M} positions)")
        pos_emb, mask = self._context(L, M, clamp_len, mem_len if same_length else None)
        if documents is not None and documents.pos.shape != (B, L):
            raise ValueError(f"documents.pos must be [B, L] = [{B}, {L}] like the inputs, "
                             f"got {tuple(documents.pos.shape)}")
        slots = split_memory(mems[0], mem_len, cfg.cmem_len)[0].size(1) if cfg.cmem_len else 0
        if needs_mask(documents, M + slots * (cfg.cmem_rate - 1)):
            mask = document_mask(mask, documents.pos, M, slots, cfg.cmem_rate)
        pos_emb = self.drop(pos_emb)

        h = self.drop(self.embed(input_ids) * self.emb_scale)
        mem_dtype = cfg.memory_dtype(h.dtype)
        # A memory stored rounded (mem_dtype) must be seen by the next segment through keys/values of the rounded
        # states, as it would be without the cache: those are projected from the new memory, not sliced from here.
        slice_kv = cache_kv and mem_dtype == h.dtype
        layer_inputs, new_kv = [], []
        kept = slice(M + L - min(mem_len, M - slots + L), None)  # the states the new memory keeps (after any slots)
        for layer, mem, mem_kv in zip(self.layers, mems, kv or [None] * cfg.n_layer, strict=True):
            layer_inputs.append(h)
            h, (k, v) = layer(h, mem, pos_emb, mask, mem_kv)
            if slice_kv:
                new_kv.append((k, v) if cfg.cmem_len else (k[:, :, kept], v[:, :, kept]))
        recon_loss = None
        if cfg.cmem_len:
            evicted = [evicted_states(m, x, mem_len, cfg.cmem_len) for m, x in zip(mems, layer_inputs, strict=True)]
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.compressor.learned):
                compressed = [self.compressor(i, e) for i, e in enumerate(evicted)]
            if compressed[0].requires_grad and evicted[0].size(1):
                recon_loss = reconstruction_loss(self.layers, layer_inputs, evicted, compressed)
            new_mems = update_compressive_memory(mems, layer_inputs, compressed, mem_len, cfg.cmem_len, mem_dtype)
            if slice_kv:
                new_kv = [compressive_kv(layer.attn, k, v, slots, c, cfg.cmem_len, kept)
                          for layer, (k, v), c in zip(self.layers, new_kv, compressed, strict=True)]
        else:
            update = update_memory if detach_memory else update_memory_attached
            new_mems = update(mems, layer_inputs, mem_len, mem_dtype)
        if cache_kv and not slice_kv:
            new_kv = [layer.attn.project_memory(m) for layer, m in zip(self.layers, new_mems, strict=True)]
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
            logits = logits if return_logits else None
        return XLOutput(logits=logits, mems=new_mems, loss=loss, kv=new_kv if cache_kv else None,
                        recon_loss=recon_loss)


def compressive_kv(attn: RelMultiHeadAttention, k: Tensor, v: Tensor, slots: int, new_slots: Tensor, cmem_len: int,
                   kept: slice) -> tuple[Tensor, Tensor]:
    """Keys/values of a new ``compressed ∘ memory`` (:func:`xl.memory.update_compressive_memory`), from a layer's
    keys/values ``k``, ``v`` [B, H, K, D] over ``old slots ∘ old memory ∘ segment``: the old slots kept and the states
    kept (``kept``) are sliced from them, and only the newest ``cmem_len`` of ``new_slots`` [B, S, d] are projected."""
    new = min(new_slots.size(1), cmem_len)
    old = min(slots, cmem_len - new)
    k_new, v_new = attn.project_memory(new_slots[:, new_slots.size(1) - new:])
    return (torch.cat([k[:, :, slots - old:slots], k_new, k[:, :, kept]], dim=2),
            torch.cat([v[:, :, slots - old:slots], v_new, v[:, :, kept]], dim=2))


def count_parameters(config: XLConfig) -> int:
    """Parameters of a model with this config, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = TransformerXL(config)
    return sum(p.numel() for p in model.parameters())
