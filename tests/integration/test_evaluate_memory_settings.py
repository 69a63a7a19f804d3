"""python -m xl.evaluate with other values of a memory's evaluation settings (+memory.knn_size=..., ...): applied to
the checkpoint's memory, recorded, and refused in one sentence where they would change the trained model."""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose_config, tiny_overrides
from tests.integration.test_evaluate import eval_overrides
from xl.config.compose import compose
from xl.config.rules import ConfigError
from xl.evaluation import evaluate
from xl.training.build import build_run

STORE = ("memory=knn", "memory.knn_size=64", "memory.knn_top_k=4")


def train(tmp_path, corpus, *memory: str) -> dict:
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), *memory, "trainer.max_steps=6",
                         "trainer.val_check_interval=3", "test=false")
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return {"tmp": tmp_path, "run": tmp_path / "run"}


@pytest.fixture(scope="module")
def knn_run(tmp_path_factory, corpus) -> dict:
    return train(tmp_path_factory.mktemp("knn"), corpus, *STORE)


def evaluated(run: dict, corpus, name: str, *extra: str) -> dict:
    out = run["tmp"] / name
    evaluate(compose("evaluate", eval_overrides(run, corpus, "trainer.limit_val_batches=12", "splits=[val]",
                                                f"paths.output_dir={out}", *extra)))
    return json.loads((out / "results.json").read_text())


def test_a_store_size_the_split_never_fills_scores_as_the_trained_one_and_a_smaller_one_evicts(knn_run, corpus):
    """12 segments of 16 tokens put 192 entries into each row's store: stores of 256 and 4,096 never evict, so they
    score identically; the trained 64 (and 8) evict the oldest, and score otherwise."""
    trained = evaluated(knn_run, corpus, "trained")
    big = evaluated(knn_run, corpus, "big", "+memory.knn_size=256")
    bigger = evaluated(knn_run, corpus, "bigger", "+memory.knn_size=4096")
    small = evaluated(knn_run, corpus, "small", "+memory.knn_size=8")
    settings = "knn_top_k=4, knn_search=exact, knn_recency=False, knn_age=False)"
    assert trained["memory"] == f"knn(knn_layers=None, knn_size=64, {settings}"
    assert big["memory"] == f"knn(knn_layers=None, knn_size=256, {settings}"
    assert big["val/loss"] == bigger["val/loss"]
    assert len({trained["val/loss"], big["val/loss"], small["val/loss"]}) == 3
    assert bigger["cache_mb"] > big["cache_mb"] > trained["cache_mb"]  # the store's bytes are counted


def test_another_top_k_and_the_faiss_search(knn_run, corpus):
    pytest.importorskip("faiss")
    exact = evaluated(knn_run, corpus, "exact", "+memory.knn_top_k=8")
    searched = evaluated(knn_run, corpus, "faiss", "+memory.knn_top_k=8", "+memory.knn_search=faiss")
    assert exact["memory"].endswith("knn_top_k=8, knn_search=exact, knn_recency=False, knn_age=False)")
    assert searched["val/loss"] == pytest.approx(exact["val/loss"], rel=1e-5)  # an exact index: the same entries


@pytest.mark.parametrize("override,says", [
    ("+memory.knn_layers=[0]", "memory.knn_layers cannot change at evaluation: the weights were trained with "
                               "memory.knn_layers=None; evaluation can change memory.knn_size, memory.knn_top_k, "
                               "memory.knn_search"),
    ("+memory.cmem_len=8", "memory.cmem_len is not a setting of the checkpoint's knn memory; it has knn_age, "
                           "knn_layers, knn_recency, knn_search, knn_size, knn_top_k"),
    ("+memory.knn_recency=true", "memory.knn_recency cannot change at evaluation: the weights were trained with "
                                 "memory.knn_recency=False"),
    ("+memory.knn_age=true", "memory.knn_age cannot change at evaluation: the weights were trained with "
                             "memory.knn_age=False"),
    ("+memory.knn_top_k=128", "memory.knn_top_k=128 exceeds memory.knn_size=64"),
    ("+memory.knn_size=0", "memory.knn_size must be an integer >= 1, got 0"),
])
def test_what_evaluation_cannot_change_is_one_sentence_before_any_work(knn_run, corpus, override, says):
    out = knn_run["tmp"] / "refused"
    with pytest.raises(ConfigError) as info:
        evaluated(knn_run, corpus, "refused", override)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert not out.exists()


def test_a_variant_setting_without_the_plus_says_how_to_give_it(knn_run, corpus):
    with pytest.raises(ConfigError) as info:
        compose("evaluate", eval_overrides(knn_run, corpus, "memory.knn_size=4096"))
    assert str(info.value) == ("memory.knn_size is a setting of the knn memory, not of every memory; evaluation takes "
                               "it with a + in front, +memory.knn_size=4096, for a checkpoint of that memory")


def test_the_plain_cache_has_no_evaluation_settings(tmp_path, corpus):
    run = train(tmp_path, corpus)
    with pytest.raises(ConfigError, match="^memory.knn_size is not a setting of the checkpoint's cache memory"):
        evaluated(run, corpus, "plain", "+memory.knn_size=8")


def test_more_compressed_slots_at_evaluation(tmp_path, corpus):
    run = train(tmp_path, corpus, "memory=compressive", "memory.cmem_len=4", "memory.cmem_rate=2")
    trained = evaluated(run, corpus, "trained")
    wider = evaluated(run, corpus, "wider", "+memory.cmem_len=16")
    assert "cmem_len=16" in wider["memory"] and wider["val/loss"] != trained["val/loss"]
    with pytest.raises(ConfigError, match="memory.cmem_rate cannot change at evaluation"):
        evaluated(run, corpus, "refused", "+memory.cmem_rate=4")
