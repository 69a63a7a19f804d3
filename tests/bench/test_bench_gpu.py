"""``python -m xl.bench.gpu``: the FLOP count is exact, and the benchmark runs (on CPU here, as a smoke test)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from xl.bench.gpu import experiment_config, experiment_shape, main, model_flops, run_estimate
from xl.bench.shared import CONFIG_S
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL


@pytest.mark.parametrize("mem_len", [0, 24])
def test_model_flops_equal_torch_flop_counter(mem_len):
    cfg = XLConfig(vocab_size=96, n_layer=2, n_head=4, d_model=32, d_head=12, d_inner=80, mem_len=mem_len)
    model = TransformerXL(cfg)
    x = torch.randint(0, 96, (3, 16))
    mems = model(x).mems if mem_len else None
    mems = model(x, mems).mems if mem_len else None  # a full memory of 24 from two segments of 16
    with FlopCounterMode(display=False) as forward:
        with torch.no_grad():
            model(x, mems, targets=x)
    with FlopCounterMode(display=False) as train:
        model(x, mems, targets=x).loss.backward()
    # Without gradients CPU SDPA runs a fused kernel that the counter does not see: the content scores and the
    # weighted sum (2 × 2·L·K·inner per row and layer) are missing from its count, and only they.
    attention_core = cfg.n_layer * 3 * 2 * 2 * 16 * (16 + mem_len) * cfg.n_head * cfg.d_head
    assert forward.get_total_flops() == model_flops(cfg, 3, 16, mem_len, train=False) - attention_core
    assert train.get_total_flops() == model_flops(cfg, 3, 16, mem_len, train=True)


def test_benchmark_runs_and_reports(capsys):
    r = main(["--device", "cpu", "--precision", "32-true", "--steps", "1", "--warmup", "1", "--batch", "2",
              "--set", "n_layer=1", "--set", "d_model=64", "--set", "n_head=2", "--set", "d_head=32",
              "--set", "d_inner=128", "--set", "mem_len=64"])
    out = capsys.readouterr().out
    assert r["tokens_per_s"] > 0 and math.isnan(r["mfu"]) and "tokens/s" in out and "MFU" in out
    assert 0 < r["loss"] < 10  # about ln 256 = 5.5 for a fresh model


def test_experiment_shapes():
    assert experiment_shape("S") == (CONFIG_S, 8, 128)
    fields, batch, tgt_len = experiment_shape("enwik8_base")  # the paper's setup, from conf/experiment
    assert (fields["n_layer"], fields["d_model"], fields["mem_len"], batch, tgt_len) == (12, 512, 512, 22, 512)


def test_an_experiment_s_time_is_estimated_from_the_measured_rate(capsys):
    """--estimate: trainer.max_steps of batch × tgt_len tokens at the measured tokens/s; a retrieval store is filled
    first as at the last curriculum stage (babilong_gpu: 64K tokens of its 131,072 entries)."""
    composed = experiment_config("babilong_gpu")
    fields, batch, tgt_len = experiment_shape("babilong_gpu", composed)
    assert (fields["vocab_size"], fields["memory"]["knn_size"], batch, tgt_len) == (16002, 131072, 32, 256)
    assert run_estimate(composed, fields)[:2] == (40000, 64000)
    composed = experiment_config("babilong_long")
    assert run_estimate(composed, experiment_shape("babilong_long", composed)[0])[:2] == (3000, 0)  # the cache alone
    r = main(["--experiment", "babilong_long", "--estimate", "--device", "cpu", "--precision", "32-true",
              "--steps", "1", "--warmup", "1", "--batch", "2", "--set", "n_layer=1"])
    out = capsys.readouterr().out
    assert r["estimate_h"] == pytest.approx(3000 * 2 * 128 / r["tokens_per_s"] / 3600)
    assert f"estimate : 3,000 steps of 2 x 128 tokens: {r['estimate_h']:.1f} h" in out
