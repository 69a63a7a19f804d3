"""The callbacks group's own callbacks: the job summary a sweep gathers (preemption: see test_resume, test_faults)."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import compose_config, tiny_overrides
from xl.device.footprint import cache_footprint
from xl.training.build import build_run
from xl.training.services.callbacks import JobSummary


def test_job_summary_records_metrics_speed_and_cost(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus))  # the callbacks group lists it
    run = build_run(cfg)
    assert any(isinstance(c, JobSummary) for c in run.trainer.callbacks)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    val_loss = float(run.trainer.callback_metrics["val/loss"])
    run.trainer.test(run.module, datamodule=run.datamodule, verbose=False)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["val/loss"] == pytest.approx(val_loss)
    assert results["test/bpb"] == pytest.approx(float(run.trainer.callback_metrics["test/bpb"]))
    assert (results["mem_len"], results["tgt_len"], results["batch_size"], results["unit"]) == (16, 16, 4, "bpb")
    assert results["params"] == sum(p.numel() for p in run.module.parameters())
    assert results["cache_mb"] == cache_footprint(16, 32, 2, 4).mib
    assert results["train_tokens"] == 20 * 4 * 16 and results["train_tok_s"] > 0 and results["wall_s"] > 0
    assert (results["grad_segments"], results["memory"], results["doc_boundaries"]) == (1, "cache", "reset")


def test_the_test_after_a_fit_keeps_the_fits_time_and_tokens(tmp_path, corpus):
    """The test reloads the best checkpoint, whose callback state holds the counts up to it: the summary still counts
    the whole fit, once, and no more time than the session took."""
    started = time.perf_counter()
    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus)))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    run.trainer.test(run.module, datamodule=run.datamodule, ckpt_path="best", verbose=False)
    session = time.perf_counter() - started
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["train_tokens"] == 20 * 4 * 16 and 0 < results["wall_s"] <= session


def test_job_summary_records_the_memory_variant_and_its_cache(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "memory=compressive", "memory.mem_len=8",
                         "memory.cmem_len=4", "memory.cmem_rate=2", "memory.doc_boundaries=ignore",
                         "trainer.max_steps=2", "test=false")
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (results["memory"], results["doc_boundaries"]) == ("compressive(cmem_len=4, cmem_rate=2, cmem_fn=conv)",
                                                              "ignore")
    assert results["cache_mb"] == cache_footprint(8, 32, 2, 4, slots=4).mib == cache_footprint(12, 32, 2, 4).mib
