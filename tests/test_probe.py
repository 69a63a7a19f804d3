"""The memory probe's generator and scorer (the training itself is a documented command, not a test)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from xl.probe import KEYS, QUERY, RecallSource, query_distances, recall_accuracy, recall_bytes


def test_keys_sit_exactly_at_the_requested_distances():
    distances = [1, 5, 17, 64]
    data = np.frombuffer(recall_bytes(distances, 400, seed=3), dtype=np.uint8)
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
    assert seen == set(distances)
    np.testing.assert_array_equal(query_distances(data)[queries], queries - [
        max(i for i in range(q) if data[i] in KEYS) for q in queries])


def test_recall_source_is_deterministic_and_splits_differ():
    source = RecallSource([4, 8], episodes=50, eval_episodes=20)
    train = "".join(source.texts("train"))
    assert train == "".join(RecallSource([4, 8], episodes=50, eval_episodes=20).texts("train"))
    assert train != "".join(source.texts("val"))
    assert source.identity() != RecallSource([4, 9], episodes=50, eval_episodes=20).identity()


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
    rows = np.frombuffer(recall_bytes([3, 9], 300, seed=0), dtype=np.uint8)[:2000].reshape(2, 1000)
    perfect = recall_accuracy(Oracle(rows, True), rows, seg_len=32, mem_len=0)
    assert set(perfect) == {3, 9} and all(hit == total for hit, total in perfect.values())
    constant = recall_accuracy(Oracle(rows, False), rows, seg_len=32, mem_len=0)
    rate = sum(h for h, _ in constant.values()) / sum(t for _, t in constant.values())
    assert 0.0 < rate < 0.15
