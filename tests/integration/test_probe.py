"""The memory probe's reach prediction, scorer and scoring options (the training itself is a documented command)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers.paths import ROOT
from xl import probe
from xl.data.recall import KEYS, recall_bytes
from xl.probe import Row, query_distances, reach_accuracy, recall_accuracy, table, write_report


def test_query_distances_against_a_walk_back():
    data = np.frombuffer(recall_bytes([1, 5, 17, 64], 50, seed=3, repeat=3, gap=7), dtype=np.uint8)
    keys = set(KEYS)
    expected = [next((p - i for i in range(p, -1, -1) if data[i] in keys), -1) for p in range(len(data))]
    np.testing.assert_array_equal(query_distances(data), expected)


def brute_force_reach(query: int, held: list[int], seg_len: int) -> int:
    """Farthest distance back from which information reaches ``query`` through one attention hop per entry of
    ``held`` (the query's first), each hop's keys reaching ``held`` positions before its segment."""
    frontier = {query}
    for reach in held:
        frontier = {t for s in frontier for t in range(s - reach - s % seg_len, s + 1)}
    return query - min(frontier)


@pytest.mark.parametrize(("held", "seg_len"), [([0], 8), ([0, 0], 8), ([8], 8), ([8, 8], 8), ([12, 12], 8),
                                                ([5, 5, 5], 4), ([3, 20], 8), ([20, 3], 8), ([7, 0, 13], 5)])
def test_reach_prediction_matches_the_attention_windows(held, seg_len):
    base = 10 * (sum(held) + seg_len) * len(held)  # a multiple of the segment: position p of a segment is base + p
    base -= base % seg_len
    reach = [brute_force_reach(base + p, held, seg_len) for p in range(seg_len)]
    for d in range(1, max(reach) + seg_len + 2):
        seen = sum(r >= d for r in reach) / seg_len
        assert reach_accuracy(d, held, seg_len) == pytest.approx(seen + (1 - seen) / len(KEYS))


def test_reach_prediction_known_values():
    chance = 1 / len(KEYS)
    assert reach_accuracy(4, [0, 0], 32) == pytest.approx(28 / 32 + 4 / 32 * chance)  # no memory, no relay
    assert reach_accuracy(32, [0, 0], 32) == pytest.approx(chance)
    assert reach_accuracy(32, [32], 32) == pytest.approx(1.0)
    assert reach_accuracy(48, [32], 32) == pytest.approx(0.5 + 0.5 * chance)
    assert reach_accuracy(64, [32], 32) == pytest.approx(chance)
    assert reach_accuracy(128, [64, 64], 32) == pytest.approx(1.0)
    assert reach_accuracy(160, [64, 64], 32) == pytest.approx(chance)
    # a retrieval store of 512 in the top layer of two, beside a cache of 32: one hop sees 32 + 512 + p back; the relay
    # goes on from the segment boundary it reached, 32 further: 576 + p
    assert reach_accuracy(544, [544], 32) == pytest.approx(1.0)
    assert reach_accuracy(560, [544], 32) == pytest.approx(0.5 + 0.5 * chance)
    assert reach_accuracy(576, [544, 32], 32) == pytest.approx(1.0)
    assert reach_accuracy(592, [544, 32], 32) == pytest.approx(0.5 + 0.5 * chance)
    assert reach_accuracy(608, [544, 32], 32) == pytest.approx(chance)
    # memory tokens trained through windows: a recurrence, no bound
    assert reach_accuracy(10 ** 6, [math.inf], 32) == 1.0 and reach_accuracy(10 ** 6, [32, math.inf], 32) == 1.0


class Oracle(torch.nn.Module):
    """Predicts the true next byte, or a fixed letter: the scorer must give 1.0 and about chance."""

    def __init__(self, rows: np.ndarray, perfect: bool) -> None:
        super().__init__()
        self.rows, self.perfect, self.position = rows, perfect, 0

    def forward(self, x, mems, targets=None, **context):
        assert targets is None and context["mem_len"] == 0
        start = self.position
        self.position += x.size(1)
        target = torch.from_numpy(self.rows[:, start + 1:start + 1 + x.size(1)].astype(np.int64))
        if not self.perfect:
            target = torch.full_like(target, KEYS[0])
        return SimpleNamespace(logits=torch.nn.functional.one_hot(target, 256).float(), mems=None, kv=None)


def test_scorer_counts_hits_per_distance():
    rows = np.frombuffer(recall_bytes([3, 9], 300, seed=0, gap=10), dtype=np.uint8)[:2000].reshape(2, 1000)
    perfect = recall_accuracy(Oracle(rows, True), rows, seg_len=32, mem_len=0)
    assert set(perfect) == {3, 9} and all(hit == total for hit, total in perfect.values())
    constant = recall_accuracy(Oracle(rows, False), rows, seg_len=32, mem_len=0)
    rate = sum(h for h, _ in constant.values()) / sum(t for _, t in constant.values())
    assert 0.0 < rate < 0.15


def test_the_probe_trains_with_the_users_memory_settings(tmp_path):
    """The documented memory-token probe (data.source.gap=400 memory=tokens): the run it builds keeps the user's gap
    and trains memory tokens through windows of two segments, as conf/memory/tokens.yaml sets."""
    from xl.probe import probe_config
    from xl.training.build import build_run

    cfg = probe_config(32, 32, [4, 16], 10, tmp_path, ["data.source.gap=400", "memory=tokens"])
    assert (cfg.data.source.gap, cfg.memory.mem_len, cfg.memory.num_tokens, cfg.memory.grad_segments) == (400, 32, 4, 2)
    assert probe_config(32, 64, [4], 10, tmp_path).data.source.gap == 2 * 64 + 32  # beyond a relayed reach
    module = build_run(cfg).module
    assert module.grad_segments == 2 and module.config.memory.num_tokens == 4 and module.config.mem_len == 32


def test_the_probe_prints_its_progress_and_table_and_none_of_lightnings_notices(tmp_path):
    """python -m xl.probe, shrunk: its own lines, without Lightning's litlogger tip, device banner, precision and
    batch-limit notices, or the warning about Lightning's internals."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    result = subprocess.run([sys.executable, "-m", "xl.probe", "data.source.episodes=60",
                             "data.source.eval_episodes=20", "callbacks.progress_bar.refresh_rate=0", "--steps", "2",
                             "--mem-lens", "0", "--distances", "4", "16", "--out", str(tmp_path / "probe")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "mem_len=0 seed=1234: trained and scored in" in out and "| mem_len | d=4 | d=16 |" in out
    noise = ("litlogger", "GPU available", "TPU available", "Automatic Mixed Precision", "limit_train_batches",
             "max_steps=2` reached", "LeafSpec")
    assert [n for n in noise if n in out] == []


def test_scoring_with_other_episodes_and_a_larger_store_reads_the_trained_weights(tmp_path):
    """--score: the trained weights, with the store of the scoring's size, read the scoring's episodes (their
    distances only)."""
    from xl.probe import probe_config, scored_memory, scoring
    from xl.training.build import build_run

    train = ["data.source.gap=60", "data.source.episodes=40", "data.source.eval_episodes=8", "memory=knn",
             "memory.knn_size=16", "memory.knn_top_k=4"]
    score = ["data.source.gap=200", "data.source.distances=[40,120]", "memory.knn_size=128"]
    cfg = probe_config(8, 8, [4, 16], 2, tmp_path, train)
    scored_cfg = probe_config(8, 8, [4, 16], 2, tmp_path, [*train, *score])
    memory = scored_memory(cfg, scored_cfg)
    assert (memory.knn_size, memory.knn_top_k) == (128, 4)
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    model, rows = scoring(run.module.model, memory, scored_cfg)
    assert model.config.memory.knn_size == 128 and model.config.n_layer == run.module.model.config.n_layer
    assert memory.held(8, 1, 2) == [8, 8 + 128]  # the predictions read the scored store
    for (name, a), b in zip(model.state_dict().items(), run.module.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert {int(d) for d in query_distances(rows[0, :-1])[rows[0, :-1] == ord("?")]} <= {40, 120}
    assert set(recall_accuracy(model, rows, 8, 8)) == {40, 120}


@pytest.mark.parametrize("score,says", [
    (["model.n_layer=3"], "--score model.n_layer=3 would change the trained run"),
    (["memory.knn_layers=[0]"], "memory.knn_layers cannot change at evaluation"),
])
def test_scoring_that_would_change_the_trained_run_is_refused_before_training(tmp_path, score, says):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "xl.probe", "memory=knn", "--mem-lens", "8", "--steps", "2",
                             "--out", str(tmp_path / "probe"), "--score", *score],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and says in result.stderr and "trained and scored" not in result.stdout
    assert not (tmp_path / "probe").exists()


def test_cells_over_seeds_by_hand(tmp_path):
    """Hand-made per-seed counts (hits, queries) of a cache of 32 and of a memory holding 48 over a cache of 16: the
    mean, and the seeds beating the cache's one-hop prediction by more than two standard errors (at chance, 1/16 over
    100 queries: 0.111; at d = 48 for the cache of 32, 0.531 + 0.100 = 0.631)."""
    rows = [Row(32, [32, 32], [{16: (100, 100), 48: (60, 100), 80: (12, 100)},
                               {16: (100, 100), 48: (50, 100), 80: (11, 100)},
                               {16: (99, 100), 48: (90, 100), 80: (30, 100)}]),
            Row(16, [48, 48], [{16: (100, 100), 48: (100, 100), 80: (6, 100)},
                               {16: (100, 100), 48: (53, 100), 80: (7, 100)},
                               {16: (100, 100), 48: (5, 100), 80: (40, 100)}])]
    expected = """| mem_len | d=16 | d=48 | d=80 |
|---|---|---|---|
| 32 | 1.00 (0/3) | 0.67 (1/3) | 0.18 (2/3) |
| 32: one hop | 1.00 | 0.53 | 0.06 |
| 32: 2 hops | 1.00 | 1.00 | 0.53 |
| 16 | 1.00 (0/3) | 0.53 (2/3) | 0.18 (1/3) |
| 16: one hop | 1.00 | 1.00 | 0.06 |
| 16: 2 hops | 1.00 | 1.00 | 1.00 |
| 16: cache alone, one hop | 1.00 | 0.06 | 0.06 |

Mean over seeds 1, 2, 3; (k/n): the seeds whose accuracy beats the cache's one-hop prediction by more than two \
standard errors."""
    assert table(rows, [16, 48, 80], 32, 2, [1, 2, 3]) == expected
    assert write_report(rows, [16, 48, 80], tmp_path, 32, 2, [1, 2, 3]) == expected
    results = json.loads((tmp_path / "probe.json").read_text())
    cell = results["rows"][1]["cells"]["48"]
    assert results["seeds"] == [1, 2, 3] and results["rows"][1]["held"] == [48, 48]
    assert cell["accuracy"] == [1.0, 0.53, 0.05] and cell["queries"] == [100] * 3 and cell["above_cache"] == 2
    assert cell["mean"] == pytest.approx(1.58 / 3)
    assert (tmp_path / "probe.md").read_text() == expected + "\n" and (tmp_path / "probe.png").is_file()
    # one seed: the accuracies alone, as before
    assert table(rows[:1], [48], 32, 2, [7]).splitlines()[2] == "| 32 | 0.67 |"


def test_several_seeds_run_one_after_another_into_their_own_folders(tmp_path, capsys):
    """python -m xl.probe --seeds 1 2 on a compressive memory, shrunk: one run per seed in its own folder, the table's
    cells count the seeds, and the predictions are the compressive memory's (8 positions and 4 slots of 2)."""
    out = tmp_path / "probe"
    probe.main(["data.source.episodes=40", "data.source.eval_episodes=10", "callbacks.progress_bar.refresh_rate=0",
                "memory=compressive", "memory.cmem_len=4", "memory.cmem_rate=2", "--steps", "2", "--mem-lens", "8",
                "--distances", "4", "12", "--seeds", "1", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "mem_len=8 seed=1: trained" in printed and "mem_len=8 seed=2: trained" in printed
    assert re.search(r"^\| 8 \| \d\.\d\d \(\d/2\) \| \d\.\d\d \(\d/2\) \|$", printed, re.M), printed
    assert "| 8: cache alone, one hop |" in printed and f"results: {out}/" in printed
    results = json.loads((out / "probe.json").read_text())
    assert results["seeds"] == [1, 2] and results["rows"][0]["held"] == [16, 16]
    assert all(len(c["accuracy"]) == 2 for c in results["rows"][0]["cells"].values())
    assert (out / "mem8-seed1").is_dir() and (out / "mem8-seed2").is_dir()


def test_each_probe_gets_its_own_folder(tmp_path, monkeypatch):
    class Now(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 6, 9, 5, 7)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(probe, "datetime", Now)
    first = probe.output_folder(None, [], [])
    assert first == Path("outputs/probe/2026-12-06/09-05-07")
    first.mkdir(parents=True)
    assert probe.output_folder(None, [], []) == Path("outputs/probe/2026-12-06/09-05-07-1")
    assert probe.output_folder(tmp_path / "new", [], []) == tmp_path / "new"


@pytest.mark.parametrize("argv,says", [
    (["--out", "{used}"], "is not an empty folder; name a new one"),
    (["seed=3", "--seeds", "1", "2"], "give the seeds with --seeds only"),
    (["--seeds", "1", "1"], "names a seed twice"),
])
def test_a_used_folder_or_seeds_given_twice_are_refused_before_training(tmp_path, capsys, argv, says):
    used = tmp_path / "used"
    used.mkdir()
    (used / "probe.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        given = [a.replace("{used}", str(used)) for a in argv]
        probe.main(given if "--out" in argv else [*given, "--out", str(tmp_path / "other")])
    assert says in str(stop.value.code) and str(stop.value.code).startswith("error: ")
    assert "trained" not in capsys.readouterr().out and not (tmp_path / "other").exists()
    assert (used / "probe.json").read_text() == "{}"
