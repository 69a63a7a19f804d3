"""The retrieval store (xl.memory.knn.store) against a plain model of it written here: a list of entries per row."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from xl.memory.knn import store
from xl.memory.knn.store import COUNT, KEYS, VALUES
from xl.model.documents import positions
from xl.model.eviction import leaving


def entries(n_rows: int, heads: int, n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_rows, heads, n, d, generator=gen, dtype=torch.float64),
            torch.randn(n_rows, heads, n, d, generator=gen, dtype=torch.float64))


def row_entries(state: list[torch.Tensor], b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row b's entries oldest first, read back through the ring: (keys [H, D], values [H, D])."""
    size, count = state[KEYS].size(2), int(state[COUNT][b])
    held = min(count, size)
    return [(state[KEYS][b, :, m % size], state[VALUES][b, :, m % size]) for m in range(count - held, count)]


def test_entries_fill_the_ring_in_order_and_the_oldest_leave_when_full():
    state = store.empty(2, 3, 5, 4, dtype=torch.float64)
    k, v = entries(2, 3, 7, 4, seed=0)
    store.write(state, k[:, :, :3], v[:, :, :3])
    assert store.fill(state).tolist() == [3, 3]
    store.write(state, k[:, :, 3:], v[:, :, 3:])  # 7 written into 5 slots: entries 2 … 6 remain
    assert state[COUNT].tolist() == [7, 7] and store.fill(state).tolist() == [5, 5]
    for b in range(2):
        held = row_entries(state, b)
        assert len(held) == 5
        for m, (key, value) in zip(range(2, 7), held, strict=True):
            torch.testing.assert_close(key, F.normalize(k[b, :, m], dim=-1), rtol=0, atol=1e-15)
            assert torch.equal(value, v[b, :, m])
    # The entry written m-th sits in slot m % 5: a write touches only the slots it fills.
    assert torch.equal(state[VALUES][0, :, 6 % 5], v[0, :, 6])


def test_more_entries_than_the_store_holds_keep_the_newest():
    state = store.empty(1, 1, 4, 2, dtype=torch.float64)
    k, v = entries(1, 1, 9, 2, seed=1)
    store.write(state, k, v)
    assert all(torch.equal(val, v[0, :, m]) for m, (_, val) in zip(range(5, 9), row_entries(state, 0), strict=True))
    assert state[COUNT].tolist() == [9] and store.fill(state).tolist() == [4]


def test_a_row_whose_document_restarts_forgets_its_entries_and_the_others_keep_theirs():
    state = store.empty(3, 2, 6, 4, dtype=torch.float64)
    k, v = entries(3, 2, 8, 4, seed=2)
    store.write(state, k[:, :, :4], v[:, :, :4])
    # Row 0: document began before the new entries; row 1: at new entry 2; row 2: after all of them.
    store.write(state, k[:, :, 4:], v[:, :, 4:], doc_start=torch.tensor([-3, 2, 4]))
    assert state[COUNT].tolist() == [8, 2, 0]
    assert all(torch.equal(val, v[0, :, m]) for m, (_, val) in zip(range(2, 8), row_entries(state, 0), strict=True))
    assert all(torch.equal(val, v[1, :, m]) for m, (_, val) in zip((6, 7), row_entries(state, 1), strict=True))
    assert row_entries(state, 2) == []


def test_a_document_that_begins_with_the_new_entries_still_forgets_the_old_ones():
    state = store.empty(1, 1, 6, 2, dtype=torch.float64)
    k, v = entries(1, 1, 5, 2, seed=3)
    store.write(state, k[:, :, :2], v[:, :, :2])
    store.write(state, k[:, :, 2:], v[:, :, 2:], doc_start=torch.tensor([0]))
    assert all(torch.equal(val, v[0, :, m]) for m, (_, val) in zip(range(2, 5), row_entries(state, 0), strict=True))
    store.write(state, k[:, :, :0], v[:, :, :0], doc_start=torch.tensor([0]))  # nothing left: still forgets
    assert state[COUNT].tolist() == [0]


def stream_writes(lengths: list[int], total: int, size: int, starts: torch.Tensor, seed: int,
                  contiguous: bool = True) -> list[torch.Tensor]:
    """The store after writing entries 0 … total-1 of 3 rows in chunks of ``lengths`` (cycled), each row's documents
    beginning where ``starts`` [3, total] says (into a store whose tensors are strided views unless ``contiguous``)."""
    k, v = entries(3, 2, total, 3, seed)
    state = store.empty(3, 2, size, 3, dtype=torch.float64)
    if not contiguous:
        state[KEYS], state[VALUES] = (torch.zeros(3, 2, 3, size, dtype=torch.float64).transpose(2, 3) for _ in "kv")
    pos = positions(starts)
    begin, i = 0, 0
    while begin < total:
        n = min(lengths[i % len(lengths)], total - begin)
        i += 1
        end = begin + n
        last = pos[:, end - 1] if end else None
        doc_start = (end - 1 - last) - begin  # index of each row's current document start among these entries
        store.write(state, k[:, :, begin:end], v[:, :, begin:end], doc_start=doc_start)
        begin = end
    return state


