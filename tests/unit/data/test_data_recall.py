"""The memory probe's corpus (``data=recall``): keys at exactly the requested distances, deterministic splits."""

from __future__ import annotations

import numpy as np
import pytest
from hydra.utils import instantiate

from tests.conftest import compose_config
from xl.data import RecallSource
from xl.data.recall import FILLER, KEYS, QUERY, recall_bytes


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


def test_recall_source_is_deterministic_and_splits_differ():
    source = RecallSource([4, 8], episodes=50, eval_episodes=20)
    train = "".join(source.texts("train"))
    assert train == "".join(RecallSource([4, 8], episodes=50, eval_episodes=20).texts("train"))
    assert train != "".join(source.texts("val"))
    assert source.identity() != RecallSource([4, 9], episodes=50, eval_episodes=20).identity()
    assert source.identity() != RecallSource([4, 8], episodes=50, eval_episodes=20, gap=7).identity()
    assert source.identity() != RecallSource([4, 8], episodes=50, eval_episodes=20, repeat=2).identity()


def test_data_recall_config_builds_the_source(tmp_path):
    cfg = compose_config("data=recall", f"data.cache_dir={tmp_path}", "data.source.distances=[3,7]")
    datamodule = instantiate(cfg.data)  # lazy: nothing generated yet
    assert isinstance(datamodule.source, RecallSource) and datamodule.source.distances == [3, 7]
