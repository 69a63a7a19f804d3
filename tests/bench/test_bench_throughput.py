"""``python -m xl.bench`` runs every part and checks our attention against the explicit formulation."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.paths import ROOT
from xl.bench.throughput import measure


def test_benchmark_reports_every_part(capsys):
    results = measure(["--steps", "1", "--warmup", "0", "--repeats", "1", "--threads", "1", "--batch", "2",
                    "--tgt-len", "8", "--set", "n_layer=1", "--set", "d_model=32", "--set", "d_head=8",
                    "--set", "d_inner=64", "--set", "mem_len=8"])
    assert results["train_tok_s"] > 0 and results["eval_tok_s"] > 0
    assert results["attn_max_diff"] < 1e-4 and results["attn_fwd_bwd_ratio"] > 0
    out = capsys.readouterr().out
    assert "train tokens/s" in out and "explicit/ours" in out


def test_package_runs_the_throughput_benchmark():
    result = subprocess.run([sys.executable, "-m", "xl.bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m xl.bench ")
    assert "--only {train,eval,attn}" in result.stdout
