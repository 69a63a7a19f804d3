"""Memory tokens laid out as the Recurrent Memory Transformer's own models (``memory=rmt``): the code of the BABILong
and "Scaling Transformer to 1M tokens" papers, github.com/booydar/recurrent-memory-transformer,
``modeling_rmt/language_modeling.py`` (``MemoryCell``, ``RecurrentWrapper``).

Each segment runs as ``memory ∘ segment ∘ memory`` through a causal decoder, with no cache between segments; the new
memory is the base model's last hidden state at the write positions, ``hidden_states[-1][:, -n:]``, which in the
decoders it wraps (GPT-2, GPT-NeoX) is taken after their final layer norm. A row's first segment reads ``n`` learned
vectors drawn at the scale of the input embeddings.

This is :mod:`xl.memory.tokens` with one change, what the write positions leave as the memory: here the last layer's
outputs through the model's final layer norm (:attr:`xl.model.transformer.TransformerXL.final_norm`, the identity for
a post-LN model, where the two layouts coincide), there the outputs before it. ``conf/memory/rmt.yaml`` sets no cache
(``memory.mem_len=0``), as in those models; a cache beneath the tokens is allowed (``memory.mem_len > 0``), and is
then this project's own addition. Decoding, documents, gradients through windows and the refusals are those of
memory tokens (docs/memory-tokens.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from xl.memory.tokens import TokenMemory, TokensConfig

if TYPE_CHECKING:
    from xl.model.config import XLConfig


@dataclass
class RMTConfig(TokensConfig):
    """``memory=rmt``: memory tokens whose written memory is the last layer's normed states, as RMT's models write it
    (``memory.mem_len=0``: no cache, as there)."""

    name = "rmt"

    def memory(self, config: XLConfig) -> RMTMemory:
        return RMTMemory(config)


class RMTMemory(TokenMemory):
    """Memory tokens (:class:`xl.memory.tokens.TokenMemory`) whose memory is the write positions' last-layer states
    after the model's final layer norm."""

    def written(self, outputs: Tensor, final_norm: Callable[[Tensor], Tensor]) -> Tensor:
        return final_norm(outputs)
