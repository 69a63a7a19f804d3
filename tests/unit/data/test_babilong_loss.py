"""A loss on some targets only (data=babilong's answers): targets set to the ignore index count nothing in the loss
or the metrics, and a segment with none scored costs 0 with a zero gradient, never NaN; checked against sums done
the slow way."""

from __future__ import annotations

import math

import pytest
import torch

from xl.data.metrics import IGNORE_INDEX, LMMetrics
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL


def model(cutoffs: tuple[int, ...] = ()) -> TransformerXL:
    torch.manual_seed(0)
    cfg = XLConfig(vocab_size=40, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, dropout=0.0, mem_len=8,
                   cutoffs=cutoffs, div_val=2)
    return TransformerXL(cfg).double()


@pytest.mark.parametrize("cutoffs", [(), (10, 25)])
def test_the_loss_is_the_mean_over_the_scored_targets_only(cutoffs):
    m = model(cutoffs)
    x = torch.randint(0, 40, (3, 7))
    y = torch.randint(0, 40, (3, 7))
    keep = torch.rand(3, 7) < 0.4
    keep[0, 0] = True
    out = m(x, targets=torch.where(keep, y, IGNORE_INDEX))
    logp = m(x).logits.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    assert torch.allclose(out.loss, -logp[keep].mean(), atol=1e-12)


@pytest.mark.parametrize("cutoffs", [(), (10, 25)])
def test_a_segment_with_no_scored_target_costs_zero_with_zero_gradients(cutoffs):
    m = model(cutoffs)
    out = m(torch.randint(0, 40, (2, 5)), targets=torch.full((2, 5), IGNORE_INDEX))
    assert out.loss.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_the_metrics_count_the_scored_targets_and_their_bytes_only():
    metrics = LMMetrics("char")
    table = torch.arange(1, 41)  # id i is i + 1 bytes long
    metrics.set_token_bytes(table, 40)
    batches, nats, tokens, n_bytes = [], 0.0, 0, 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 40, (2, 6), generator=g)
        y[torch.rand(2, 6, generator=g) < 0.5] = IGNORE_INDEX
        nll = torch.rand((), generator=g, dtype=torch.float64) + 1
        batches.append((nll, y))
        scored = [int(t) for t in y.flatten() if t != IGNORE_INDEX]  # the slow way
        nats, tokens = nats + float(nll) * len(scored), tokens + len(scored)
        n_bytes += sum(t + 1 for t in scored)
    for nll, y in batches:
        metrics.update("val", nll, y)
    values = metrics.compute("val")
    assert values["val/loss"].item() == pytest.approx(nats / tokens, rel=1e-12)
    assert values["val/bpb"].item() == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-12)


def test_a_training_step_without_scored_targets_logs_finite_figures():
    metrics = LMMetrics("byte")
    values = metrics.update("train", torch.tensor(0.0, dtype=torch.float64), torch.full((2, 3), IGNORE_INDEX))
    assert all(torch.isfinite(v) for v in values.values())
    assert metrics.sums["train_nll"].tokens.item() == 0
