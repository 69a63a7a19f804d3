"""The integer-bit dropout mask has the distribution of ``nn.Dropout``'s."""

from __future__ import annotations

import math

import pytest
import torch

from xl.model.dropout import Dropout, dropped_positions, keep_mask

N = 2_000_001  # odd: the last 64-bit draw is only half used


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_keep_fraction_and_values(p):
    torch.manual_seed(0)
    mask = keep_mask((N,), p, torch.float32, torch.device("cpu"))
    kept = mask != 0
    values = mask.unique()
    assert values.numel() == 2 and values[0] == 0.0
    assert values[1].item() == pytest.approx(1.0 / (1.0 - p), rel=1e-7)
    sigma = math.sqrt(p * (1 - p) / (N / 2))
    # Both 32-bit halves of each 64-bit draw (a half that never set its sign bit would keep everything).
    for half in (kept[0::2], kept[1::2]):
        assert abs(half.double().mean().item() - (1 - p)) < 5 * sigma


@pytest.mark.parametrize("p", [0.1, 0.5])  # the gap draw and the integer draw
def test_neighbours_are_independent(p):
    torch.manual_seed(1)
    kept = (keep_mask((N - 1,), p, torch.float32, torch.device("cpu")) != 0).double()
    even, odd = kept[0::2], kept[1::2]  # the two halves of one draw
    corr = torch.corrcoef(torch.stack([even, odd]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(even.numel())
    shifted = torch.corrcoef(torch.stack([odd[:-1], even[1:]]))[0, 1].item()  # across draws
    assert abs(shifted) < 5 / math.sqrt(even.numel())


def test_seeded_and_shaped():
    shape = (3, 5, 7)
    torch.manual_seed(3)
    a = keep_mask(shape, 0.2, torch.bfloat16, torch.device("cpu"))
    torch.manual_seed(3)
    b = keep_mask(shape, 0.2, torch.bfloat16, torch.device("cpu"))
    assert a.shape == shape and a.dtype == torch.bfloat16
    assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.1, 0.25])  # the gap draw, and the integer draw
@pytest.mark.parametrize("transposed", [False, True])
def test_module_scales_kept_values_and_gradient_is_the_mask(p, transposed):
    drop = Dropout(p)
    x = torch.randn(300, 64, dtype=torch.float64).requires_grad_()
    torch.manual_seed(4)
    y = drop(x.t() if transposed else x)
    kept = y != 0
    torch.testing.assert_close(y[kept], (x.t() if transposed else x)[kept] / (1 - p))
    out_grad = torch.randn(y.shape, dtype=torch.float64)
    y.backward(out_grad)
    grad = (out_grad * kept / (1 - p))
    torch.testing.assert_close(x.grad, grad.t() if transposed else grad)
    assert abs(kept.double().mean().item() - (1 - p)) < 0.02


def test_module_keeps_low_precision():
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    for p in (0.1, 0.5):
        y = Dropout(p)(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y[y != 0], (x[y != 0].float() / (1 - p)).bfloat16())


def test_module_is_identity_when_off():
    x = torch.randn(4, 8)
    assert Dropout(0.5).eval()(x) is x
    assert Dropout(0.0)(x) is x
    assert torch.equal(Dropout(1.0)(x), torch.zeros_like(x))


@pytest.mark.parametrize("chunk", [None, 7])  # 7: many rounds of gaps before passing n
def test_dropped_positions_are_a_bernoulli_sequence(chunk):
    torch.manual_seed(5)
    n, p = 400_000, 0.1
    positions = dropped_positions(n, p, chunk)
    assert positions.dtype == torch.int64 and bool((positions.diff() > 0).all())
    assert 0 <= positions.min() and positions.max() < n
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(positions.numel() - n * p) < 5 * sigma
    # Gaps between drops are Geometric(p): P(gap = g) = (1-p)^(g-1) p.
    gaps = positions.diff()
    for g in (1, 2, 5, 10):
        expected = (1 - p) ** (g - 1) * p
        share = (gaps == g).double().mean().item()
        assert abs(share - expected) < 5 * math.sqrt(expected * (1 - expected) / gaps.numel())
    # Every index, the first and the last included, is dropped with probability p.
    hits = torch.zeros(10)
    for _ in range(3000):
        hits[dropped_positions(10, p, chunk)] += 1
    assert ((hits / 3000 - p).abs() < 5 * math.sqrt(p * (1 - p) / 3000)).all()
