"""Top-k search of the retrieval store (xl.memory.knn.search) against a brute-force loop written here, and the exact
search against faiss's."""

from __future__ import annotations

import pytest
import torch

from xl.memory.knn import store
from xl.memory.knn.search import GROUP, Workspace, _topk, exact_topk, faiss_topk, gather, search
from xl.memory.knn.store import COUNT, KEYS, VALUES


def filled_store(fills: list[int], heads: int, size: int, d: int, dtype=torch.float64, seed: int = 0):
    """A store whose rows hold ``fills`` entries (written through the ring, oldest overwritten)."""
    gen = torch.Generator().manual_seed(seed)
    state = store.empty(len(fills), heads, size, d, dtype=dtype)
    most = max(fills)
    keys = torch.randn(len(fills), heads, most, d, generator=gen, dtype=torch.float64)
    values = torch.randn(len(fills), heads, most, d, generator=gen, dtype=torch.float64)
    # Row b's document begins at entry most - fills[b]: it keeps the last fills[b] entries.
    store.write(state, keys, values, doc_start=torch.tensor([most - f for f in fills]))
    return state


def brute_force(queries, state, k, visible):
    """Per row, head and query, the slots of the k best visible entries by score, best first."""
    B, H, L, _ = queries.shape
    fills = store.fill(state).tolist()
    out = {}
    for b in range(B):
        for h in range(H):
            for i in range(L):
                if visible is not None and not visible[b, i]:
                    out[b, h, i] = []
                    continue
                scores = [(float(queries[b, h, i] @ state[KEYS][b, h, s].to(queries.dtype)), s)
                          for s in range(fills[b])]
                out[b, h, i] = [s for _, s in sorted(scores, reverse=True)[:k]]
    return out


def as_lists(retrieved):
    B, H, L, _ = retrieved.index.shape
    return {(b, h, i): retrieved.index[b, h, i][retrieved.valid[b, h, i]].tolist()
            for b in range(B) for h in range(H) for i in range(L)}


@pytest.mark.parametrize("k", [1, 4, 9])
def test_exact_search_finds_what_a_loop_over_every_entry_finds(k):
    state = filled_store([6, 0, 11, 3], heads=2, size=8, d=5)
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(4, 2, 3, 5, generator=gen, dtype=torch.float64)
    visible = torch.tensor([[True, False, True]] * 3 + [[False, True, True]])
    found = exact_topk(queries, state, k, visible)
    assert as_lists(found) == brute_force(queries, state, k, visible)  # best first: the order matches too
    assert found.index.shape == (4, 2, 3, k) and found.index[~found.valid].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 7, 32])
