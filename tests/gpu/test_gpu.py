"""The GPU checks (tests/gpu/checks.py), each run on a CUDA GPU (marked ``gpu``, skipped without one) and as a dry run
on the CPU at tiny sizes (in the default suite). On a GPU machine: ``python -m pytest tests/gpu -m gpu -s``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gpu.checks import (
    PLANS,
    Context,
    Result,
    check_compressive,
    check_decoding,
    check_eval_memory,
    check_precision,
    check_resume,
    check_throughput,
    write_corpus,
)
from tests.helpers.run_if import gpu_param, run_if

DEVICES = ["cpu", gpu_param("cuda")]


@pytest.fixture(scope="module")
def gpu_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_corpus(tmp_path_factory.mktemp("gpu-corpus"))


@pytest.fixture(params=DEVICES)
def ctx(request: pytest.FixtureRequest, gpu_corpus: dict[str, Path], tmp_path: Path) -> Iterator[Context]:
    # Before any cuBLAS call: what deterministic cuBLAS needs (Lightning sets it too, but only when a trainer starts).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    context = Context(PLANS[request.param], tmp_path)
    context.corpus = gpu_corpus
    yield context


def passed(result: Result) -> None:
    print(f"{result.status}: {result.detail}")  # the figures, with -s
    assert result.status == "PASS", result.detail


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_precision_trains_with_clipping(ctx: Context, precision: str) -> None:
    if precision not in ctx.plan.precisions:
        pytest.skip(f"{precision} needs a CUDA GPU")
    passed(check_precision(ctx, precision))


def test_resume_equals_the_unbroken_run(ctx: Context) -> None:
    result = check_resume(ctx)
    passed(result)
    if ctx.plan.device == "cpu":
        assert "max |Δw| 0 (two straight runs: equal)" in result.detail  # exact on the CPU


def test_evaluation_memory_is_released(ctx: Context) -> None:
    passed(check_eval_memory(ctx))


def test_decoding_picks_what_the_forward_picks(ctx: Context) -> None:
    passed(check_decoding(ctx))


def test_compressive_memory_trains_and_decodes(ctx: Context) -> None:
    passed(check_compressive(ctx))


@pytest.mark.parametrize("which", [0, 1], ids=["S", "enwik8_base"])
def test_throughput(ctx: Context, which: int) -> None:
    experiment, overrides, batch = ctx.plan.bench[which]
    passed(check_throughput(ctx, experiment, overrides, batch))


@pytest.mark.gpu
@run_if(cuda=True)
def test_the_babilong_gpu_recipe_s_time_is_estimated() -> None:
    """experiment=babilong_gpu's training time at the rate measured here, its stores filled as at 64K tokens (the
    estimate docs/babilong.md gives for one GPU; on the CPU, tests/bench/test_bench_gpu.py checks the sum)."""
    from xl.bench.gpu import main

    r = main(["--experiment", "babilong_gpu", "--estimate", "--precision", "bf16-mixed", "--steps", "10"])
    assert r["tokens_per_s"] > 0 and r["estimate_h"] > 0


def test_the_gpu_plan_runs_every_check_in_full() -> None:
    plan = PLANS["cuda"]
    assert plan.precisions == ("bf16-mixed", "16-mixed", "32-true")
    assert plan.run_precision == "bf16-mixed" and plan.bench_precision == "bf16-mixed"
    assert [experiment for experiment, *_ in plan.bench] == ["S", "enwik8_base"]
