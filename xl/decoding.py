"""Incremental (one-token) decoding, the model's generation API: :meth:`xl.model.TransformerXL.decoder`.

A decoder reads a text with the model's own forward (:meth:`IncrementalDecoder.prefill`), then one new
token per row at a time (:meth:`IncrementalDecoder.feed`). Each fed token gets exactly the logits of the
forward of that one token over the memory carried from the previous call, with ``mem_len = window`` and the
decoder's ``clamp_len`` and ``same_length``: the token attends over the last ``window`` positions and
itself, or with ``same_length`` over ``window`` keys, itself included (the rule of
:func:`xl.model.attention_mask`). With a rounded memory (``mem_dtype`` bfloat16/float16) the prefill's keys
and values are those of the rounded memory, as in the forward; a fed token's own key and value keep the model's
precision, so its successors' logits differ from a forward over the rounded memory by that rounding.

Why it is fast: in Transformer-XL keys and values carry no position (positions enter only through the
relative term, Dai et al., 2019, section 3.3), so the projected keys and values of earlier tokens stay
valid as the window slides, and the projected embeddings of distances 0 … window are the same at every
step. Both are computed once, unlike the 2019 code, which re-projects the whole window for every token.

Compressive memory (``cmem_len`` > 0, :mod:`xl.compressive`): the window slides as above, and each layer's states
that leave it are compressed ``cmem_rate`` to 1 into compressed slots (at most ``cmem_len``, oldest dropped) whose
keys and values are projected once, when the slot is made. A token attends over ``compressed ∘ memory ∘ itself``,
distances counted in slots, as in the forward. States leave in whole groups: up to ``cmem_rate - 1`` states
beyond the window stay in the memory, visible as ordinary positions, until a group is complete (the forward over a
segment compresses what it evicts at once, padding a last short group). A prompt read in segments whose length
the rate divides, then fed, thus keeps exactly the slots of the forward; with a rounded memory the slots are the
rounded compression of the unrounded states.

Documents (``memory.doc_boundaries=reset``, :mod:`xl.documents`): ``prefill(tokens, seg_len, starts)`` reads a
prompt that holds several documents as the forward does, and ``reset_rows(rows)`` makes the next token fed to
those rows begin a new document: it and its successors see nothing of the row's earlier text, exactly as if
the row had started from an empty memory, while the other rows keep theirs. A compressed slot is seen only if all
it summarises lies in the row's current document (the rule of :func:`xl.documents.key_offsets`): a document that
begins on a group boundary reads exactly as from an empty memory; otherwise the group across its start is hidden.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from xl.documents import Documents, key_offsets, positions
from xl.memory import split_memory
from xl.model import TransformerXL, check_compressive, check_context, relative_embeddings


class IncrementalDecoder:
    """Per layer: keys/values of the positions a new token attends to, the projected relative embeddings
    (multiplied by the attention scale) and the stacked query/key/value weight; with a compressed memory also the
    layer inputs of the memory's states (the compressor's input) and a learned compressor's matrix. All come from
    the weights at construction: build a new decoder (:meth:`TransformerXL.decoder`) after changing them."""

    def __init__(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int, same_length: bool) -> None:
        check_context(window, clamp_len, same_length)
        cfg = model.config
        if cfg.cmem_len:
            check_compressive(cfg.cmem_len, cfg.cmem_rate, cfg.cmem_fn, same_length)
        if window < 1:
            raise ValueError("incremental decoding needs a memory: set mem_len (the decoder's window) >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.batch_size, self.window = model.eval(), batch_size, window
        self.clamp_len, self.same_length = clamp_len, same_length
        # Cached positions a new token attends to: same_length counts the token itself among the window.
        self.visible = window - 1 if same_length else window
        self.rate = cfg.cmem_rate if cfg.cmem_len else 1
        # The most keys a token sees before itself: the window, then states waiting for their group, then slots.
        self.reach = self.visible + (cfg.cmem_len + self.rate - 1 if cfg.cmem_len else 0)
        pos_emb = relative_embeddings(self.reach + 1, clamp_len, cfg.d_model, model.device).to(model.dtype)
        with torch.no_grad():
            # [H, D, reach+1] per layer; a token with m visible keys uses the last m+1 columns (distances
            # m .. 0). Multiplied by the attention scale once here, so that no step scales its position scores.
            self.r = [layer.attn.project_positions(pos_emb) * layer.attn.scale for layer in model.layers]
            self.qkv_weight = [layer.attn.qkv_weight() for layer in model.layers]
            compressor = model.compressor
            self.cmem_matrix = ([compressor.matrix(n) for n in range(cfg.n_layer)] if compressor is not None
                                and compressor.learned else [None] * cfg.n_layer)
        # Keys/values live in buffers twice as long as the keys a token sees: a token's key is written in place
        # after the visible ones, and only when a buffer is full are those moved back to the front (once every
        # `window` tokens or more). Layout: buf[lo:start] compressed slots (oldest first), buf[start:end] the
        # memory's states.
        size = 2 * (self.reach + 1)
        shape = (batch_size, cfg.n_head, size, cfg.d_head)
        self.k_buf = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layer)]
        self.v_buf = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layer)]
        self.h_buf = [torch.zeros(batch_size, size, cfg.d_model, dtype=model.dtype, device=model.device)
                      for _ in range(cfg.n_layer)] if cfg.cmem_len else None
        self.lo = self.start = self.end = 0
        # Per row, the buffer index where its current document begins: keys before it are hidden (host-side, so a
        # step knows without a device read whether any row needs a mask).
        self.doc_start = np.zeros(batch_size, dtype=np.int64)

    @property
    def slots(self) -> int:
        """Compressed slots held (the first keys)."""
        return self.start - self.lo

    @torch.no_grad()
    def prefill(self, tokens: Tensor, seg_len: int, starts: Tensor | None = None) -> Tensor:
        """Start a new text: read ``tokens`` [B, T] with the model's forward in segments of ``seg_len``,
        carrying a memory of ``window`` positions (the decoder's clamp_len and same_length); the cache becomes
        that memory's keys and values. Returns the logits [B, vocab] after the last token.

        ``starts`` [B, T] (bool): where further documents begin inside the prompt (its first token always begins
        one); each token then sees only its own document."""
        if tokens.dim() != 2 or tokens.size(0) != self.batch_size or tokens.size(1) < 1:
            raise ValueError(f"prefill needs tokens [{self.batch_size}, T >= 1] (this decoder's batch size), "
                             f"got {tuple(tokens.shape)}")
        if seg_len < 1:
            raise ValueError(f"seg_len must be >= 1, got {seg_len}")
        if starts is not None and starts.shape != tokens.shape:
            raise ValueError(f"starts must have the prompt's shape {tuple(tokens.shape)}, got {tuple(starts.shape)}")
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
        self.end = kv[0][0].size(2)  # the compressed slots, then the last min(T, window) positions
        self.start = self.end - min(tokens.size(1), self.visible)
        self.lo = 0 if self.h_buf is not None else self.start
        if self.h_buf is not None:
            for h_buf, mem in zip(self.h_buf, mems, strict=True):
                states = split_memory(mem, self.window, self.model.config.cmem_len)[1]
                h_buf[:, self.start:self.end] = states
        last = tokens.size(1) - 1 if pos is None else pos[:, -1].cpu().numpy()
        self.doc_start = self.end - 1 - np.broadcast_to(last, (self.batch_size,)).astype(np.int64)
        return out.logits[:, -1]

    def reset_rows(self, rows: Tensor) -> None:
        """The next token fed to each row where ``rows`` [B] (bool) is True begins a new document: from then on
        those rows see none of their earlier text (as after a :meth:`prefill` from nothing); the others keep it."""
        if rows.shape != (self.batch_size,):
            raise ValueError(f"reset_rows takes one flag per row, [{self.batch_size}], got {tuple(rows.shape)}")
        self.doc_start[rows.cpu().numpy().astype(bool)] = self.end

    @torch.no_grad()
    def feed(self, tokens: Tensor) -> Tensor:
        """Read one token per row, ``tokens`` [B]; return the logits [B, vocab] of the token after it.
        Without a :meth:`prefill` the text starts here, with an empty memory."""
        if tokens.shape != (self.batch_size,):
            raise ValueError(f"feed takes one token per row, [{self.batch_size}], got {tuple(tokens.shape)}")
        model = self.model
        h = model.embed(tokens[:, None]) * model.emb_scale
        if self.end == self.k_buf[0].size(2):
            self._move_to_front()
        m = self.end - self.lo
        cache = slice(self.lo, self.end + 1)  # the visible keys and the slot for the new one
        masked_keys = self._masked_keys(h.device)
        for n, layer in enumerate(model.layers):
            if self.h_buf is not None:
                self.h_buf[n][:, self.end] = h[:, 0]
            h = layer.decode_one(h, self.k_buf[n][:, :, cache], self.v_buf[n][:, :, cache],
                                 self.r[n][..., self.reach - m:], self.qkv_weight[n], masked_keys)
        self.end += 1
        if self.h_buf is None:
            self.start = self.lo = max(self.start, self.end - self.visible)
        elif self.end - self.start == self.window + self.rate:
            self._compress()
        return model.head(model.final_norm(h))[:, -1]

    def _masked_keys(self, device: torch.device) -> Tensor | None:
        """[B, m+1] True for the keys a row's new token must not see (those before its document's start, a
        compressed slot counted from where its group is taken to begin); None when no row hides any key."""
        earliest = self.start - self.slots * self.rate  # where the oldest visible key begins
        if not (self.doc_start > earliest).any():
            return None
        begins = self.end + key_offsets(self.end - self.lo, 1, device, self.slots, self.rate)  # buffer indices
        return begins < torch.from_numpy(self.doc_start).to(device)[:, None]

    def _compress(self) -> None:
        """The oldest ``rate`` states left the window: compress them into one slot per layer, placed after the
        slots kept (at most ``cmem_len - 1`` of them, moved up to stay contiguous with the memory)."""
        cfg = self.model.config
        rate, kept = self.rate, min(self.slots, cfg.cmem_len - 1)
        slot = self.start + rate - 1  # the newest group state's index: the slot takes its place
        for n, layer in enumerate(self.model.layers):
            group = self.h_buf[n][:, self.start:self.start + rate]
            state = self.model.compressor(n, group, self.cmem_matrix[n]).to(cfg.memory_dtype(group.dtype))
            k, v = layer.attn.project_memory(state)
            for buf, new in ((self.k_buf[n], k), (self.v_buf[n], v)):
                buf[:, :, slot - kept:slot] = buf[:, :, self.start - kept:self.start].clone()
                buf[:, :, slot] = new[:, :, 0]
        self.start += rate
        self.lo = self.start - kept - 1

    def _move_to_front(self) -> None:
        """Move the visible keys/values (at most ``reach``, at the end of full buffers at least twice that long) to
        the front: source and destination never overlap, so one copy each."""
        keep = self.end - self.lo
        for buf in self.k_buf + self.v_buf:
            buf[:, :, :keep].copy_(buf[:, :, self.lo:self.end])
        for buf in self.h_buf or []:
            buf[:, :keep].copy_(buf[:, self.lo:self.end])
        self.doc_start -= self.lo
        self.start -= self.lo
        self.lo, self.end = 0, keep
