"""What each of two gloo ranks scores, with <unk> among the targets (tests/integration/test_distributed.py)."""

from __future__ import annotations

import torch

from xl.data.metrics import LMMetrics

VOCAB, UNK = 6, 1


def metrics() -> LMMetrics:
    values = LMMetrics("word")
    values.set_token_bytes(torch.tensor([1, 6, 2, 3, 4, 5]), VOCAB, UNK)
    return values


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(mean NLL, targets, their lengths) of one rank: ids drawn with <unk> among them, <unk> of 2 to 19 bytes."""
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for _ in range(3 + rank):  # ranks score different numbers of batches
        target = torch.randint(0, VOCAB, (2, 5), generator=g)
        lengths = torch.where(target == UNK, torch.randint(2, 20, target.shape, generator=g),
                              torch.tensor([1, 6, 2, 3, 4, 5])[target])
        out.append((torch.rand((), generator=g, dtype=torch.float64) * 5, target, lengths))
    return out
