"""The memory's store: one memory per stage that follows the model, checks its rows and is freed when done."""

from __future__ import annotations

import pytest
import torch

from xl.memory.cache import update_memory
from xl.memory.store import MemoryStore, nbytes


def layers(n: int = 2, rows: int = 3, length: int = 4, d: int = 5, dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.randn(rows, length, d, dtype=dtype) for _ in range(n)]


def test_update_keeps_the_newest_positions_of_old_then_current_detached():
    old = layers(length=3)
    current = [h.requires_grad_() for h in layers(length=2)]
    new = update_memory(old, current, mem_len=4)
    for m, o, h in zip(new, old, current, strict=True):
        assert torch.equal(m, torch.cat([o[:, -2:], h.detach()], 1))
        assert not m.requires_grad and m.grad_fn is None
    assert all(m.size(1) == 1 for m in update_memory(old, current, mem_len=1))
    rounded = update_memory(old, current, mem_len=4, dtype=torch.bfloat16)
    assert all(m.dtype == torch.bfloat16 for m in rounded)


def test_read_moves_the_memory_to_the_models_device_and_dtype_once():
    store = MemoryStore()
    mems = layers()
    kv = [(torch.ones(3, 1, 4, 2), torch.ones(3, 1, 4, 2))] * 2
    store.write("train", mems, kv)
    same, same_kv = store.read("train", 3, torch.device("cpu"), torch.float32, pytest.fail)
    assert same is mems and same_kv is kv  # nothing to move: nothing copied
    moved, moved_kv = store.read("train", 3, torch.device("cpu"), torch.float64, pytest.fail)
    assert [m.dtype for m in moved] == [torch.float64] * 2 and moved_kv is None  # keys re-projected from it
    assert all(torch.equal(a.double(), b) for a, b in zip(mems, moved, strict=True))
    again, _ = store.read("train", 3, torch.device("cpu"), torch.float64, pytest.fail)
    assert again is moved  # kept where it was moved


def test_a_memory_of_other_rows_is_dropped_with_a_warning():
    store = MemoryStore()
    store.write("val", layers(rows=3))
    warnings = []
    assert store.read("val", 2, torch.device("cpu"), torch.float32, warnings.append) == (None, None)
    assert "holds 3 rows but the batch has 2" in warnings[0] and store.mems["val"] is None


def test_stages_are_separate_and_reset_frees_them():
    store = MemoryStore()
    train, val = layers(), layers(length=8)
    kv = [(torch.zeros(3, 2, 8, 4), torch.zeros(3, 2, 8, 4))] * 2
    store.write("train", train)
    store.write("val", val, kv)
    assert store.nbytes("val") == 2 * 3 * 8 * 5 * 4 + 2 * 2 * 3 * 2 * 8 * 4 * 4
    assert store.nbytes("train") == nbytes(train) == 2 * 3 * 4 * 5 * 4
    store.reset("val")
    assert store.nbytes("val") == 0 and store.mems["train"] is train


def test_pack_and_unpack_give_each_rank_its_own_rows():
    ranks = [layers(), layers()]
    packed = []
    for rank in range(2):
        store = MemoryStore()
        store.write("train", ranks[rank])
        # What every rank's all_gather returns: the ranks' stacked memories in rank order.
        packed.append(store.pack(lambda t: torch.stack([torch.stack(r) for r in ranks]), world_size=2))
    assert torch.equal(packed[0], packed[1]) and packed[0].shape == (2, 2, 3, 4, 5)
    for rank in range(2):
        store = MemoryStore()
        store.unpack(packed[0], rank)
        assert all(torch.equal(a, b) for a, b in zip(store.mems["train"], ranks[rank], strict=True))
    single = MemoryStore()
    single.write("train", ranks[0])
    assert single.pack(pytest.fail, world_size=1).shape == (1, 2, 3, 4, 5)
    assert MemoryStore().pack(pytest.fail, world_size=1) is None


@pytest.mark.parametrize("target,mem_len,says", [
    ("xl.memory.compressive.CompressiveConfig", 4, "the compressed memory is always detached"),
    ("xl.memory.knn.memory.KnnConfig", 4, "the retrieval store takes no gradient"),
    ("xl.memory.cache.CacheConfig", 0, "needs memory.mem_len > 0"),
])
def test_a_memory_kept_in_the_graph_is_refused_where_no_gradient_can_cross(target, mem_len, says):
    """detach_memory=False asks the next segment's gradient to reach this one: the memory's rule for windows of two
    segments answers, in its own sentence, before any work."""
    from xl.model import memory_settings
    from xl.model.config import XLConfig
    from xl.model.transformer import TransformerXL

    extra = {"knn_size": 8, "knn_top_k": 2} if "Knn" in target else {"cmem_len": 2} if "Compressive" in target else {}
    memory = memory_settings.variant({"_target_": target, **extra})
    model = TransformerXL(XLConfig(n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, vocab_size=10,
                                   mem_len=mem_len, memory=memory))
    with pytest.raises(ValueError, match=says):
        model(torch.zeros(1, 4, dtype=torch.long), None, detach_memory=False)
    model(torch.zeros(1, 4, dtype=torch.long), None)  # detached: as always