def test_the_two_pass_top_k_is_torchs_top_k(k, dtype):
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(6, GROUP * 40, generator=gen, dtype=torch.float64)
    scores[1, 100:] = float("-inf")  # a row with fewer finite scores than groups, one group part finite
    scores[2, :] = float("-inf")
    scores[3, ::GROUP] += 10  # the best of every group of adjacent columns in one column
    scores[4, :40] += 10  # ... and of every group of columns 40 apart (the 16-bit layout)
    scores = scores.to(dtype)
    values, index = _topk(scores, k)
    expected = scores.topk(k, dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(scores.gather(-1, index), values)
    finite = expected.values > float("-inf")
    if dtype.itemsize >= 4:  # no ties among finite scores: the same columns
        assert torch.equal(index[finite], expected.indices[finite])
    else:  # 16-bit scores tie: distinct columns holding the same values
        assert all(len(set(row[ok].tolist())) == int(ok.sum()) for row, ok in zip(index, finite, strict=True))


def test_a_large_store_is_searched_exactly_with_or_without_a_workspace():
    state = filled_store([GROUP * 20, GROUP * 9 + 5, 0], heads=2, size=GROUP * 24, d=6)
    queries = torch.randn(3, 2, 5, 6, dtype=torch.float64)
    visible = torch.tensor([[True] * 5, [True, True, False, True, True], [True] * 5])
    expected = brute_force(queries, state, 8, visible)
    workspace = Workspace()
    for _ in range(2):  # the second search reuses the first one's buffer
        assert as_lists(exact_topk(queries, state, 8, visible, workspace=workspace)) == expected
    assert as_lists(exact_topk(queries, state, 8, visible)) == expected
    assert workspace.buffers["scores"].numel() == 3 * 2 * 5 * GROUP * 24


def test_a_limit_on_the_slots_searched_is_only_a_saving():
    state = filled_store([3, 5], heads=1, size=16, d=4)
    queries = torch.randn(2, 1, 4, 4, dtype=torch.float64)
    assert as_lists(exact_topk(queries, state, 4, limit=5)) == as_lists(exact_topk(queries, state, 4))
    assert not exact_topk(queries, state, 4, limit=0).valid.any()


def separated(rows: int, heads: int, n: int, d: int, seed: int):
    """Entries whose scores against the queries below are far apart, so that no rounding can reorder them: every
    coordinate of the keys holds distinct values (the store normalises keys; the ordering survives it for queries
    along one coordinate since each key's norm is the same, sqrt(d) times a fixed spread)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.stack([torch.stack([torch.stack([torch.randperm(n, generator=gen) for _ in range(d)], -1)
                                     for _ in range(heads)]) for _ in range(rows)]).double()
    # A row and head's keys: a d-column Latin-like table of distinct integers; pad one column so every key has the
    # same norm, which normalisation then divides out equally.
    norm2 = keys.square().sum(-1, keepdim=True)
    pad = (norm2.max() + 1 - norm2).sqrt()
    return torch.cat([keys, pad], -1)


def test_exact_and_faiss_search_retrieve_the_same_entries():
    pytest.importorskip("faiss")
    B, H, N, d, L = 3, 2, 40, 6, 5
    keys = separated(B, H, N, d, seed=2)
    state = store.empty(B, H, 48, d + 1, dtype=torch.float32)
    store.write(state, keys, torch.randn(B, H, N, d + 1), doc_start=torch.tensor([-1, 0, 25]))  # fills 40, 40, 15
    # Queries along one key coordinate (either sign): scores are distinct multiples of 1/norm, 1e-2 apart at least.
    gen = torch.Generator().manual_seed(3)
    axis = torch.randint(0, d, (B, H, L), generator=gen)
    sign = torch.randint(0, 2, (B, H, L), generator=gen) * 2 - 1
    queries = torch.nn.functional.one_hot(axis, d + 1).float() * sign[..., None]
    visible = torch.tensor([[True] * L, [True, False] * 2 + [True], [False] + [True] * (L - 1)])
    for k in (1, 8, 32):
        exact, approx = exact_topk(queries, state, k, visible), faiss_topk(queries, state, k, visible)
        assert torch.equal(exact.valid, approx.valid) and torch.equal(exact.index, approx.index)
        assert as_lists(exact) == brute_force(queries, state, k, visible)
    assert store.fill(state).tolist() == [40, 40, 15]
    # faiss.knn is the search an IndexFlatIP runs: the index itself returns the same entries.
    import faiss

    index = faiss.IndexFlatIP(d + 1)
    index.add(state[KEYS][2, 1, :15].numpy())
    _, ids = index.search(queries[2, 1].numpy(), 8)
    approx = faiss_topk(queries, state, 8)
    assert torch.equal(torch.from_numpy(ids).clamp(min=0), approx.index[2, 1])


def test_search_by_name_and_a_clear_refusal_of_an_unknown_one():
    state = filled_store([2], heads=1, size=4, d=3)
    queries = torch.randn(1, 1, 2, 3, dtype=torch.float64)
    assert as_lists(search("exact", queries, state, 2)) == as_lists(exact_topk(queries, state, 2))
    with pytest.raises(ValueError, match="memory.knn_search to one of exact, faiss"):
        search("annoy", queries, state, 2)
    with pytest.raises(ValueError, match=r"queries must be \[B, H, L, D\] = \[1, 1, L, 3\]"):
        exact_topk(torch.zeros(1, 2, 2, 3), state, 2)


def test_gather_into_a_workspace_gives_the_same_entries_under_inference_mode_and_reuses_its_buffers():
    state = filled_store([5, 7], heads=2, size=8, d=3)
    queries = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    found = exact_topk(queries, state, 3)
    expected = gather(state, found)
    workspace = Workspace()
    with torch.inference_mode():
        first = [t.clone() for t in gather(state, found, workspace)]
        buffers = dict(workspace.buffers)
        again = gather(state, found, workspace)
    assert all(torch.equal(a, b) for a, b in zip(expected, first, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(expected, again, strict=True))
    assert set(buffers) == {"keys", "values"} and not buffers["keys"].is_inference()
    assert all(workspace.buffers[name] is buffers[name] for name in buffers)  # the same memory, not a fresh one


def test_gather_returns_copies_of_the_retrieved_entries_without_gradient():
    state = filled_store([5, 7], heads=2, size=8, d=3)
    queries = torch.randn(2, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    found = exact_topk(queries, state, 3)
    keys, values = gather(state, found)
    assert keys.shape == values.shape == (2, 2, 4, 3, 3) and not keys.requires_grad and not values.requires_grad
    for b, h, i, j in [(0, 0, 0, 0), (1, 1, 3, 2), (0, 1, 2, 1)]:
        slot = found.index[b, h, i, j]
        assert torch.equal(keys[b, h, i, j], state[KEYS][b, h, slot])
        assert torch.equal(values[b, h, i, j], state[VALUES][b, h, slot])
    before = values.clone()
    store.write(state, torch.randn(2, 2, 8, 3), torch.randn(2, 2, 8, 3))  # overwrites every slot
    assert torch.equal(values, before) and state[COUNT].tolist() == [13, 15]


def test_a_bfloat16_store_is_searched_in_bfloat16_and_agrees_on_clear_winners():
    state32 = filled_store([30], heads=1, size=32, d=16, dtype=torch.float32)
    state16 = [state32[KEYS].bfloat16(), state32[VALUES].bfloat16(), state32[COUNT]]
    queries = state32[KEYS][:, :, :4].clone()  # each query is one of the keys: its best entry is itself
    for found in (exact_topk(queries, state32, 1), exact_topk(queries, state16, 1)):
        assert found.index[0, 0, :, 0].tolist() == [0, 1, 2, 3]
