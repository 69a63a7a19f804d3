"""Memory tokens: the Recurrent Memory Transformer (Bulatov, Kuratov and Burtsev, NeurIPS 2022) in its decoder-only
form, optionally on top of the Transformer-XL cache. The authors' LM-RMT code puts the tokens on Transformer-XL with
another layout (its read and write tokens see only their own block, and its cache takes them in);
docs/memory-tokens.md lists every difference.

A segment of ``L`` text tokens gets ``n = num_tokens`` memory tokens at each end; the layers run over

    read_1 … read_n ∘ x_1 … x_L ∘ write_1 … write_n          (L + 2n positions, causal attention)

after the Transformer-XL cache, which holds text states only (the last ``mem_len`` layer inputs of text positions;
``mem_len = 0``: memory tokens alone). The read tokens come first, so every text token sees them; the write tokens
come last, so they see the whole segment (and the read tokens, and the cache). Both ends take the same input, the
memory: the last layer's outputs at the previous segment's write positions (before the final layer norm), or, for a
row's first segment, ``n`` learned initial vectors. The next segment's read tokens take this segment's write outputs.

Positions: the keys of a layer are ``cache ∘ read ∘ text ∘ write``, and relative distances are counted along that
sequence, as Transformer-XL counts them along ``cache ∘ segment``: text token i sees read token j at distance
``n - j + i`` and the cached text at its text distance plus ``n``. Cost: ``L + 2n`` positions per segment instead of
``L`` (the feed-forward and projections scale with it, attention with ``(L + 2n)(M + L + 2n)``); the memory's state is
the cache plus one ``[B, n, d]`` tensor.

Gradients: with ``memory.grad_segments = k`` the written memory stays in the graph for the k segments of a window
(the cache with it, as for the plain memory), so the loss of a later segment teaches the write tokens what to keep;
with k = 1 no gradient reaches the write positions at all (their outputs only feed the next segment).

Documents (``memory.doc_boundaries=reset``): each position has a document coordinate along the text (the cache
``-M … -1``, the read tokens 0, the text ``0 … L-1``, the write tokens ``L-1``), and a query sees only keys at or after
the start of its own document. The read tokens belong to the document of the segment's first token (so they are hidden
from a document that begins later in the segment) and the write tokens to that of its last token. Where a document
begins at a segment's first token the row's read tokens are the learned initial values; where the segment's last
document began after its first token, the write tokens start from the initial values too. So a document that begins at
a segment boundary reads exactly as alone from an empty memory, and one that begins inside a segment reads nothing of
the text before it: its first, partial segment sees no memory tokens, and its write tokens summarise its own text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from xl.memory.cache import CacheMemory
from xl.model.documents import Documents
from xl.model.eviction import leaving
from xl.model.memory import Context, Memory, Segment, Size, Update
from xl.model.memory_settings import MemoryConfig
from xl.settings.bounds import at_least, setting

if TYPE_CHECKING:
    from collections.abc import Callable

    from xl.memory.token_decoding import TokenDecoder
    from xl.model.config import XLConfig
    from xl.model.transformer import TransformerXL


@dataclass
class TokensConfig(MemoryConfig):
    """``memory=tokens``: memory tokens over the cache (``memory.mem_len=0``: the tokens alone)."""

    num_tokens: int = setting(4, bound=at_least(1), help="memory tokens read at each segment's start and written at "
                                                         "its end; the layers run over data.tgt_len + 2 num_tokens "
                                                         "positions")
    #: The text tokens between two writes when decoding one token at a time: the training segment length.
    seg_len: int = field(default=0, metadata={"from": "data.tgt_len"})

    name = "tokens"
    reads_afresh = False  # the memory is written segment by segment: a window read afresh has none

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.seg_len, int) or self.seg_len < 1:
            raise ValueError(f"TokensConfig.seg_len (the training segment length, between two writes of the memory "
                             f"tokens) must be a positive integer, got {self.seg_len!r}")

    def memory(self, config: XLConfig) -> TokenMemory:
        return TokenMemory(config)

    def check_context(self, same_length: bool) -> None:
        if same_length:
            raise ValueError("same_length counts a window of keys that the memory tokens would break up; set "
                             "memory.same_length=false and memory.eval_same_length=false with memory=tokens")

    def check_window(self, grad_segments: int, mem_len: int) -> None:
        """The written tokens carry the gradient, with or without a cache."""

    def held(self, mem_len: int, grad_segments: int, n_layer: int) -> list[float]:
        """The read tokens hold what the previous segment's write tokens saw, and so on back: with windows of
        ``grad_segments`` > 1 training teaches them to carry a token, with no bound on how far (a recurrence); with 1 no
        gradient reaches the write tokens, and only the cache holds."""
        return [math.inf if grad_segments > 1 else mem_len] * n_layer


class InitialTokens(nn.Module):
    """The memory's learned initial values, ``[n, d]``, drawn at the scale of the embedded inputs (embedding std 0.02
    times the model's ``sqrt(d_model)``)."""

    def __init__(self, n: int, d_model: int) -> None:
        super().__init__()
        self.values = nn.Parameter(torch.randn(n, d_model) * 0.02 * d_model ** 0.5)


