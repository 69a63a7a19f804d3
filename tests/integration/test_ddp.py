"""Two real CPU processes (gloo DDP) through train.py: per-rank memory, rows, metrics and resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import tiny_overrides
from tests.helpers.paths import ROOT
from xl.data import split_streams


def ddp_train(tmp_path: Path, corpus, run: str, *extra: str, code: int = 0) -> dict[int, list[dict]]:
    """Run train.py with 2 CPU processes, expecting exit status ``code``; return the probe's records per rank (and,
    for a run that stops, its last line under the key "said")."""
    probe_dir = tmp_path / run / "probe"
    args = [*tiny_overrides(tmp_path / run, corpus), "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
            "test=false", "trainer.max_steps=8", "trainer.val_check_interval=4", "model.dropout=0.1",
            "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.every_n_train_steps=4",
            "trainer.deterministic=true", "+callbacks.probe._target_=tests.helpers.ddp_probe.RankProbe",
            f"+callbacks.probe.out_dir={probe_dir}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == code, result.stderr[-4000:]
    out = result.stdout + result.stderr
    if code:
        records = {r: [json.loads(line) for line in open(probe_dir / f"rank{r}.jsonl")] for r in (0, 1)}
        return {**records, "said": [line for line in result.stderr.splitlines() if line.startswith("error: ")]}
    assert out.count("[train][INFO] - results") == 1, out[-4000:]  # printed by rank 0 only
    warned = [line for line in out.splitlines() if "Warning" in line or re.search(r"\.py:\d+: ", line)]
    assert len(warned) == len(set(warned)), warned  # each warning once, not once per rank
    assert "GLOBAL_RANK" not in out  # Lightning's per-process banner
    return {r: [json.loads(line) for line in open(probe_dir / f"rank{r}.jsonl")] for r in (0, 1)}


def events(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["event"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("memory", [(), ("memory=knn", "memory.knn_size=32", "memory.knn_top_k=4")],
                         ids=["cache", "knn"])
def test_ddp_ranks_keep_their_own_memory_rows_and_resume(tmp_path, corpus, memory):
    """The retrieval memory's stores are part of each rank's state (its memory sum counts them): a store of 32
    entries fills after two segments of 16 and then evicts, and the resume continues every rank's stores."""
    whole = ddp_train(tmp_path, corpus, "whole", *memory)
    ids = np.frombuffer(corpus["train"].read_bytes(), dtype=np.uint8)
    train = {r: events(whole[r], "train") for r in (0, 1)}
    assert [e["step"] for e in train[0]] == list(range(1, 9))
    for r in (0, 1):
        rows = split_streams(ids, 4, rank=r, world_size=2)
        # Each rank reads its own rows, one segment after the other.
        assert [e["first_tokens"] for e in train[r]] == [rows[:, 16 * t].tolist() for t in range(8)]
    # The ranks' memories differ at every step: nothing broadcasts rank 0's memory over rank 1's.
    assert all(a["memory_sum"] != b["memory_sum"] for a, b in zip(train[0], train[1], strict=True))
    # Validation loss is the token-weighted mean over both ranks.
    for local0, local1, logged in zip(events(whole[0], "val_local")[1:], events(whole[1], "val_local")[1:],
                                      events(whole[0], "val"), strict=True):
        expected = (local0["sum"] + local1["sum"]) / (local0["weight"] + local1["weight"])
        assert logged["loss"] == pytest.approx(expected, rel=1e-6)

    ddp_train(tmp_path, corpus, "first", "trainer.max_steps=4", *memory)
    resumed = ddp_train(tmp_path, corpus, "second", f"ckpt_path={tmp_path / 'first' / 'run'}", *memory)
    for r in (0, 1):
        again = events(resumed[r], "train")
        assert [e["step"] for e in again] == [5, 6, 7, 8]
        assert [e["first_tokens"] for e in again] == [e["first_tokens"] for e in train[r][4:]]
        assert [e["loss"] for e in again] == [e["loss"] for e in train[r][4:]]
        assert [e["memory_sum"] for e in again] == [e["memory_sum"] for e in train[r][4:]]


@pytest.mark.slow
@pytest.mark.parametrize("in_validation", [False, True], ids=["training", "validation"])
def test_a_signal_to_one_rank_stops_every_rank_at_one_step_and_the_resume_is_exact(tmp_path, corpus, in_validation):
    """SIGTERM reaches rank 1 alone (as when a scheduler signals one task), during step 3 or during the validation
    after step 4: both ranks stop after the same step (and after that validation, which runs in full on both), with
    one last.ckpt and one sentence, said by rank 0 (which did not hear the signal itself); the resume of the run
    continues every rank exactly."""
    whole = ddp_train(tmp_path, corpus, "whole")
    at = 4 if in_validation else 3
    signal_rank = ["+callbacks.signal._target_=tests.helpers.ddp_probe.SignalRank", "+callbacks.signal.rank=1",
                   "+callbacks.signal.signum=15", f"+callbacks.signal.at_step={at}",
                   f"+callbacks.signal.in_validation={in_validation}"]
    first = ddp_train(tmp_path, corpus, "first", *signal_rank, code=1)
    run = tmp_path / "first" / "run"
    after = f"after step {at} and its validation" if in_validation else f"after step {at}"
    assert first["said"] == [f"error: stopped by a signal to another process {after}, checkpoint "
                             f"{run}/checkpoints/last.ckpt; resume with: python train.py ckpt_path={run}"]
    for r in (0, 1):
        assert [e["step"] for e in events(first[r], "train")] == list(range(1, at + 1))
    assert [e["step"] for e in events(first[0], "val")] == [4] * in_validation, "the validation ran in full"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == at

    resumed = ddp_train(tmp_path, corpus, "second", f"ckpt_path={run}")
    for r in (0, 1):
        again, unbroken = events(resumed[r], "train"), events(whole[r], "train")[at:]
        assert [e["step"] for e in again] == list(range(at + 1, 9))
        assert [(e["loss"], e["memory_sum"]) for e in again] == [(e["loss"], e["memory_sum"]) for e in unbroken]
    # The validation of step 4 runs once: in the first session when the signal came in it, else in the resume.
    assert [e["step"] for e in events(resumed[0], "val")] == ([8] if in_validation else [4, 8])
