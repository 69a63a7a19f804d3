"""The retrieval memory's attention (xl.memory.knn.attention) with its store and search, against a float64 reference
written here: a loop over queries that retrieves by brute force from every position that left the local window and
applies the gate."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from xl.memory.knn import store
from xl.memory.knn.attention import RECENCY_RANKS, RetrievalGate, default_layers, gated_retrieval, initial_scale
from xl.memory.knn.search import entry_ages, exact_topk, gather, recency_ranks
from xl.model.documents import positions
from xl.model.eviction import leaving


def reference(q, local, key_raw, value, left, doc, p0, gate, scale, size, k, order=None, slope=None):
    """One segment's outputs, query by query: each query (row b, head h, position p0 + i) retrieves, among the
    positions of its row that left the window and belong to its own document (the newest ``size`` of them), the k of
    highest score ``scale_h · q̂ · k̂``, attends over them, and mixes with the local output by ``sigmoid(gate_h)``.
    With ``order`` [H, K], an entry's score also gets ``order[h, r]``, r the number of the query's retrieved entries
    at later positions than its own (at most K - 1); with ``slope`` [H], ``slope[h] · log(1 + age)``, age the number
    of positions of the row that left the window after it. A query whose document began inside the segment retrieves
    nothing; one that retrieves nothing keeps its local output. Returns the outputs and the number of entries each
    query retrieved."""
    B, H, L, _ = q.shape
    rows, counts = [], []
    for b in range(B):
        heads = []
        for h in range(H):
            outs = []
            for i in range(L):
                p = p0 + i
                first = min(j for j in range(p + 1) if doc[b, j] == doc[b, p])  # the query's document start
                pool = [j for j in left[b] if doc[b, j] == doc[b, p]][-size:] if first < p0 else []
                qn = q[b, h, i] / q[b, h, i].norm()
                scored = sorted(((float(qn.detach() @ F.normalize(key_raw[b, h, j], dim=0)), j) for j in pool),
                                reverse=True)
                chosen = [j for _, j in scored[:k]]
                counts.append(len(chosen))
                if not chosen:
                    outs.append(local[b, h, i])
                    continue
                keys = torch.stack([F.normalize(key_raw[b, h, j], dim=0) for j in chosen])
                scores = scale[h] * (keys @ qn)
                if order is not None:
                    newer = [sum(other > j for other in chosen) for j in chosen]
                    scores = scores + torch.stack([order[h, min(r, order.size(1) - 1)] for r in newer])
                if slope is not None:
                    ages = [len(left[b]) - 1 - left[b].index(j) for j in chosen]
                    scores = scores + torch.stack([slope[h] * math.log1p(a) for a in ages])
                weights = torch.softmax(scores, 0)
                v_m = weights @ torch.stack([value[b, h, j] for j in chosen])
                g = torch.sigmoid(gate[h])
                outs.append(g * v_m + (1 - g) * local[b, h, i])
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads))
    return torch.stack(rows), counts


@pytest.mark.parametrize("bias", ["none", "rank", "age", "both"])
@pytest.mark.parametrize(("mem_len", "seg_len"), [(5, 4), (0, 4), (5, 1), (3, 7)])
def test_retrieval_attention_matches_a_loop_over_queries(mem_len, seg_len, bias):
    B, H, D, size, k, T = 3, 2, 6, 7, 3, 35
    gen = torch.Generator().manual_seed(0)
    f64 = dict(generator=gen, dtype=torch.float64)
    starts = torch.rand(B, T, generator=gen) < 0.08
    starts[1, [9, 10, 23]] = True  # a document of one token, and one that begins mid-segment
    doc, pos = starts.long().cumsum(1), positions(starts)
    key_raw, value = torch.randn(B, H, T, D, **f64), torch.randn(B, H, T, D, **f64)
    gate, scale = torch.randn(H, **f64), torch.rand(H, **f64) * 4 + 1
    gate_ref, scale_ref = gate.clone().requires_grad_(), scale.clone().requires_grad_()
    gate.requires_grad_(), scale.requires_grad_()
    # A table of k - 1 ranks: the ranks past its last (evaluation retrieving more than training did) take its last.
    order = torch.randn(H, k - 1, **f64) * 3 if bias in ("rank", "both") else None
    slope = torch.randn(H, **f64) if bias in ("age", "both") else None
    order_ref, slope_ref = (None if t is None else t.clone().requires_grad_() for t in (order, slope))
    for t in (order, slope):
        if t is not None:
            t.requires_grad_()
    state = store.empty(B, H, size, D, dtype=torch.float64)
    left: list[list[int]] = [[] for _ in range(B)]
    held, leaves, counts = 0, [], []
    loss = loss_ref = 0
    for s in range(0, T, seg_len):
        L = min(seg_len, T - s)
        q, local = torch.randn(B, H, L, D, **f64), torch.randn(B, H, L, D, **f64)
        q_ref, local_ref = q.clone().requires_grad_(), local.clone().requires_grad_()
        q.requires_grad_(), local.requires_grad_()
        seg = pos[:, s:s + L]
        found = exact_topk(q, state, k, store.sees_store(seg))
        ages, parts = entry_ages(state, found), []
        if order is not None:
            parts.append(order.view(1, H, 1, -1).expand(B, H, L, -1).gather(-1, recency_ranks(ages).clamp(max=k - 2)))
        if slope is not None:
            parts.append(slope.view(1, H, 1, 1) * torch.log1p(ages.to(slope.dtype)))
        out = gated_retrieval(q, local, *gather(state, found), found.valid, gate, scale, sum(parts) if parts else None)
        out_ref, n_found = reference(q_ref, local_ref, key_raw, value, left, doc, s, gate_ref, scale_ref, size, k,
                                     order_ref, slope_ref)
        counts += n_found
        torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-12)
        weight = torch.randn(out.shape, **f64)
        loss, loss_ref = loss + (out * weight).sum(), loss_ref + (out_ref * weight).sum()
        leaves.append((q, local, q_ref, local_ref))
        # The positions that leave the local window enter the store, oldest first.
        gone = leaving(held + L, mem_len)
        first = s - held
        store.write(state, key_raw[:, :, first:first + gone], value[:, :, first:first + gone],
                    store.doc_start_of_leaving(seg, held))
        for b in range(B):
            left[b] += range(first, first + gone)
        held += L - gone
    loss.backward()
    loss_ref.backward()
    for q, local, q_ref, local_ref in leaves:  # a segment that retrieved nothing leaves the reference's queries unused
        torch.testing.assert_close(q.grad, torch.zeros_like(q) if q_ref.grad is None else q_ref.grad, rtol=0,
                                   atol=1e-12)
        torch.testing.assert_close(local.grad, local_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(gate.grad, gate_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(scale.grad, scale_ref.grad, rtol=0, atol=1e-12)
    for t, t_ref in ((order, order_ref), (slope, slope_ref)):
        if t is not None:
            torch.testing.assert_close(t.grad, t_ref.grad, rtol=0, atol=1e-12)
            assert t.grad.abs().min() > 0
    # The stream exercised every case: no entry, fewer than k, k; and a store that overflowed its size.
    assert {0, k} <= set(counts) and any(0 < c < k for c in counts)
    assert max(len(row) for row in left) > size


def inputs(B=2, H=3, L=4, k=5, D=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = dict(generator=gen, dtype=dtype)
    return (torch.randn(B, H, L, D, **rnd), torch.randn(B, H, L, D, **rnd),
            F.normalize(torch.randn(B, H, L, k, D, **rnd), dim=-1), torch.randn(B, H, L, k, D, **rnd),
            torch.rand(B, H, L, k, generator=gen) < 0.7, torch.randn(H, **rnd), torch.rand(H, **rnd) * 5 + 1)


def test_no_gradient_reaches_the_retrieved_entries():
    q, local, keys, values, valid, gate, scale = inputs()
    keys.requires_grad_(), values.requires_grad_(), q.requires_grad_(), gate.requires_grad_()
    gated_retrieval(q, local, keys, values, valid, gate, scale).square().sum().backward()
    assert keys.grad is None and values.grad is None
    assert q.grad.abs().sum() > 0 and gate.grad.abs().sum() > 0


def test_a_query_with_nothing_retrieved_keeps_the_local_output_and_one_entry_is_mixed_by_the_gate():
    q, local, keys, values, valid, gate, scale = inputs()
    valid[:] = False
    valid[0, 1, 2, 3] = True
    q.requires_grad_(), scale.requires_grad_()
    out = gated_retrieval(q, local, keys, values, valid, gate, scale)
    g = torch.sigmoid(gate[1])
    torch.testing.assert_close(out[0, 1, 2], g * values[0, 1, 2, 3] + (1 - g) * local[0, 1, 2], rtol=0, atol=1e-14)
    others = torch.ones_like(valid[..., 0])
    others[0, 1, 2] = False
    assert torch.equal(out[others], local[others])
    out.sum().backward()  # the queries that found nothing give finite (zero) gradients, no NaN
    assert torch.isfinite(q.grad).all() and torch.isfinite(scale.grad).all()
    assert q.grad[others].eq(0).all()


def test_bfloat16_autocast_computes_in_bfloat16_and_stays_close_to_float32():
    q, local, keys, values, valid, gate, scale = inputs(dtype=torch.float32, k=32, L=16)
    q.requires_grad_(), gate.requires_grad_()
    exact = gated_retrieval(q, local, keys, values, valid, gate, scale)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = gated_retrieval(q, local, keys, values, valid, gate, scale)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, exact, rtol=0, atol=0.1)
    assert not torch.equal(low, exact)  # it did run in bfloat16
    low.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(gate.grad).all()


def test_shapes_are_checked():
    q, local, keys, values, valid, gate, scale = inputs()
    with pytest.raises(ValueError, match=r"retrieved entries \[B, H, L, k, D\]"):
        gated_retrieval(q, local, keys[:, :1], values, valid, gate, scale)
    with pytest.raises(ValueError, match=r"gate and scale \(3,\)"):
        gated_retrieval(q, local, keys, values, valid, gate[:2], scale)


def test_the_default_layer_is_three_quarters_up_and_the_scale_follows_henry_et_al():
    assert [default_layers(n) for n in (1, 2, 4, 6, 12, 16)] == [(0,), (1,), (2,), (4,), (8,), (11,)]
    assert initial_scale(32) == pytest.approx(math.log2(992)) and initial_scale(1) == 1.0
    with pytest.raises(ValueError, match="at least 1 layer"):
        default_layers(0)


def test_a_layers_parameters_start_at_half_gate_and_henry_et_als_scale():
    q, local, keys, values, valid, _, _ = inputs(dtype=torch.float32)
    module = RetrievalGate(3, top_k=5)
    assert torch.equal(module.gate, torch.zeros(3)) and torch.equal(module.scale, torch.full((3,), math.log2(20)))
    out = module(q, local, keys, values, valid)
    assert torch.equal(out, gated_retrieval(q, local, keys, values, valid, module.gate, module.scale))
    out.sum().backward()
    assert module.gate.grad is not None and module.scale.grad is not None


def test_the_recency_table_starts_at_zero_and_a_rank_past_its_last_takes_its_last_bias():
    q, local, keys, values, valid, _, _ = inputs(dtype=torch.float32)  # k = 5 retrieved
    module = RetrievalGate(3, top_k=3, recency=True)
    # One table whatever top_k, so that evaluation may retrieve another number of entries with the trained weights.
    assert torch.equal(module.order, torch.zeros(3, RECENCY_RANKS))
    assert RetrievalGate(3, top_k=64, recency=True).order.shape == (3, RECENCY_RANKS)
    ranks = torch.arange(5).expand(2, 3, 4, 5)
    ages = torch.tensor([7, 0, 3, 12, 1]).expand(2, 3, 4, 5)
    plain = gated_retrieval(q, local, keys, values, valid, module.gate, module.scale)
    assert torch.equal(module(q, local, keys, values, valid, ages), plain)  # a zero table: no preference
    with pytest.raises(ValueError, match="needs the retrieved entries' ages"):
        module(q, local, keys, values, valid)
    with torch.no_grad():
        module.order.copy_(torch.arange(3.0 * RECENCY_RANKS).view(3, RECENCY_RANKS))
    last = 3 * RECENCY_RANKS - 1.0
    assert module.recency_bias(ranks)[1, 2, 3].tolist() == [2 * RECENCY_RANKS + r for r in range(5)]
    assert module.recency_bias(ranks + RECENCY_RANKS - 2)[1, 2, 3].tolist() == [last - 1, last, last, last, last]
    assert RetrievalGate(3, top_k=3).order is None and len(list(RetrievalGate(3, top_k=3).parameters())) == 2


def test_the_age_slope_starts_at_zero_and_biases_by_log_age_beside_the_rank_table():
    q, local, keys, values, valid, _, _ = inputs(dtype=torch.float64)  # k = 5 retrieved
    ages = torch.tensor([7, 0, 3, 12, 1]).expand(2, 3, 4, 5)
    module = RetrievalGate(3, top_k=5, age=True).double()
    assert torch.equal(module.age, torch.zeros(3, dtype=torch.float64)) and module.order is None and module.ordered
    assert not RetrievalGate(3, top_k=5).ordered
    plain = gated_retrieval(q, local, keys, values, valid, module.gate, module.scale)
    assert torch.equal(module(q, local, keys, values, valid, ages), plain)
    both = RetrievalGate(3, top_k=5, recency=True, age=True).double()
    with torch.no_grad():
        module.age.copy_(torch.tensor([-1.0, 0.5, 2.0]))
        both.age.copy_(module.age)
        both.order.copy_(torch.randn(3, RECENCY_RANKS, dtype=torch.float64))
    by_hand = torch.tensor([-1.0, 0.5, 2.0]).double().view(1, 3, 1, 1) * torch.tensor(
        [math.log(8), 0.0, math.log(4), math.log(13), math.log(2)], dtype=torch.float64)
    torch.testing.assert_close(module.age_bias(ages), by_hand.expand(2, 3, 4, 5), rtol=0, atol=1e-15)
    torch.testing.assert_close(module(q, local, keys, values, valid, ages),
                               gated_retrieval(q, local, keys, values, valid, module.gate, module.scale, by_hand.expand(
                                   2, 3, 4, 5)), rtol=0, atol=1e-14)
    ranks = torch.tensor([3, 0, 2, 4, 1]).expand(2, 3, 4, 5)  # the ranks of those ages, newest first
    torch.testing.assert_close(both(q, local, keys, values, valid, ages), gated_retrieval(
        q, local, keys, values, valid, both.gate, both.scale, both.recency_bias(ranks) + by_hand), rtol=0, atol=1e-14)
