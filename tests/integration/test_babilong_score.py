"""python -m xl.babilong: answers read through the model's memory segment by segment are those of one forward over
the whole text; a run trained on qa1 for a few steps is scored at two lengths, with results.json, the heatmap and a
W&B table; -m ends with one summary; bad settings stop in one sentence."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_hydra_main
from xl import train
from xl.babilong import score
from xl.babilong.score import Reader
from xl.data.tokenizers import make_tokenizer
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL

PROMPTS = ["Mary went to the kitchen.\nQuestion: Where is Mary?\n", "Question: Where?\n",
           "John moved to the garden. Mary moved to the office. John went back to the hallway.\n"
           "Question: Where is John?\n"]


def greedy_by_recomputation(model: TransformerXL, ids: list[int], n: int, stop: int
                            ) -> tuple[torch.Tensor, list[int]]:
    """The logits after the text and its greedy continuation, each token from a fresh forward over the whole text
    with no memory: the obviously right answer."""
    tokens = torch.tensor([ids], dtype=torch.long)
    first, new = None, []
    for _ in range(n):
        logits = model(tokens, mem_len=0).logits[0, -1]
        first = logits if first is None else first
        new.append(int(logits.argmax()))
        if new[-1] == stop:
            break
        tokens = torch.cat([tokens, torch.tensor([[new[-1]]])], 1)
    return first, new


def test_answers_read_segment_by_segment_with_filler_are_those_of_one_forward_over_each_text():
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64,
                                   dropout=0.0, mem_len=200)).double().eval()
    tokenizer = make_tokenizer("byte")
    reader = Reader(model, tokenizer, {"window": 200, "clamp_len": -1, "same_length": False}, seg_len=7,
                    max_new_tokens=6)
    expected = [greedy_by_recomputation(model, [int(i) for i in tokenizer.encode(p)], 6, 10) for p in PROMPTS]
    _, logits = reader.read(PROMPTS)  # three rows of different lengths, read together in segments of 7
    for row, (first, _) in zip(logits, expected, strict=True):
        assert torch.allclose(row, first, rtol=0, atol=1e-12)
    assert (logits[0] - logits[1]).abs().max() > 1e-6  # the texts differ, and so do their logits, far beyond 1e-12
    assert reader.continuations(PROMPTS) == [new for _, new in expected]
    assert [reader.continuations([p])[0] for p in PROMPTS] == [new for _, new in expected]
    assert reader.answer(PROMPTS) == [tokenizer.decode(new).split("\n")[0] for _, new in expected]


TRAIN = ["data=babilong", "model=tiny", "data.tasks=[qa1]", "data.length=200", "data.train_samples=40",
         "data.eval_samples=6", "data.tgt_len=32", "data.batch_size=2", "memory.mem_len=32", "trainer.max_steps=4",
         "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
         "trainer.num_sanity_val_steps=0", "callbacks.progress_bar.refresh_rate=0", "logger=none"]


@pytest.fixture(scope="module")
def qa1_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("babilong")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("XL_CACHE_DIR", str(folder / "cache"))
        run_hydra_main(train.main, ["train.py", *TRAIN, f"hydra.run.dir={folder / 'run'}"], monkeypatch)
    return folder / "run"


def test_a_run_trained_on_qa1_is_scored_at_two_lengths(qa1_run, tmp_path, monkeypatch, capsys):
    trained = json.loads((qa1_run / "results.json").read_text())
    assert trained["scored"] == "answer tokens only"
    out = tmp_path / "score"
    monkeypatch.setenv("XL_CACHE_DIR", str(qa1_run.parent / "cache"))
    run_hydra_main(score.main, ["xl.babilong", f"ckpt={qa1_run}", "tasks=[qa1]", "lengths=[0,300]", "samples=5",
                                "batch_size=3", f"hydra.run.dir={out}"], monkeypatch)
    values = json.loads((out / "results.json").read_text())
    assert values["run"] == str(qa1_run.resolve()) and values["lengths"] == ["0", "300"]
    assert [(c["task"], c["length"], c["samples"]) for c in values["cells"]] == [("qa1", "0", 5), ("qa1", "300", 5)]
    for cell in values["cells"]:
        assert values["accuracy"]["qa1"][cell["length"]] == cell["correct"] / 5
    assert 0 < values["cells"][1]["mean_context_tokens"] <= 300 < values["cells"][1]["mean_context_tokens"] + 256
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B really logged, offline
    printed = capsys.readouterr().out
    assert "babilong accuracy" in printed and "qa1" in printed and "heatmap.png" in printed


def test_a_sweep_ends_with_one_summary_table_and_plot(qa1_run, tmp_path, monkeypatch):
    monkeypatch.setenv("XL_CACHE_DIR", str(qa1_run.parent / "cache"))
    sweep = tmp_path / "sweep"
    run_hydra_main(score.main, ["xl.babilong", "-m", f"ckpt={qa1_run}", "tasks=[qa1,qa4]", "lengths=[0]",
                                "samples=2", "seed=0,1", "logger=none", f"hydra.sweep.dir={sweep}"], monkeypatch)
    lines = (sweep / "summary.csv").read_text().splitlines()
    assert lines[0] == "job,qa1/0,qa4/0,mean/0" and len(lines) == 3
    assert {line.split(",")[0] for line in lines[1:]} == {"seed=0", "seed=1"}
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert "| job | qa1/0 |" in (sweep / "summary.md").read_text()


@pytest.mark.parametrize("setting,message", [
    ("tasks=[qa7]", "tasks must be a list of qa1, qa2, qa3, qa4, qa5"),
    ("lengths=[0,2kb]", "lengths must be a list of lengths"),
    ("samples=0", "samples must be"),
])
def test_bad_settings_stop_in_one_sentence(qa1_run, setting, message, monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as stop:
        run_hydra_main(score.main, ["xl.babilong", f"ckpt={qa1_run}", setting, f"hydra.run.dir={tmp_path}"],
                       monkeypatch)
    assert str(stop.value.code).startswith("error: ") and message in str(stop.value.code)
    assert "\n" not in str(stop.value.code)


def test_the_library_does_not_import_the_application():
    library = ["answers", "background", "data", "lengths", "samples", "tasks", "world"]
    import xl.data.babilong

    folder = Path(xl.data.babilong.__file__).parent
    for name in library:
        text = (folder / f"{name}.py").read_text()
        assert "xl.babilong.score" not in text and "xl.babilong.report" not in text, name
    assert sys.modules["xl.babilong.score"] is score


def test_evaluate_refuses_the_modes_that_would_score_every_target_of_answer_only_data(qa1_run, monkeypatch, tmp_path):
    import xl.evaluate

    monkeypatch.setenv("XL_CACHE_DIR", str(qa1_run.parent / "cache"))
    with pytest.raises(SystemExit) as stop:
        run_hydra_main(xl.evaluate.main, ["xl/evaluate.py", f"ckpt={qa1_run}", "vanilla=true", "logger=none",
                                          f"hydra.run.dir={tmp_path}"], monkeypatch)
    assert str(stop.value.code) == ("error: vanilla=true and per_document=true score every target, but this data "
                                    "scores answer tokens only; set data.loss=all, or vanilla=false and "
                                    "per_document=false")
