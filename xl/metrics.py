"""The loss as every report shows it: mean NLL per token, the tokenizer's own unit, and bits per byte.

Each tokenizer's own unit (bits per byte or char, perplexity per word or subword token) cannot be compared
across tokenizers. Bits per byte of the original text can: ``bpb = total nats / (UTF-8 bytes of the scored
text × ln 2)``, where the scored text is that of the target tokens, each counted by the tokenizer's byte-length
table (``token_bytes()`` in ``xl.data.tokenizers``). For the byte tokenizer it equals bits per token. For char and
subword tokenizers the table is exact for every id but ``<unk>``; subwords never produce it. ``<unk>`` stands for
text of any length, so a split where the tokenizer gave it carries each target's own length with its batches
(the token cache keeps them: ``xl.data.cache``), and those are counted instead of the table: a character the
training split lacks counts its own 1 to 4 bytes, a word the vocabulary lacks its own bytes and separator. A word
also counts one separator after it (``xl.data.words``). Sums are kept as float64 nats and int64 token and byte
counts, and summed across ranks, so the epoch figures are exact whatever the batch sizes. A target equal to
``IGNORE_INDEX`` is not scored (a loss on answers alone, ``data=babilong``): it counts no token and no byte.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torchmetrics import Metric

QUALITY = {"byte": "bpb", "char": "bpc", "word": "ppl", "token": "ppl"}
UNITS = tuple(QUALITY)
STAGES = ("train", "val", "test")
IGNORE_INDEX = -100  # a target that is not scored: the model's loss (torch's cross_entropy default) leaves it out


def quality_name(unit: str) -> str:
    """The name of the tokenizer's own figure: bpb/bpc for bytes/chars, ppl for words and subword tokens."""
    return QUALITY[unit]


def quality(unit: str, nll: Tensor) -> Tensor:
    """Bits per byte/char, or perplexity per word/token, from a mean NLL in nats."""
    return nll.exp() if QUALITY[unit] == "ppl" else nll / math.log(2)


def sum_float64_bits(gathered: Tensor) -> Tensor:
    """Across ranks: the sum of float64 values kept as their int64 bit patterns (see :class:`ScoredText`)."""
    return gathered.view(torch.float64).sum(0).view(torch.int64)


class ScoredText(Metric):
    """Summed NLL (float64 nats), scored tokens and their UTF-8 bytes (int64), summed across ranks.

    The nats are kept as the bit pattern of a float64 in an int64 state: moving a module to another floating dtype
    (``module.to(torch.bfloat16)``, as bf16-true does) converts every floating state and would round the sum, but
    leaves integer ones alone. :attr:`nats` reads the float64 back."""

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        zero = torch.zeros((), dtype=torch.float64).view(torch.int64)
        self.add_state("nats_bits", zero, dist_reduce_fx=sum_float64_bits)
        self.add_state("tokens", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("bytes", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    @property
    def nats(self) -> Tensor:
        return self.nats_bits.view(torch.float64)

    def update(self, nats: Tensor, tokens: Tensor | int, n_bytes: Tensor | int) -> None:
        self.nats_bits = (self.nats + nats).view(torch.int64)
        self.tokens += tokens
        self.bytes += n_bytes

    def compute(self) -> tuple[Tensor, Tensor]:
        """(mean NLL per token, bits per byte)."""
        return self.nats / self.tokens, self.nats / math.log(2) / self.bytes  # int64 x float would round to float32


class LMMetrics(nn.Module):
    """Per-stage sums of the loss and of the scored bytes, and the figures logged from them.

    ``token_bytes`` (set by :meth:`set_token_bytes`, a vocabulary-sized int64 buffer that moves with the module)
    counts each target token's bytes, unless the batch gives the targets' own lengths (a split with ``<unk>``).
    Without either, bits per byte are reported for the byte unit only (one byte per token). Training leaves out a
    step whose loss is not finite (the optimizer skips it too); evaluation counts it, so that a NaN shows.
    """

    def __init__(self, unit: str, stages: Sequence[str] = STAGES) -> None:
        super().__init__()
        if unit not in QUALITY:
            raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
        self.unit = unit
        self.sums = nn.ModuleDict({f"{stage}_nll": ScoredText() for stage in stages})  # "train" is a Module method
        self.register_buffer("token_bytes", torch.zeros(0, dtype=torch.int64), persistent=False)

    def set_token_bytes(self, table: Tensor | None, vocab_size: int) -> None:
        """Count target bytes with ``table`` (each id's UTF-8 length); None: no table."""
        if table is not None and table.shape != (vocab_size,):
            raise ValueError(f"the byte-length table has shape {tuple(table.shape)}, the vocabulary {vocab_size} ids; "
                             "the data and the model come from different tokenizers")
        table = torch.zeros(0, dtype=torch.int64) if table is None else table.to(torch.int64)
        self.token_bytes = table.to(self.token_bytes.device)

    @property
    def counts_bytes(self) -> bool:
        return bool(self.token_bytes.numel()) or self.unit == "byte"

    def target_bytes(self, target: Tensor, lengths: Tensor | None = None) -> Tensor | int | None:
        """UTF-8 bytes of the text of the scored targets of ``target`` (``lengths``: each target's own, where the
        batch gives them), or None when they cannot be counted."""
        scored = target != IGNORE_INDEX
        if lengths is not None:
            return (lengths * scored).sum()
        if self.token_bytes.numel():
            return (self.token_bytes[target.clamp(min=0)] * scored).sum()
        return scored.sum() if self.unit == "byte" else None

    def update(self, stage: str, nll: Tensor, target: Tensor, lengths: Tensor | None = None) -> dict[str, Tensor]:
        """Add a batch scored with mean NLL ``nll`` over the scored tokens of ``target`` (those not
        ``IGNORE_INDEX``); return the batch's figures. ``lengths``: the targets' UTF-8 lengths where the batch gives
        them (:func:`xl.documents.target_bytes`).

        Nothing here waits for the device (no host-side branch on values, no host-to-device copy).
        """
        nll, n = nll.detach(), (target != IGNORE_INDEX).sum()
        n_bytes = self.target_bytes(target, lengths)
        nats = nll.double() * n
        tokens, counted = n, 0 if n_bytes is None else n_bytes
        if stage == "train":
            finite = torch.isfinite(nats)
            nats, tokens, counted = torch.where(finite, nats, 0.0), finite * n, finite * counted
        self.sums[f"{stage}_nll"].update(nats, tokens, counted)
        return self.figures(stage, nll, None if n_bytes is None else nll.double() * n / math.log(2) /
                            n_bytes.clamp(min=1))

    def compute(self, stage: str) -> dict[str, Tensor] | None:
        """The stage's figures over everything added since the last call (reduced across ranks), then reset;
        None if nothing was added."""
        metric: ScoredText = self.sums[f"{stage}_nll"]
        if metric.update_count == 0:
            return None
        loss, bpb = metric.compute()
        with torch.inference_mode(False):  # fresh states that a later training step may update in place
            metric.reset()
        return self.figures(stage, loss, bpb if self.counts_bytes else None)

    def figures(self, stage: str, loss: Tensor, bpb: Tensor | None) -> dict[str, Tensor]:
        """``<stage>/loss``, ``<stage>/<bpb|bpc|ppl>`` and ``<stage>/bpb`` (one key for the byte unit)."""
        values = {f"{stage}/loss": loss, f"{stage}/{quality_name(self.unit)}": quality(self.unit, loss)}
        if bpb is not None:
            values[f"{stage}/bpb"] = bpb
        return values