def document_coordinates(pos: Tensor, n: int) -> Tensor:
    """Per query of ``read ∘ text ∘ write`` [B, L + 2n], the text coordinate where its document begins (0: the
    segment's first text token), from the text's positions in their documents ``pos`` [B, L]."""
    L = pos.size(1)
    first = torch.arange(L, device=pos.device) - pos
    return torch.cat([first[:, :1].expand(-1, n), first, first[:, -1:].expand(-1, n)], dim=1)


class TokenMemory(Memory):
    """``num_tokens`` memory tokens read at each segment's start and written at its end, over the Transformer-XL cache
    of text states. State: the cache's ``n_layer`` tensors [B, M, d], then the memory [B, num_tokens, d]. It is its
    own :class:`~xl.model.memory.SegmentPositions` (``inputs``, ``mask``): n read positions before the text, n write
    positions after it."""

    def __init__(self, config: XLConfig) -> None:
        super().__init__(config)
        self.settings: TokensConfig = config.memory
        self.n = self.settings.num_tokens
        self.cache = CacheMemory(config)
        self.initial: InitialTokens | None = None
        # The memory adds n read positions before the segment and n write positions after it (SegmentPositions).
        self.positions, self.before, self.after = self, self.n, self.n

    def build(self) -> dict[str, nn.Module]:
        self.initial = InitialTokens(self.n, self.config.d_model)
        return {"memory_tokens": self.initial}

    # ---- state -----------------------------------------------------------------------------------------------------
    def initial_values(self, batch: int, dtype: torch.dtype) -> Tensor:
        """The learned initial memory for ``batch`` rows, [B, n, d] (a view of the weights: in the graph)."""
        return self.initial.values.to(dtype)[None].expand(batch, -1, -1)

    def init(self, batch: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        return self.cache.init(batch, device, dtype) + [self.initial_values(batch, dtype)]

    def context(self, state: list[Tensor]) -> Context:
        return self.cache.context(state[:-1])

    def size(self, mem_len: int, seg_len: int | None = None) -> Size:
        """The cache, and the memory once (not per layer); evaluation carries the cache's keys/values only, the
        tokens are run anew each segment."""
        return Size(vectors=self.config.n_layer * mem_len + self.n, keys=mem_len)

    # ---- one segment -----------------------------------------------------------------------------------------------
    def inputs(self, state: list[Tensor], h: Tensor, documents: Documents | None) -> Tensor:
        """``read ∘ h ∘ write``, both ends the memory (or, per row, the learned initial values where a document
        begins)."""
        memory = state[-1].to(h.dtype)
        read = write = memory
        if documents is not None:
            initial = self.initial_values(h.size(0), h.dtype)
            pos = documents.pos
            read = torch.where((pos[:, 0] == 0)[:, None, None], initial, memory)
            # The last document began after the first token: its write tokens start from the initial values.
            began_later = (pos.size(1) - 1 - pos[:, -1]) > 0
            write = torch.where(began_later[:, None, None], initial, read)
        return torch.cat([read, h, write], dim=1)

    def mask(self, mask: Tensor, documents: Documents | None, context: Context) -> Tensor:
        """The causal mask [L + 2n, M + L + 2n]; with documents, per row, the keys before each query's document start
        hidden too ([B, 1, L + 2n, M + L + 2n])."""
        if documents is None or context.length + documents.latest_start <= 0:
            return mask  # no query's document begins after any key it could see
        pos = documents.pos
        first = document_coordinates(pos, self.n)  # [B, Q]
        keys = self.key_coordinates(context.length, pos.size(1), pos.device)  # [K]
        hidden = keys < first[..., None]
        return torch.where(hidden, float("-inf"), mask)[:, None]

    def key_coordinates(self, m_len: int, L: int, device: torch.device) -> Tensor:
        """Per key of ``cache ∘ read ∘ text ∘ write``, its text coordinate: ``-M … -1``, 0 (read), ``0 … L-1``,
        ``L-1`` (write)."""
        n = self.n
        return torch.cat([torch.arange(-m_len, 0, device=device), torch.zeros(n, dtype=torch.long, device=device),
                          torch.arange(L, device=device), torch.full((n,), L - 1, device=device)])

    def update(self, state: list[Tensor], segment: Segment) -> Update:
        n, outputs = self.n, segment.outputs
        L = outputs.size(1) - 2 * n
        text = [x[:, n:n + L] for x in segment.layer_inputs]
        cache = self.cache.update(state[:-1], segment.but(layer_inputs=text, keep_kv=False)).state
        # A fresh tensor: callers may clean it in place.
        memory = self.written(outputs[:, n + L:], segment.layers.final_norm).to(segment.dtype, copy=True)
        if not segment.attached:
            memory = memory.detach()
        kept = None
        if segment.keep_kv:
            kept = [self.kept_kv(k, v, state[0].size(1), L, segment.mem_len) for k, v in segment.kv]
        return Update(cache + [memory], kept)

    def written(self, outputs: Tensor, final_norm: Callable[[Tensor], Tensor]) -> Tensor:
        """The memory [B, n, d] from the last layer's outputs at the write positions [B, n, d]: those outputs, before
        the model's ``final_norm`` (a layout that writes otherwise says so here; the decoder asks the same)."""
        return outputs

    def kept_kv(self, k: Tensor, v: Tensor, m_len: int, L: int, mem_len: int) -> tuple[Tensor, Tensor]:
        """The keys/values of the cache after a segment, sliced from a layer's over ``cache ∘ read ∘ text ∘ write``
        [B, H, M + L + 2n, D]: the newest ``mem_len`` of the text positions."""
        gone = leaving(m_len + L, mem_len)
        text = slice(m_len + self.n + max(0, gone - m_len), m_len + self.n + L)
        if gone >= m_len:
            return k[:, :, text], v[:, :, text]
        return (torch.cat([k[:, :, gone:m_len], k[:, :, text]], dim=2),
                torch.cat([v[:, :, gone:m_len], v[:, :, text]], dim=2))

    # ---- decoding --------------------------------------------------------------------------------------------------
    def decoder(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int,
                same_length: bool) -> TokenDecoder:
        """A one-token decoder that reads and writes the memory tokens as the forward pass does
        (:class:`xl.memory.token_decoding.TokenDecoder`)."""
        from xl.memory.token_decoding import TokenDecoder  # generation only

        return TokenDecoder(model, batch_size, window, clamp_len, same_length)
