"""The one segment runner of the benchmarks and the memory probe.

A [B, T] token stream is fed segment by segment through a :class:`~xl.model.transformer.TransformerXL`, the memory
carried from each segment to the next, as training and evaluation read the data. Training runs the step that
:class:`xl.training.loop.module.XLLitModule` runs under Lightning: forward (under autocast for the mixed precisions),
backward (of the loss plus a compressive memory's reconstruction loss), gradient clipping by norm, AdamW, gradients set
to None. The optimizer is fused, except under float16 autocast, where a GradScaler scales the loss and must unscale the
gradients before they are clipped: there, as in the Lightning module, the foreach AdamW runs and the scaler skips
overflowing steps. (The module's guards against non-finite steps are left out: on finite steps they change nothing.) A
test checks that the weights come out bitwise equal to a Lightning run's. Evaluation runs without gradients and carries
the memory's projected keys and values (``cache_kv``), as the module evaluates.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL, XLOutput


def token_stream(cfg: XLConfig, batch: int, tgt_len: int, n_segments: int, seed: int = 0) -> Tensor:
    """Random tokens [B, n_segments·L + 1]: speed does not depend on the text."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, n_segments * tgt_len + 1), generator=gen)


class SegmentRunner:
    """Reads ``tokens`` [B, T] ``tgt_len`` positions at a time, the memory (and in evaluation the cached
    keys/values) carried between segments; training also updates the weights after every segment.

    With ``targets`` each segment's targets are the next tokens, so the inputs cover ``T - 1`` positions; without,
    the inputs cover all ``T`` and no loss is computed. The last segment may be shorter. :meth:`step` wraps round
    to the first segment after the last one, keeping the memory, so that a benchmark can time any number of
    segments against a full memory. ``mem_len``, ``clamp_len`` and ``same_length`` override the model's config
    for every call (the evaluation context); ``autocast`` is the mixed-precision dtype (None: none).
    """

    def __init__(self, model: nn.Module, tokens: Tensor, tgt_len: int, *, train: bool = False, targets: bool = True,
                 lr: float = 2.5e-4, clip: float | None = None, autocast: torch.dtype | None = None,
                 mem_len: int | None = None, clamp_len: int | None = None, same_length: bool | None = None,
                 return_logits: bool = False) -> None:
        if tokens.dim() != 2 or tgt_len < 1:
            raise ValueError(f"the runner needs tokens [B, T] and tgt_len >= 1, got {tuple(tokens.shape)} "
                             f"and {tgt_len}")
        if train and not targets:
            raise ValueError("training needs targets: set targets=True")
        inputs = tokens.size(1) - 1 if targets else tokens.size(1)
        if inputs < 1:
            raise ValueError(f"a stream of {tokens.size(1)} tokens has no segment to read; give a longer stream")
        self.model, self.tokens, self.tgt_len, self.targets = model.train(train), tokens, tgt_len, targets
        self.starts = range(0, inputs, tgt_len)
        self.index = 0
        self.mems: list[Tensor] | None = None
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.clip, self.autocast, self.return_logits = clip, autocast, return_logits
        self.context: dict[str, Any] = {k: v for k, v in (("mem_len", mem_len), ("clamp_len", clamp_len),
                                                          ("same_length", same_length)) if v is not None}
        scaled = train and autocast == torch.float16
        self.scaler = torch.amp.GradScaler(tokens.device.type) if scaled else None
        self.optimizer = None
        if train:
            # The module's two groups (matrices, then the rest; no weight decay by default), so that clipping adds
            # up the gradient norms in the same order and the weights come out bitwise the same.
            params = list(model.parameters())
            groups = [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2]}]
            self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0, fused=not scaled,
                                               foreach=True if scaled else None)

    @property
    def n_segments(self) -> int:
        """Segments in one pass over the stream."""
        return len(self.starts)

    def next_segment(self) -> tuple[Tensor, Tensor | None]:
        """The next (inputs, targets) pair, wrapping round after the last; targets None without ``targets``."""
        if self.index == self.n_segments:
            self.index = 0
        start = self.starts[self.index]
        self.index += 1
        end = min(start + self.tgt_len, self.starts.stop)
        return self.tokens[:, start:end], self.tokens[:, start + 1:end + 1] if self.targets else None

    def forward(self, x: Tensor, y: Tensor | None) -> XLOutput:
        """The model on one segment with the carried memory (a subclass may run another model here)."""
        return self.model(x, self.mems, y, return_logits=self.return_logits, cache_kv=self.optimizer is None,
                          kv=self.kv, **self.context)

    def step(self) -> XLOutput:
        """Read the next segment; in training, update the weights from its loss. Returns the model's output."""
        x, y = self.next_segment()
        # As Lightning's mixed-precision plugin: the weights' casts are not cached between uses.
        precision = (torch.autocast(x.device.type, dtype=self.autocast, cache_enabled=False) if self.autocast
                     else nullcontext())
        if self.optimizer is None:
            with torch.no_grad(), precision:
                out = self.forward(x, y)
        else:
            with precision:
                out = self.forward(x, y)
            self.update(out.loss if out.aux_loss is None else out.loss + out.aux_loss)  # as the module trains
        self.mems, self.kv = out.mems, out.kv
        return out

    def update(self, loss: Tensor) -> None:
        """Backward, clipping and the optimizer step, as Lightning runs them for the module."""
        opt, scaler = self.optimizer, self.scaler
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], self.clip)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    def run(self, steps: int) -> XLOutput | None:
        """``steps`` segments (what the benchmarks time); the last one's output."""
        out = None
        for _ in range(steps):
            out = self.step()
        return out


def one_token_decoder(model: TransformerXL, batch: int, attn_len: int) -> Callable[[Tensor], Tensor]:
    """Generation's decoder with ``attn_len`` positions of random context already read (a full window); returns
    its one-token step (tokens [B] → next-token logits [B, vocab])."""
    decoder = model.decoder(batch, attn_len)
    decoder.prefill(torch.randint(0, model.config.vocab_size, (batch, attn_len)), seg_len=attn_len)
    return decoder.feed
