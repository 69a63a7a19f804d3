"""How far back each memory holds a token (MemoryConfig.held, the recall probe's predictions): values worked out by
hand, and for the memories a layer reads directly, the farthest token whose change reaches a segment's first
prediction in a one-layer model."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dilated_memory import DilatedConfig
from tests.helpers.memories import xl_config
from tests.unit.model.test_model import TINY, run_segments
from xl.memory.cache import CacheConfig
from xl.memory.compressive import CompressiveConfig
from xl.memory.knn.memory import KnnConfig
from xl.memory.tokens import TokensConfig
from xl.model.transformer import TransformerXL


def test_held_by_hand():
    assert CacheConfig().held(32, 1, 2) == [32, 32]
    assert CacheConfig().held(32, 2, 2) == [32, 32]  # windows train a relay; they widen no layer's keys
    assert CompressiveConfig(cmem_len=16, cmem_rate=4).held(16, 1, 2) == [16 + 64, 16 + 64]
    assert CompressiveConfig(cmem_len=32, cmem_rate=4).held(32, 1, 3) == [160, 160, 160]
    assert KnnConfig(knn_size=512).held(32, 1, 2) == [32, 544]  # the default layer of 2: ceil(3 × 2 / 4) - 1 = 1
    assert KnnConfig(knn_size=512).held(32, 1, 4) == [32, 32, 544, 32]
    assert KnnConfig(knn_size=100, knn_layers=[3, 0]).held(0, 1, 4) == [100, 0, 0, 100]
    assert TokensConfig(seg_len=32).held(32, 1, 2) == [32, 32]  # no gradient reaches the write tokens
    assert TokensConfig(seg_len=32).held(32, 2, 2) == [math.inf, math.inf]  # a recurrence, trained through windows
    assert TokensConfig(num_tokens=2, seg_len=16).held(0, 4, 3) == [math.inf] * 3


def first_prediction_changes(memory, mem_len: int, seg_len: int, back: int) -> bool:
    """Whether changing the token ``back`` positions before the last segment's first token changes that token's
    prediction, in a one-layer model reading 12 segments."""
    torch.manual_seed(0)
    model = TransformerXL(xl_config(**{**TINY, "n_layer": 1, "mem_len": mem_len, "memory": memory})).double().eval()
    tokens = torch.randint(0, TINY["vocab_size"], (1, 12 * seg_len), generator=torch.Generator().manual_seed(3))
    query = tokens.size(1) - seg_len
    other = tokens.clone()
    other[0, query - back] = (other[0, query - back] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        a, _ = run_segments(model, tokens, seg_len)
        b, _ = run_segments(model, other, seg_len)
    return not torch.equal(a[0, query], b[0, query])


@pytest.mark.parametrize("memory,mem_len", [
    (CacheConfig(), 4),
    (CacheConfig(), 0),
    (CompressiveConfig(cmem_len=2, cmem_rate=2, cmem_fn="mean"), 4),
    (CompressiveConfig(cmem_len=3, cmem_rate=4, cmem_fn="mean"), 8),
    (KnnConfig(knn_size=8, knn_top_k=8), 4),
    (KnnConfig(knn_size=6, knn_top_k=6), 0),
    (DilatedConfig(far_len=3, stride=2), 4),  # a variant written outside the package
])
def test_a_segments_first_token_reads_exactly_as_far_back_as_held(memory, mem_len):
    seg_len = 4
    held, = memory.held(mem_len, 1, 1)
    assert first_prediction_changes(memory, mem_len, seg_len, held)
    assert not first_prediction_changes(memory, mem_len, seg_len, held + 1)
