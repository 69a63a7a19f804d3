"""Memory tokens laid out as the models of LM-RMT that learnt (``memory=lmrmt``): the authors' Transformer-XL code
for the Recurrent Memory Transformer (Bulatov, Kuratov and Burtsev, NeurIPS 2022), github.com/booydar/LM-RMT at
commit e2895080868afc390386220f2b68a56c4a218126, ``pytorch/mem_transformer.py`` (``MemTransformerLM``) as
``pytorch/train.py`` runs it with ``--mem_at_end --read_mem_from_cache``.

A segment of ``L`` text tokens runs as ``read_1 … read_n ∘ x_1 … x_L ∘ write_1 … write_n`` after the cache, as in
:mod:`xl.memory.tokens`; what differs is what LM-RMT's code does:

- the attention mask (``_forward``'s ``dec_attn_mask``): causal, except that the read tokens see one another in full
  and the write tokens see one another in full (an ``n × n`` block of full attention at each end); every position
  sees the cache (``read_mem_from_cache``);
- the cache (``_update_mems``): the last ``mem_len`` layer inputs of ``cache ∘ read ∘ text ∘ write``, so the write
  tokens' states are its newest entries and the next segment's read tokens reach them through it;
- the position term (``RelMultiHeadAttn._rel_shift``): a key at or before the query gets its distance along
  ``cache ∘ read ∘ text ∘ write``; a key after it (inside a block) gets what the shift leaves there, 0 for the next
  key and the following query's term of another distance beyond it (:func:`xl.model.attention.rel_shift`), as in
  LM-RMT's code;
- the initial memory (``init_mem_tokens``): one N(0, 1) vector repeated ``n`` times, then learned as ``n`` vectors.

The read and the write tokens take the same input, the memory: the last layer's outputs at the previous segment's
write positions (``hidden[-num_mem:]``; LM-RMT's models have no final norm), or the initial memory for a row's first
segment. Documents are refused: LM-RMT reads one endless text per row. Decoding one token at a time runs the forward
over the segment read so far (:class:`LMRMTDecoder`): the blocks of full attention cannot be run one position at a
time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from xl.memory.tokens import TokenMemory, TokensConfig
from xl.model.decoding import Decoder
from xl.model.documents import Documents
from xl.model.memory import Context, Segment, Size, Update

if TYPE_CHECKING:
    from xl.model.config import XLConfig
    from xl.model.transformer import TransformerXL

NO_DOCUMENTS = "memory=lmrmt reads one endless text per row, as LM-RMT; set memory.doc_boundaries=ignore"


@dataclass
class LMRMTConfig(TokensConfig):
    """``memory=lmrmt``: memory tokens with LM-RMT's blocks of full attention, cache and initial memory."""

    #: Whether a token sees only its own document: refused, LM-RMT reads one endless text per row.
    doc_boundaries: str = field(default="ignore", metadata={"from": "memory.doc_boundaries"})

    name = "lmrmt"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.doc_boundaries == "reset":
            raise ValueError(NO_DOCUMENTS)

    def memory(self, config: XLConfig) -> LMRMTMemory:
        return LMRMTMemory(config)


class RepeatedInitial(nn.Module):
    """LM-RMT's initial memory: one vector drawn from N(0, 1), repeated ``n`` times, ``[n, d]`` learned values."""

    def __init__(self, n: int, d_model: int) -> None:
        super().__init__()
        self.values = nn.Parameter(torch.randn(1, d_model).repeat(n, 1))


class LMRMTMemory(TokenMemory):
    """Memory tokens as LM-RMT lays them out. State: the cache's ``n_layer`` tensors [B, M, d] (layer inputs of read,
    text and write positions), then the memory [B, n, d]."""

    def build(self) -> dict[str, nn.Module]:
        self.initial = RepeatedInitial(self.n, self.config.d_model)
        return {"memory_tokens": self.initial}

    def size(self, mem_len: int, seg_len: int | None = None) -> Size:
        """The cache (read, text and write positions alike), and the memory once."""
        return Size(vectors=self.config.n_layer * mem_len + self.n, keys=mem_len)

    def inputs(self, state: list[Tensor], h: Tensor, documents: Documents | None) -> Tensor:
        if documents is not None:
            raise ValueError(NO_DOCUMENTS)
        return super().inputs(state, h, None)

    def mask(self, mask: Tensor, documents: Documents | None, context: Context) -> Tensor:
        """The causal mask [L + 2n, M + L + 2n] with the read block and the write block in full view."""
        if documents is not None:
            raise ValueError(NO_DOCUMENTS)
        n, M = self.n, context.length
        mask = mask.clone()
        mask[:n, M:M + n] = 0
        mask[-n:, -n:] = 0
        return mask

    def update(self, state: list[Tensor], segment: Segment) -> Update:
        n = self.n
        cache = self.cache.update(state[:-1], segment)
        memory = self.written(segment.outputs[:, -n:], segment.layers.final_norm).to(segment.dtype, copy=True)
        if not segment.attached:
            memory = memory.detach()
        return Update(cache.state + [memory], cache.kv)

    def decoder(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int,
                same_length: bool) -> LMRMTDecoder:
        return LMRMTDecoder(model, batch_size, window, clamp_len, same_length)


class LMRMTDecoder(Decoder):
    """One-token decoding of a model with ``memory=lmrmt``: each fed token runs the forward over its segment's text
    read so far, from the memory as it stood at the segment's start (a text token sees the cache, the read tokens and
    the text before it, none of which a later token changes); a segment's ``memory.seg_len``-th token moves the memory
    on. So each token gets the logits of the forward read in segments, at a cost of the segment so far per token."""

    def __init__(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int, same_length: bool) -> None:
        super().__init__(model, batch_size, window, clamp_len, same_length)
        self.period = model.memory.settings.seg_len
        self.state: list[Tensor] | None = None
        self.text = torch.zeros(batch_size, 0, dtype=torch.long, device=model.device)

    def _run(self, tokens: Tensor) -> Tensor:
        out = self.model(tokens, self.state, mem_len=self.window, clamp_len=self.clamp_len)
        if tokens.size(1) == self.period:
            self.state, self.text = out.mems, tokens[:, :0]
        else:
            self.text = tokens
        return out.logits[:, -1]

    def _prefill(self, tokens: Tensor, seg_len: int | None, starts: Tensor | None) -> Tensor:
        """The prompt read in segments of the training length (``seg_len`` does not apply to memory tokens)."""
        if starts is not None and starts[:, 1:].any():
            raise ValueError(NO_DOCUMENTS)
        self.state, self.text = None, tokens[:, :0]
        for s in range(0, tokens.size(1), self.period):
            logits = self._run(tokens[:, s:s + self.period])
        return logits

    def _reset_rows(self, rows: Tensor) -> None:
        """Documents are refused (:data:`NO_DOCUMENTS`)."""
        if bool(rows.any()):
            raise ValueError(NO_DOCUMENTS)

    def _feed(self, tokens: Tensor) -> Tensor:
        return self._run(torch.cat([self.text, tokens[:, None]], dim=1))
