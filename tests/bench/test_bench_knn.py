"""python -m xl.bench.knn: both parts run, and the estimate adds the retrieval's pieces to a segment."""

from __future__ import annotations

import pytest
import torch

from xl.bench.knn import full_store, main, recall, report_crossover, report_model, report_segment
from xl.memory.knn import store


def test_command_times_every_piece_and_estimates_the_ratio(capsys):
    pytest.importorskip("faiss")
    results = main(["--batch", "2", "--tgt-len", "8", "--size", "256", "--rounds", "1", "--cross-batch", "2",
                    "--cross-queries", "4", "--sizes", "64", "128", "--dtype", "bfloat16"])
    segment = results["segment"]
    for name in ("train/model", "eval/model", "train/local attention", "search (exact)", "train/gather",
                 "eval/gather", "write (ring)", "write (shift)", "eval/gated attention"):
        assert segment[name] > 0
    extra = (segment["search (exact)"] + segment["eval/gather"] + segment["write (ring)"]
             + segment["eval/gated attention"])
    assert segment["eval/ratio"] == pytest.approx((segment["eval/model"] + extra) / segment["eval/model"])
    assert set(results["crossover"]) == {64, 128} and 0 < results["recall"] <= 1
    model = results["model"]
    for mode in ("train", "eval"):
        assert model[f"{mode}/ratio"] == pytest.approx(model[f"{mode}/knn"] / model[f"{mode}/plain"])
    out = capsys.readouterr().out
    assert "estimated ratio" in out and "faiss/exact" in out and "knn/plain" in out and "mem_dtype bfloat16" in out


def test_the_reports_read_their_numbers():
    assert report_model({"train/plain": 2.0, "train/knn": 3.0, "eval/plain": 1.0, "eval/knn": 2.5})["eval/ratio"] == 2.5
    ms = {"train/model": 10.0, "eval/model": 4.0, "train/local attention": 2.0, "eval/local attention": 1.0,
          "search (exact)": 1.0, "train/gather": 0.5, "eval/gather": 0.5, "train/gated attention": 1.0,
          "eval/gated attention": 0.5,
          "write (ring)": 0.5, "write (shift)": 3.0}
    out = report_segment(ms, "exact")
    assert out["train/ratio"] == pytest.approx(1.3) and out["eval/ratio"] == pytest.approx(1.625)
    assert out["eval/vs local"] == pytest.approx(2.5)
    assert report_crossover({4: {"exact": 1.0, "faiss": 2.0}, 8: {"exact": 3.0, "faiss": 2.0}}) == 8
    assert report_crossover({4: {"exact": 1.0, "faiss": 2.0}}) is None


def test_the_benchmarks_store_is_full_and_a_store_agrees_with_itself():
    state = full_store(2, 3, 64, 8)
    assert store.fill(state).tolist() == [64, 64]
    norms = state[store.KEYS].norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    assert recall(state, torch.randn(2, 3, 5, 8), 4, torch.float32) == 1.0
