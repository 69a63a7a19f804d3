"""The loss as every report shows it: mean NLL per token, the tokenizer's own unit, and bits per byte.

Each tokenizer's own unit (bits per byte or char, perplexity per word or subword token) cannot be compared
across tokenizers. Bits per byte of the scored text can, provided the model pays for every byte. The scored text
is that of the target tokens, each counted by the tokenizer's byte-length table (``token_bytes()`` in
``xl.data.tokenizers``): exact for every id of the byte and subword tokenizers (which never give ``<unk>``) and
for every id but ``<unk>`` of the char and word tokenizers. A word counts one separator after it
(``xl.data.words``).

``<unk>`` stands for text the vocabulary lacks, and a model that predicts it has not said which text. So
``bpb`` charges each such ``<unk>`` the cost of spelling its text with a stated fallback, a uniform code of
:data:`FALLBACK_BITS` bits per UTF-8 byte, and ``bpb = (total nats / ln 2 + 8 × spelled bytes) / scored bytes``:
the length of a code that gives the text back (the model's bits for each token, then the fallback's for the text
of each ``<unk>``). The spelling needs no end mark: a character's first UTF-8 byte gives its length, and a word's
counted bytes end with its separator, which a word never holds. A split where the tokenizer met text its
vocabulary lacks carries each target's own length with its batches (the token cache keeps them:
``xl.data.cache``): those are the scored bytes, and every ``<unk>`` target of such a split is spelled (a literal
``<unk>`` in the text too, which the model's ``<unk>`` does not tell apart from the rest). A split whose every
``<unk>`` is the text's own (WikiText writes ``<unk>`` for the words it replaced) carries no lengths, and its
``<unk>`` counts as the 6 bytes ``<unk> `` it is, nothing spelled: the closed-vocabulary convention.

``unk_share`` (reported for tokenizers that have ``<unk>``) is the share of the scored bytes that were spelled,
so ``bpb - 8 × unk_share`` is what the model alone paid per byte, a figure that no other tokenizer can be
compared with. Sums are kept as float64 nats and int64 token and byte counts, and summed across ranks, so the
epoch figures are exact whatever the batch sizes. A target equal
to ``IGNORE_INDEX`` is not scored (a loss on answers alone, ``data=babilong``): it counts no token and no byte.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torchmetrics import Metric

FALLBACK_BITS = 8  # what bpb charges per UTF-8 byte of the text an <unk> stands for: a uniform byte code
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
    """Summed NLL (float64 nats), scored tokens, their UTF-8 bytes and the bytes of them that the fallback spells
    (int64), summed across ranks.

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
        self.add_state("spelled", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    @property
    def nats(self) -> Tensor:
        return self.nats_bits.view(torch.float64)

    def update(self, nats: Tensor, tokens: Tensor | int, n_bytes: Tensor | int, spelled: Tensor | int = 0) -> None:
        self.nats_bits = (self.nats + nats).view(torch.int64)
        self.tokens += tokens
        self.bytes += n_bytes
        self.spelled += spelled

    def compute(self) -> tuple[Tensor, Tensor, Tensor]:
        """(mean NLL per token, bits per byte with the fallback's bits for the spelled bytes, share of the bytes
        spelled)."""
        return self.nats / self.tokens, *bits_per_byte(self.nats, self.bytes, self.spelled)


def bits_per_byte(nats: Tensor, n_bytes: Tensor | int, spelled: Tensor | int) -> tuple[Tensor, Tensor]:
    """(bits per byte: the model's ``nats`` plus :data:`FALLBACK_BITS` per ``spelled`` byte, over ``n_bytes``;
    the share of ``n_bytes`` spelled), in float64 (int64 x float would round to float32)."""
    spelled = torch.zeros_like(nats) + spelled  # float64 on the device of the sums, without a host copy
    return (nats / math.log(2) + FALLBACK_BITS * spelled) / n_bytes, spelled / n_bytes


class LMMetrics(nn.Module):
    """Per-stage sums of the loss and of the scored bytes, and the figures logged from them.

    ``token_bytes`` (set by :meth:`set_token_bytes`, a vocabulary-sized int64 buffer that moves with the module)
    counts each target token's bytes, unless the batch gives the targets' own lengths (a split where the tokenizer
    met text its vocabulary lacks); then each ``<unk>`` target (``unk_id``) is also spelled by the fallback.
    Without a table, bits per byte are reported for the byte unit only (one byte per token). Training leaves out a
    step whose loss is not finite (the optimizer skips it too); evaluation counts it, so that a NaN shows.
    """

    def __init__(self, unit: str, stages: Sequence[str] = STAGES) -> None:
        super().__init__()
        if unit not in QUALITY:
            raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
        self.unit = unit
        self.unk_id: int | None = None
        self.sums = nn.ModuleDict({f"{stage}_nll": ScoredText() for stage in stages})  # "train" is a Module method
        self.register_buffer("token_bytes", torch.zeros(0, dtype=torch.int64), persistent=False)

    def set_token_bytes(self, table: Tensor | None, vocab_size: int, unk_id: int | None = None) -> None:
        """Count target bytes with ``table`` (each id's UTF-8 length; None: no table); ``unk_id``: the id of
        ``<unk>``, for a tokenizer that has one (its share of the bytes is then reported too)."""
        if table is not None and table.shape != (vocab_size,):
            raise ValueError(f"the byte-length table has shape {tuple(table.shape)}, the vocabulary {vocab_size} ids; "
                             "the data and the model come from different tokenizers")
        if unk_id is not None and not 0 <= unk_id < vocab_size:
            raise ValueError(f"the <unk> id {unk_id} is outside the vocabulary of {vocab_size} ids; the data and the "
                             "model come from different tokenizers")
        table = torch.zeros(0, dtype=torch.int64) if table is None else table.to(torch.int64)
        self.token_bytes = table.to(self.token_bytes.device)
        self.unk_id = unk_id

    @property
    def counts_bytes(self) -> bool:
        return bool(self.token_bytes.numel()) or self.unit == "byte"

    def target_bytes(self, target: Tensor, lengths: Tensor | None = None) -> tuple[Tensor | None, Tensor | int]:
        """(UTF-8 bytes of the text of the scored targets of ``target`` (those not ``IGNORE_INDEX``), or None when
        they cannot be counted; the bytes of it that the fallback spells). ``lengths``: each target's own, where the
        batch gives them; then every scored ``<unk>`` target is spelled."""
        scored = target != IGNORE_INDEX
        if lengths is not None:
            if self.unk_id is None:
                raise ValueError("the batch gives its targets' byte lengths (a split with <unk>) but the metrics know "
                                 "no <unk> id; set it with set_token_bytes(table, vocab_size, unk_id)")
            lengths = lengths * scored
            return lengths.sum(), torch.where(target == self.unk_id, lengths, 0).sum()
        if self.token_bytes.numel():
            return (self.token_bytes[target.clamp(min=0)] * scored).sum(), 0
        return (scored.sum() if self.unit == "byte" else None), 0

    def update(self, stage: str, nll: Tensor, target: Tensor, lengths: Tensor | None = None) -> dict[str, Tensor]:
        """Add a batch scored with mean NLL ``nll`` over the scored tokens of ``target`` (those not
        ``IGNORE_INDEX``); return the batch's figures. ``lengths``: the targets' UTF-8 lengths where the batch gives
        them (:func:`xl.model.documents.target_bytes`).

        Nothing here waits for the device (no host-side branch on values, no host-to-device copy).
        """
        nll, n = nll.detach(), (target != IGNORE_INDEX).sum()
        n_bytes, spelled = self.target_bytes(target, lengths)
        nats = nll.double() * n
        tokens, counted = n, 0 if n_bytes is None else n_bytes
        if stage == "train":
            finite = torch.isfinite(nats)
            nats, tokens = torch.where(finite, nats, 0.0), finite * n
            counted, spelled = finite * counted, finite * spelled
        self.sums[f"{stage}_nll"].update(nats, tokens, counted, spelled)
        step = None if n_bytes is None else bits_per_byte(nll.double() * n, n_bytes.clamp(min=1), spelled)
        return self.figures(stage, nll, step)

    def compute(self, stage: str) -> dict[str, Tensor] | None:
        """The stage's figures over everything added since the last call (reduced across ranks), then reset;
        None if nothing was added."""
        metric: ScoredText = self.sums[f"{stage}_nll"]
        if metric.update_count == 0:
            return None
        loss, bpb, share = metric.compute()
        with torch.inference_mode(False):  # fresh states that a later training step may update in place
            metric.reset()
        return self.figures(stage, loss, (bpb, share) if self.counts_bytes else None)

    def figures(self, stage: str, loss: Tensor, bytes_figures: tuple[Tensor, Tensor] | None) -> dict[str, Tensor]:
        """``<stage>/loss``, ``<stage>/<bpb|bpc|ppl>``, ``<stage>/bpb`` (one key for the byte unit) and, for a
        tokenizer with ``<unk>``, ``<stage>/unk_share``; ``bytes_figures``: (bits per byte, share spelled)."""
        values = {f"{stage}/loss": loss, f"{stage}/{quality_name(self.unit)}": quality(self.unit, loss)}
        if bytes_figures is not None:
            values[f"{stage}/bpb"] = bytes_figures[0]
            if self.unk_id is not None:
                values[f"{stage}/unk_share"] = bytes_figures[1]
        return values


def logged_metrics(tokenizer: str) -> list[str]:
    """The metrics a training run logs at each validation and training step for ``data.tokenizer``, validation first:
    the figures that :class:`xl.data.metrics.LMMetrics` gives a batch, with a byte-length table (the data module
    always has one)."""
    from xl.data.tokenizers import TOKENIZERS

    metrics, target = LMMetrics(TOKENIZERS[tokenizer].unit), torch.zeros(1, 1, dtype=torch.long)
    # A tokenizer that can meet text its vocabulary lacks (char, word: <unk>) also logs the share of bytes spelled.
    has_unk = hasattr(TOKENIZERS[tokenizer], "unknown_bytes")
    metrics.set_token_bytes(torch.ones(1, dtype=torch.long), 1, 0 if has_unk else None)
    return [name for stage in ("val", "train") for name in metrics.update(stage, torch.zeros(()), target)]
