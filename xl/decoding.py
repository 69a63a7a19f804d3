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

Documents (``memory.doc_boundaries=reset``, :mod:`xl.documents`): ``prefill(tokens, seg_len, starts)`` reads a
prompt that holds several documents as the forward does, and ``reset_rows(rows)`` makes the next token fed to
those rows begin a new document: it and its successors see nothing of the row's earlier text, exactly as if
the row had started from an empty memory, while the other rows keep theirs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from xl.documents import Documents, positions
from xl.model import TransformerXL, check_context, relative_embeddings


class IncrementalDecoder:
    """Per layer: keys/values of the positions a new token attends to, the projected relative embeddings
    (multiplied by the attention scale) and the stacked query/key/value weight. All come from the weights
    at construction: build a new decoder (:meth:`TransformerXL.decoder`) after changing them."""

    def __init__(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int, same_length: bool) -> None:
        check_context(window, clamp_len, same_length)
        if window < 1:
            raise ValueError("incremental decoding needs a memory: set mem_len (the decoder's window) >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.batch_size, self.window = model.eval(), batch_size, window
        self.clamp_len, self.same_length = clamp_len, same_length
        # Cached positions a new token attends to: same_length counts the token itself among the window.
        self.visible = window - 1 if same_length else window
        cfg = model.config
        pos_emb = relative_embeddings(window + 1, clamp_len, cfg.d_model, model.device).to(model.dtype)
        with torch.no_grad():
            # [H, D, window+1] per layer; a token with m visible keys uses the last m+1 columns (distances
            # m .. 0). Multiplied by the attention scale once here, so that no step scales its position scores.
            self.r = [layer.attn.project_positions(pos_emb) * layer.attn.scale for layer in model.layers]
            self.qkv_weight = [layer.attn.qkv_weight() for layer in model.layers]
        # Keys/values live in buffers twice the window long: a token's key is written in place after the
        # visible ones, and only when a buffer is full are those moved back to the front (once every
        # `window` tokens or more).
        shape = (batch_size, cfg.n_head, 2 * window, cfg.d_head)
        self.k_buf = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layer)]
        self.v_buf = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layer)]
        self.start = self.end = 0  # the visible keys are buf[:, :, start:end]
        # Per row, the buffer index where its current document begins: keys before it are hidden (host-side, so a
        # step knows without a device read whether any row needs a mask).
        self.doc_start = np.zeros(batch_size, dtype=np.int64)

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
        self.end = kv[0][0].size(2)  # the last min(T, window) positions
        self.start = max(0, self.end - self.visible)
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
        m = self.end - self.start
        cache = slice(self.start, self.end + 1)  # the visible keys and the slot for the new one
        masked_keys = None
        if (self.doc_start > self.start).any():  # some row's document began inside the window
            keys = torch.arange(self.start, self.end + 1, device=h.device)
            masked_keys = keys < torch.from_numpy(self.doc_start).to(h.device)[:, None]
        for n, layer in enumerate(model.layers):
            h = layer.decode_one(h, self.k_buf[n][:, :, cache], self.v_buf[n][:, :, cache],
                                 self.r[n][..., self.window - m:], self.qkv_weight[n], masked_keys)
        self.end += 1
        self.start = max(self.start, self.end - self.visible)
        return model.head(model.final_norm(h))[:, -1]

    def _move_to_front(self) -> None:
        """Move the visible keys/values (at most ``window``, at the end of full buffers twice that long) to
        the front: source and destination never overlap, so one copy each."""
        keep = self.end - self.start
        for buf in self.k_buf + self.v_buf:
            buf[:, :, :keep].copy_(buf[:, :, self.start:self.end])
        self.doc_start -= self.start
        self.start, self.end = 0, keep
