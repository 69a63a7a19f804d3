"""One-token decoding of a model with memory tokens (:mod:`xl.memory.tokens`), the decoder that
:meth:`xl.model.transformer.TransformerXL.decoder` returns for such a model.

The forward pass reads text in segments of ``L = memory.seg_len`` tokens (the training segment length) with the memory
tokens at both ends, so the decoder follows the same segments: each fed token attends over the cache as it stood at its
segment's start (``window`` text positions at most), the segment's read tokens, and the segment's text up to itself;
when ``L`` tokens of a segment have been fed, the write tokens are run (one position each, as the forward's causal
attention reads them), their last-layer outputs become the memory, and the cache moves on to the newest ``window`` text
positions. The next segment's read tokens are run just before its first token, once :meth:`TokenDecoder.reset_rows`
has said which rows begin a document there. So each fed token gets exactly the logits of the forward pass read in
segments of ``L`` with ``mem_len = window``; a step costs one position per token, plus ``2n`` positions once per
segment. Keys and values carry no position, so each is projected once, when its position is run.

Documents: ``prefill(tokens, seg_len, starts)`` and ``reset_rows(rows)`` follow the forward's rule
(:mod:`xl.memory.tokens`): a document that begins at a segment's first token gets the learned initial memory; one
that begins inside a segment sees nothing before it, memory tokens included, and its write tokens start from the
initial values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from xl.model.decoding import NO_DOCUMENT_START, Decoder
from xl.model.documents import Documents, positions
from xl.model.eviction import leaving
from xl.model.positions import relative_embeddings

if TYPE_CHECKING:
    from xl.model.transformer import TransformerXL



class TokenDecoder(Decoder):
    """Per layer: keys/values of ``cache ∘ read ∘ text ∘ write`` of the current segment in one buffer, the projected
    relative embeddings (times the attention scale) and the stacked query/key/value weight, made from the weights at
    construction; the memory [B, n, d]. Build a new decoder after changing the weights."""

    def __init__(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int, same_length: bool) -> None:
        super().__init__(model, batch_size, window, clamp_len, same_length)
        memory = self.memory = model.memory  # batch_size and the context: checked by TransformerXL.decoder
        cfg = model.config
        self.n, self.period = memory.n, memory.settings.seg_len
        self.size = window + self.period + 2 * self.n  # the most keys a position sees, itself included
        pos_emb = relative_embeddings(self.size, clamp_len, cfg.d_model, model.device).to(model.dtype)
        with torch.no_grad():
            self.r = [layer.attn.project_positions(pos_emb) * layer.attn.scale for layer in model.layers]
            self.qkv_weight = [layer.attn.qkv_weight() for layer in model.layers]
        shape = (batch_size, cfg.n_head, self.size, cfg.d_head)
        self.k_buf = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layer)]
        self.v_buf = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.n_layer)]
        self.mem_dtype = cfg.memory_dtype(model.dtype)
        self._start(memory.init(batch_size, model.device, model.dtype)[-1], 0)

    def _start(self, memory: Tensor, m_len: int) -> None:
        """A segment begins: ``m_len`` cached keys in the buffers, the memory to read, no text fed yet."""
        self.values = memory.detach()
        self.m, self.i, self.read_inputs = m_len, 0, None
        # Per row, the text coordinate (0: this segment's first token) where its current document begins.
        self.first = np.full(self.batch_size, NO_DOCUMENT_START, dtype=np.int64)

    def _prefill(self, tokens: Tensor, seg_len: int | None, starts: Tensor | None) -> Tensor:
        """The prompt read with the model's forward in segments of the training length (``memory.seg_len``, the
        memory's period: ``seg_len`` does not apply to memory tokens), then the tokens after the last whole segment
        fed one by one."""
        model, period = self.model, self.period
        pos = None if starts is None else positions(starts)
        whole = tokens.size(1) // period * period
        state = kv = logits = None
        for s in range(0, whole, period):
            documents = None if pos is None else Documents.from_positions(pos[:, s:s + period])
            out = model(tokens[:, s:s + period], state, mem_len=self.window, clamp_len=self.clamp_len,
                        cache_kv=True, kv=kv, documents=documents)
            state, kv, logits = out.mems, out.kv, out.logits[:, -1]
        if state is None:
            self._start(self.memory.init(self.batch_size, model.device, model.dtype)[-1], 0)
        else:
            for k_buf, v_buf, (k, v) in zip(self.k_buf, self.v_buf, kv, strict=True):
                k_buf[:, :, :k.size(2)] = k
                v_buf[:, :, :v.size(2)] = v
            self._start(state[-1].to(model.dtype), kv[0][0].size(2))
            if pos is not None:  # the last token's document, counted from the next segment's first token
                self.first = -1 - pos[:, whole - 1].cpu().numpy().astype(np.int64)
        for t in range(whole, tokens.size(1)):
            if starts is not None and (t == 0 or starts[:, t].any()):
                self.reset_rows(starts[:, t] if t else torch.ones(self.batch_size, dtype=torch.bool))
            logits = self.feed(tokens[:, t])
        return logits

    def _reset_rows(self, rows: Tensor) -> None:
        self.first[rows.cpu().numpy().astype(bool)] = self.i

    def _feed(self, tokens: Tensor) -> Tensor:
        model = self.model
        if self.read_inputs is None:
            self._read()
        h = self._step(model.embed(tokens[:, None]) * model.emb_scale, self.m + self.n + self.i)
        self.i += 1
        logits = model.head(model.final_norm(h))[:, -1]
        if self.i == self.period:
            self._write()
        return logits

    def _step(self, h: Tensor, index: int) -> Tensor:
        """Run one position per row [B, 1, d] at buffer slot ``index`` through every layer; its last-layer output."""
        masked = self._masked_keys(index)
        r = slice(self.size - 1 - index, None)  # distances index … 0
        for n, layer in enumerate(self.model.layers):
            h = layer.decode_one(h, self.k_buf[n][:, :, :index + 1], self.v_buf[n][:, :, :index + 1],
                                 self.r[n][..., r], self.qkv_weight[n], masked)
        return h

    def _masked_keys(self, index: int) -> Tensor | None:
        """[B, index + 1] True for the keys before a row's document start; None when no row hides any."""
        lowest = -self.m if self.m else 0  # the smallest coordinate of a key in the buffer
        if not (self.first > lowest).any():
            return None
        first = torch.from_numpy(self.first).to(self.model.device)
        return self.coordinates[:index + 1][None] < first[:, None]

    def _read(self) -> None:
        """Run the segment's read tokens: the memory, or the initial values where a row's document begins here."""
        # Each buffer slot's text coordinate: the documents' rule of the forward (xl.memory.tokens.key_coordinates).
        self.coordinates = self.memory.key_coordinates(self.m, self.period, self.model.device)
        begins = torch.from_numpy(self.first == 0).to(self.model.device)[:, None, None]
        initial = self.memory.initial_values(self.batch_size, self.model.dtype)
        self.read_inputs = torch.where(begins, initial, self.values)
        for j in range(self.n):
            self._step(self.read_inputs[:, j:j + 1], self.m + j)

    def _write(self) -> None:
        """The segment is complete: run the write tokens, keep their outputs as the memory, and move the cache to the
        newest ``window`` text positions."""
        m, n, L = self.m, self.n, self.period
        began_later = torch.from_numpy(self.first > 0).to(self.model.device)[:, None, None]
        initial = self.memory.initial_values(self.batch_size, self.model.dtype)
        inputs = torch.where(began_later, initial, self.read_inputs)
        outputs = [self._step(inputs[:, j:j + 1], m + n + L + j) for j in range(n)]
        written = self.memory.written(torch.cat(outputs, dim=1), self.model.final_norm)
        memory = written.to(self.mem_dtype).to(self.model.dtype)
        gone = leaving(m + L, self.window)
        kept = [*range(gone, m), *range(m + n + max(0, gone - m), m + n + L)]
        index = torch.tensor(kept, dtype=torch.long, device=self.model.device)
        for buf in self.k_buf + self.v_buf:
            buf[:, :, :len(kept)] = buf.index_select(2, index)
        first = self.first - L
        self._start(memory, len(kept))
        self.first = first