@pytest.mark.parametrize("lengths", [[1], [3], [2, 5, 0, 7], [9]])
def test_the_same_entries_written_in_any_chunks_give_the_same_store(lengths):
    gen = torch.Generator().manual_seed(4)
    starts = torch.rand(3, 23, generator=gen) < 0.15
    one_by_one = stream_writes([1], 23, 7, starts, seed=5)
    chunked = stream_writes(lengths, 23, 7, starts, seed=5)
    assert torch.equal(one_by_one[COUNT], chunked[COUNT])
    for b in range(3):
        for (k1, v1), (k2, v2) in zip(row_entries(one_by_one, b), row_entries(chunked, b), strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # Slot by slot too: a decoder writing one entry per token and a forward writing segments share slots.
    for b in range(3):
        filled = int(store.fill(one_by_one)[b])
        assert torch.equal(one_by_one[VALUES][b, :, :filled], chunked[VALUES][b, :, :filled])


def test_a_strided_store_is_written_in_place_as_a_contiguous_one():
    gen = torch.Generator().manual_seed(8)
    starts = torch.rand(3, 23, generator=gen) < 0.15
    flat = stream_writes([2, 5, 1], 23, 7, starts, seed=9)
    strided = stream_writes([2, 5, 1], 23, 7, starts, seed=9, contiguous=False)
    assert not strided[KEYS].is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(flat, strided, strict=True))


def test_the_store_holds_the_newest_entries_of_each_rows_current_document():
    gen = torch.Generator().manual_seed(6)
    starts = torch.rand(3, 40, generator=gen) < 0.1
    k, v = entries(3, 2, 40, 3, seed=7)
    state = stream_writes([4], 40, 6, starts, seed=7)
    doc = starts.long().cumsum(1)
    for b in range(3):
        mine = [m for m in range(40) if doc[b, m] == doc[b, -1]][-6:]
        held = row_entries(state, b)
        assert len(held) == len(mine)
        assert all(torch.equal(val, v[b, :, m]) for m, (_, val) in zip(mine, held, strict=True))


def test_where_documents_begin_among_leaving_entries_and_which_queries_see_the_store():
    # One row, a window of 3, segments of 4; documents begin at positions 0, 6 and 9.
    starts = torch.zeros(1, 12, dtype=torch.bool)
    starts[0, [0, 6, 9]] = True
    pos = positions(starts)
    held = 0
    seen, found = [], []
    for s in range(0, 12, 4):
        seg = pos[:, s:s + 4]
        seen.append(store.sees_store(seg)[0].tolist())
        gone = leaving(held + 4, 3)
        found.append((int(store.doc_start_of_leaving(seg, held)[0]), gone))
        held += 4 - gone
    # Queries see the store only where their document began before their segment.
    assert seen == [[False] * 4, [True, True, False, False], [True, False, False, False]]
    # Leaving entries begin at position s - held: documents start at index 0 - 0, 6 - 1 = 5 and 9 - 5 = 4 of them.
    assert found == [(0, 1), (5, 4), (4, 4)]
    assert store.doc_start_of_leaving(None, 3) is None and store.sees_store(None) is None


def test_nothing_written_carries_a_gradient_and_keys_are_stored_in_the_stores_dtype():
    state = store.empty(1, 2, 4, 3, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 2, 3, requires_grad=True)
    store.write(state, k * 2, k.detach())
    assert not state[KEYS].requires_grad and state[KEYS].dtype == torch.bfloat16
    norms = state[KEYS][0, :, :2].float().norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-2)


def test_reset_rows_forgets_only_those_rows():
    state = store.empty(3, 1, 4, 2, dtype=torch.float32)
    store.write(state, *entries(3, 1, 3, 2, seed=8))
    store.reset_rows(state, torch.tensor([False, True, False]))
    assert store.fill(state).tolist() == [3, 0, 3]


def test_bad_shapes_and_sizes_are_refused():
    state = store.empty(2, 2, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"entries to write must be \[2, 2, n, 3\]"):
        store.write(state, torch.zeros(2, 3, 1, 3), torch.zeros(2, 3, 1, 3))
    with pytest.raises(ValueError, match="at least 1 entry"):
        store.empty(1, 1, 0, 2, dtype=torch.float32)


def test_bytes_per_row_and_layer():
    assert store.nbytes_per_row(4, 64, 16384, torch.float32) == 2 * 4 * 16384 * 64 * 4 + 8
    assert store.nbytes_per_row(4, 64, 16384, torch.bfloat16) == 2 * 4 * 16384 * 64 * 2 + 8
