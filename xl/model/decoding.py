"""Incremental (one-token) decoding, the model's generation API: :meth:`xl.model.transformer.TransformerXL.decoder`.

A decoder reads a text with the model's own forward (:meth:`IncrementalDecoder.prefill`), then one new
token per row at a time (:meth:`IncrementalDecoder.feed`). Each fed token gets exactly the logits of the
forward of that one token over the memory carried from the previous call, with ``mem_len = window`` and the
decoder's ``clamp_len`` and ``same_length``: the token attends over the last ``window`` positions and
itself, or with ``same_length`` over ``window`` keys, itself included (the rule of
:func:`xl.model.positions.attention_mask`). With a rounded memory (``mem_dtype`` bfloat16/float16) the prefill's keys
and values are those of the rounded memory, as in the forward; a fed token's own key and value keep the model's
precision, so its successors' logits differ from a forward over the rounded memory by that rounding.

Why it is fast: in Transformer-XL keys and values carry no position (positions enter only through the
relative term, Dai et al., 2019, section 3.3), so the projected keys and values of earlier tokens stay
valid as the window slides, and the projected embeddings of distances 0 … window are the same at every
step. Both are computed once, unlike the 2019 code, which re-projects the whole window for every token.

The memory's rule decides what leaves the window (:func:`xl.model.eviction.leaving`, the forward pass's rule too):
the states beyond it, in whole groups of the memory's rate. A memory that keeps slots (the compressive memory,
:mod:`xl.memory.compressive`) compresses each group that leaves into one slot (at most ``slot_len``, oldest
dropped), whose keys and values are projected once, when the slot is made; a token attends over ``slots ∘ memory ∘
itself``, distances counted in slots, as in the forward. Up to ``rate - 1`` states beyond the window wait in the
memory, visible as ordinary positions, until their group is complete, as in the forward: a prompt read in segments
of any length, then fed, keeps exactly the forward's memory. With a rounded memory the slots are the rounded
compression of the unrounded states.

Documents (``memory.doc_boundaries=reset``, :mod:`xl.model.documents`): ``prefill(tokens, seg_len, starts)`` reads a
prompt that holds several documents as the forward does, and ``reset_rows(rows)`` makes the next token fed to
those rows begin a new document: it and its successors see nothing of the row's earlier text, exactly as if
the row had started from an empty memory, while the other rows keep theirs. A compressed slot is seen only if all
it summarises lies in the row's current document (the rule of :func:`xl.model.documents.key_offsets`): a document that
begins on a group boundary reads exactly as from an empty memory; otherwise the group across its start is hidden.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from xl.model.documents import Documents, key_offsets, positions
from xl.model.eviction import leaving
from xl.model.positions import relative_embeddings

if TYPE_CHECKING:
    from xl.model.attention import Extension
    from xl.model.transformer import TransformerXL

NO_DOCUMENT_START = np.iinfo(np.int64).min // 2  # a row whose text has no document start to hide anything before


class Decoder:
    """What every memory's one-token decoder offers (:meth:`TransformerXL.decoder` returns one): :meth:`prefill`,
    :meth:`feed` and :meth:`reset_rows`. Their arguments are checked here, once; a decoder implements ``_prefill``,
    ``_feed`` and ``_reset_rows`` on arguments it can trust. The model is put in evaluation mode."""

    def __init__(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int, same_length: bool) -> None:
        self.model, self.batch_size, self.window = model.eval(), batch_size, window
        self.clamp_len, self.same_length = clamp_len, same_length

    @torch.no_grad()
    def prefill(self, tokens: Tensor, seg_len: int | None = None, starts: Tensor | None = None) -> Tensor:
        """Start a new text: read ``tokens`` [B, T] with the model's forward in segments of ``seg_len`` (a memory
        that writes once per training segment reads in those instead), then return the logits [B, vocab] after the
        last token. ``starts`` [B, T] (bool): where further documents begin inside the prompt (its first token
        always begins one); each token then sees only its own document."""
        if tokens.dim() != 2 or tokens.size(0) != self.batch_size or tokens.size(1) < 1:
            raise ValueError(f"prefill needs tokens [{self.batch_size}, T >= 1] (this decoder's batch size), "
                             f"got {tuple(tokens.shape)}")
        if seg_len is not None and seg_len < 1:
            raise ValueError(f"seg_len must be >= 1, got {seg_len}")
        if starts is not None and starts.shape != tokens.shape:
            raise ValueError(f"starts must have the prompt's shape {tuple(tokens.shape)}, got {tuple(starts.shape)}")
        return self._prefill(tokens, seg_len, starts)

    @torch.no_grad()
    def feed(self, tokens: Tensor) -> Tensor:
        """Read one token per row, ``tokens`` [B]; return the logits [B, vocab] of the token after it. Without a
        :meth:`prefill` the text starts here, with an empty memory."""
        if tokens.shape != (self.batch_size,):
            raise ValueError(f"feed takes one token per row, [{self.batch_size}], got {tuple(tokens.shape)}")
        return self._feed(tokens)

    def reset_rows(self, rows: Tensor) -> None:
        """The next token fed to each row where ``rows`` [B] (bool) is True begins a new document: from then on
        those rows see none of their earlier text (as after a :meth:`prefill` from nothing); the others keep it."""
        if rows.shape != (self.batch_size,):
            raise ValueError(f"reset_rows takes one flag per row, [{self.batch_size}], got {tuple(rows.shape)}")
        self._reset_rows(rows)

    def _prefill(self, tokens: Tensor, seg_len: int | None, starts: Tensor | None) -> Tensor:
        raise NotImplementedError

    def _feed(self, tokens: Tensor) -> Tensor:
        raise NotImplementedError

    def _reset_rows(self, rows: Tensor) -> None:
        raise NotImplementedError


class IncrementalDecoder(Decoder):
    """Per layer: keys/values of the positions a new token attends to, the projected relative embeddings
    (multiplied by the attention scale) and the stacked query/key/value weight; with a memory that keeps slots also
    the layer inputs of the memory's states (what a slot is made from) and the memory's slot maker. All come from
    the weights at construction: build a new decoder (:meth:`TransformerXL.decoder`) after changing them."""

    def __init__(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int, same_length: bool) -> None:
        memory = model.memory  # batch_size and the context: checked by TransformerXL.decoder
        if window < 1:
            raise ValueError("incremental decoding needs a memory: set mem_len (the decoder's window) >= 1")
        super().__init__(model, batch_size, window, clamp_len, same_length)
        cfg = model.config
        # Cached positions a new token attends to: same_length counts the token itself among the window.
        self.visible = window - 1 if same_length else window
        slots = memory.slots()  # states leaving the window make slots (the compressive memory), or are dropped
        self.rate, self.slot_len = (slots.rate, slots.kept) if slots else (1, 0)
        self.make_slots = slots.make if slots else None
        # The most keys a token sees before itself: the slots, the window, and states waiting for their group.
        self.reach = self.slot_len + self.visible + self.rate - 1
        pos_emb = relative_embeddings(self.reach + 1, clamp_len, cfg.d_model, model.device).to(model.dtype)
        with torch.no_grad():
            # [H, D, reach+1] per layer; a token with m visible keys uses the last m+1 columns (distances
            # m .. 0). Multiplied by the attention scale once here, so that no step scales its position scores.
            self.r = [layer.attn.project_positions(pos_emb) * layer.attn.scale for layer in model.layers]
            self.qkv_weight = [layer.attn.qkv_weight() for layer in model.layers]
        # Keys/values live in buffers twice as long as the keys a token sees: a token's key is written in place
        # after the visible ones, and only when a buffer is full are those moved back to the front (once every
        # `window` tokens or more). Layout: buf[lo:start] slots (oldest first), buf[start:end] the memory's states.
        size = 2 * (self.reach + 1)
        shape = (batch_size, cfg.n_head, size, cfg.d_head)
        self.k_buf = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layer)]
        self.v_buf = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layer)]
        self.h_buf = [torch.zeros(batch_size, size, cfg.d_model, dtype=model.dtype, device=model.device)
                      for _ in range(cfg.n_layer if self.slot_len else 0)]
        self.lo = self.start = self.end = 0
        # Per row, the buffer index where its current document begins: keys before it are hidden (host-side, so a
        # step knows without a device read whether any row needs a mask).
        self.doc_start = np.full(batch_size, NO_DOCUMENT_START, dtype=np.int64)
        self.no_extensions: list[Extension | None] = [None] * cfg.n_layer

    @property
    def slots(self) -> int:
        """Compressed slots held (the first keys)."""
        return self.start - self.lo

    def _prefill(self, tokens: Tensor, seg_len: int | None, starts: Tensor | None) -> Tensor:
        """The prompt read with a memory of ``window`` positions (the decoder's clamp_len and same_length); the
        cache becomes that memory's keys and values."""
        if seg_len is None:
            raise ValueError("prefill needs seg_len, the segment length to read the prompt in, with this memory")
        pos = None if starts is None else positions(starts)
        mems = kv = out = None
        for start in range(0, tokens.size(1), seg_len):
            documents = None if pos is None else Documents.from_positions(pos[:, start:start + seg_len])
            out = self.model(tokens[:, start:start + seg_len], mems, mem_len=self.window, clamp_len=self.clamp_len,
                             same_length=self.same_length, cache_kv=True, kv=kv, documents=documents)
            mems, kv = out.mems, out.kv
        for k_buf, v_buf, (k, v) in zip(self.k_buf, self.v_buf, kv, strict=True):
            k_buf[:, :, :k.size(2)] = k
            v_buf[:, :, :v.size(2)] = v
        self.prefilled(mems)
        context = self.model.memory.context(mems)
        self.lo, self.start, self.end = 0, context.spanning, context.length
        for n, h_buf in enumerate(self.h_buf):  # a layer's single states are the last of its pieces
            h_buf[:, self.start:self.end] = context.pieces[n][-1]
        # The window may keep fewer states than the forward's memory (same_length counts the token itself).
        self._leave(leaving(self.end - self.start, self.visible, self.rate))
        if pos is None:  # one text per row: nothing before it to hide
            self.doc_start[:] = NO_DOCUMENT_START
        else:
            self.doc_start = self.end - 1 - pos[:, -1].cpu().numpy().astype(np.int64)
        return out.logits[:, -1]

    def _reset_rows(self, rows: Tensor) -> None:
        self.doc_start[rows.cpu().numpy().astype(bool)] = self.end

    def _feed(self, tokens: Tensor) -> Tensor:
        model = self.model
        h = model.embed(tokens[:, None]) * model.emb_scale
        if self.end == self.k_buf[0].size(2):
            self._move_to_front()
        m = self.end - self.lo
        cache = slice(self.lo, self.end + 1)  # the visible keys and the slot for the new one
        masked_keys = self._masked_keys(h.device)
        for n, (layer, extend) in enumerate(zip(model.layers, self.extensions(), strict=True)):
            for h_buf in self.h_buf[n:n + 1]:
                h_buf[:, self.end] = h[:, 0]
            h = layer.decode_one(h, self.k_buf[n][:, :, cache], self.v_buf[n][:, :, cache],
                                 self.r[n][..., self.reach - m:], self.qkv_weight[n], masked_keys, extend)
        self.end += 1
        self._leave(leaving(self.end - self.start, self.visible, self.rate))
        return model.head(model.final_norm(h))[:, -1]

    def prefilled(self, mems: list[Tensor]) -> None:
        """Called by :meth:`prefill` with the memory's state after the prompt, once the cache holds its keys and
        values: a variant's decoder keeps here what the cache does not hold (by default nothing)."""

    def extensions(self) -> list[Extension | None]:
        """Per layer, the memory's extension of the next fed token's attention (:mod:`xl.model.attention`), or None:
        by default none."""
        return self.no_extensions

    def _masked_keys(self, device: torch.device) -> Tensor | None:
        """[B, m+1] True for the keys a row's new token must not see (those before its document's start, a
        compressed slot counted from where its group begins); None when no row hides any key."""
        earliest = self.start - self.slots * self.rate  # where the oldest visible key begins
        if not (self.doc_start > earliest).any():
            return None
        begins = self.end + key_offsets(self.end - self.lo, 1, device, ((self.slots, self.rate),))  # buffer indices
        return begins < torch.from_numpy(self.doc_start).to(device)[:, None]

    def _leave(self, gone: int) -> None:
        """The oldest ``gone`` states (whole groups of the rate) left the window: the memory makes one slot of each
        group, of which the newest ``slot_len`` are kept, placed just before the states that stay (the slots kept
        from before moved up to stay contiguous with them); without slots they are dropped."""
        if not gone:
            return
        groups, rate = gone // self.rate, self.rate
        new = min(groups, self.slot_len)  # slots made that are kept
        kept = min(self.slots, self.slot_len - new)  # older slots still kept
        start = self.start + gone
        for n, layer in enumerate(self.model.layers if new else ()):
            h = self.h_buf[n][:, start - new * rate:start]
            made = self.make_slots(n, h.view(h.size(0), new, rate, h.size(2)))
            k, v = layer.attn.project_memory(made.to(self.model.config.memory_dtype(made.dtype)))
            for buf, fresh in ((self.k_buf[n], k), (self.v_buf[n], v)):
                buf[:, :, start - new - kept:start - new] = buf[:, :, self.start - kept:self.start].clone()
                buf[:, :, start - new:start] = fresh
        self.start, self.lo = start, start - new - kept

    def _move_to_front(self) -> None:
        """Move the visible keys/values (at most ``reach``, at the end of full buffers at least twice that long) to
        the front: source and destination never overlap, so one copy each."""
        keep = self.end - self.lo
        for buf in self.k_buf + self.v_buf:
            buf[:, :, :keep].copy_(buf[:, :, self.lo:self.end])
        for buf in self.h_buf:
            buf[:, :keep].copy_(buf[:, self.lo:self.end])
        self.doc_start -= self.lo
        self.start -= self.lo
        self.lo, self.end = 0, keep
