"""The memory probe's generator and scorer (the training itself is a documented command, not a test)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from xl.probe import (
    FILLER,
    KEYS,
    QUERY,
    RecallSource,
    query_distances,
    reach_accuracy,
    recall_accuracy,
    recall_bytes,
)


@pytest.mark.parametrize(("repeat", "gap"), [(1, 0), (8, 96), (3, 5)])
def test_keys_sit_exactly_at_the_requested_distances(repeat, gap):
    distances = [1, 5, 17, 64]
    data = np.frombuffer(recall_bytes(distances, 400, seed=3, repeat=repeat, gap=gap), dtype=np.uint8)
    queries = np.flatnonzero(data == QUERY)
    assert len(queries) == 400
    seen = set()
    for q in queries:
        # Slow reference: walk back to the nearest key letter.
        back = q - 1
        while data[back] not in KEYS:
            back -= 1
        seen.add(int(q - back))
        assert data[q + 1] == data[back], "the symbol after the query is the key"
        block = data[back - repeat + 1:back + 1]
        assert (block == data[back]).all(), "the key is shown `repeat` times in a row, the last copy d back"
        assert (data[back + 1:q] == FILLER).all()
        # Before the block: `gap` dots, then the previous episode's answer (or the start of the stream).
        start = back - repeat + 1
        if start > 0:
            assert (data[start - gap:start] == FILLER).all() and data[start - gap - 1] in KEYS
        else:
            assert q == queries[0]
    assert seen == set(distances)
    np.testing.assert_array_equal(query_distances(data)[queries], queries - [
        max(i for i in range(q) if data[i] in KEYS) for q in queries])


def test_recall_source_is_deterministic_and_splits_differ():
    source = RecallSource([4, 8], episodes=50, eval_episodes=20)
    train = "".join(source.texts("train"))
    assert train == "".join(RecallSource([4, 8], episodes=50, eval_episodes=20).texts("train"))
    assert train != "".join(source.texts("val"))
    assert source.identity() != RecallSource([4, 9], episodes=50, eval_episodes=20).identity()
    assert source.identity() != RecallSource([4, 8], episodes=50, eval_episodes=20, gap=7).identity()
    assert source.identity() != RecallSource([4, 8], episodes=50, eval_episodes=20, repeat=2).identity()


def brute_force_reach(query: int, mem_len: int, seg_len: int, hops: int) -> int:
    """Farthest distance back from which information reaches ``query`` through ``hops`` attention hops."""
    frontier = {query}
    for _ in range(hops):
        frontier = {t for s in frontier for t in range(s - mem_len - s % seg_len, s + 1)}
    return query - min(frontier)


@pytest.mark.parametrize(("mem_len", "seg_len", "hops"), [(0, 8, 1), (0, 8, 2), (8, 8, 1), (8, 8, 2), (12, 8, 2),
                                                           (5, 4, 3)])
def test_reach_prediction_matches_the_attention_windows(mem_len, seg_len, hops):
    base = 10 * (mem_len + seg_len) * hops
    reach = [brute_force_reach(base + p, mem_len, seg_len, hops) for p in range(seg_len)]
    for d in range(1, max(reach) + seg_len + 2):
        seen = sum(r >= d for r in reach) / seg_len
        assert reach_accuracy(d, mem_len, seg_len, hops) == pytest.approx(seen + (1 - seen) / len(KEYS))


def test_reach_prediction_known_values():
    chance = 1 / len(KEYS)
    assert reach_accuracy(4, 0, 32, 2) == pytest.approx(28 / 32 + 4 / 32 * chance)  # no memory, no relay
    assert reach_accuracy(32, 0, 32, 2) == pytest.approx(chance)
    assert reach_accuracy(32, 32, 32) == pytest.approx(1.0)
    assert reach_accuracy(48, 32, 32) == pytest.approx(0.5 + 0.5 * chance)
    assert reach_accuracy(64, 32, 32) == pytest.approx(chance)
    assert reach_accuracy(128, 64, 32, 2) == pytest.approx(1.0)
    assert reach_accuracy(160, 64, 32, 2) == pytest.approx(chance)


class Oracle(torch.nn.Module):
    """Predicts the true next byte, or a fixed letter: the scorer must give 1.0 and about chance."""

    def __init__(self, rows: np.ndarray, perfect: bool) -> None:
        super().__init__()
        self.rows, self.perfect, self.position = rows, perfect, 0

    def forward(self, x, mems, mem_len):
        start = self.position
        self.position += x.size(1)
        target = torch.from_numpy(self.rows[:, start + 1:start + 1 + x.size(1)].astype(np.int64))
        if not self.perfect:
            target = torch.full_like(target, KEYS[0])
        return SimpleNamespace(logits=torch.nn.functional.one_hot(target, 256).float(), mems=None)


def test_scorer_counts_hits_per_distance():
    rows = np.frombuffer(recall_bytes([3, 9], 300, seed=0, gap=10), dtype=np.uint8)[:2000].reshape(2, 1000)
    perfect = recall_accuracy(Oracle(rows, True), rows, seg_len=32, mem_len=0)
    assert set(perfect) == {3, 9} and all(hit == total for hit, total in perfect.values())
    constant = recall_accuracy(Oracle(rows, False), rows, seg_len=32, mem_len=0)
    rate = sum(h for h, _ in constant.values()) / sum(t for _, t in constant.values())
    assert 0.0 < rate < 0.15
