"""``python -m xl.gpucheck``: it refuses without CUDA, and its dry run (``--device cpu``) runs every check's code."""

from __future__ import annotations

import re

import pytest
import torch

from xl.gpucheck import PLANS, checks, main


def test_refuses_without_cuda_in_one_sentence(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main([])
    message = str(info.value.code)
    assert message.startswith("error: no CUDA GPU") and "--device cpu" in message and "\n" not in message
    assert capsys.readouterr().out == ""  # nothing started


def test_the_gpu_plan_runs_every_check_in_full():
    names = [name for name, _ in checks(PLANS["cuda"])]
    assert names == ["precision bf16-mixed", "precision 16-mixed", "precision 32-true", "resume", "eval memory",
                     "decoding", "compressive memory", "throughput S", "throughput enwik8_base"]
    assert PLANS["cuda"].run_precision == "bf16-mixed" and PLANS["cuda"].bench_precision == "bf16-mixed"


def test_dry_run_passes_every_check_it_can_run_on_cpu(capsys):
    status = main(["--device", "cpu"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if re.match(r"(PASS|FAIL|SKIP)  ", line)]
    assert len(lines) == len(checks(PLANS["cpu"])), out
    failed = [line for line in lines if not line.startswith(("PASS", "SKIP  precision 16-mixed"))]
    assert not failed, "\n".join(failed)
    assert status == 0 and "summary: 8 passed, 0 failed, 1 skipped" in out
    resume = next(line for line in lines if " resume " in line)
    assert "max |Δw| 0 (two straight runs: equal)" in resume  # exact on the CPU


def test_only_selects_checks_by_name(capsys):
    assert main(["--device", "cpu", "--only", "decoding"]) == 0
    out = capsys.readouterr().out
    assert "1 checks" in out and "PASS  decoding" in out and "resume" not in out
