"""python -m xl.babilong: answers read through the model's memory segment by segment are those of one forward over
the whole text; a run trained on qa1 for a few steps is scored at two lengths, with results.json, the heatmap and a
W&B table, and the rules that need no memory of the asked entity on the same samples; -m ends with one summary (and
its W&B run); a signal keeps the cells finished, and a rerun goes on from them; bad settings stop in one sentence."""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import run_hydra_main
from xl import train
from xl.babilong import score
from xl.babilong.baselines import ANSWERS, RULES, expected
from xl.babilong.heatmap import figure
from xl.babilong.report import facts_group
from xl.babilong.score import Reader
from xl.data.babilong.background import Sentences
from xl.data.babilong.data import token_counter
from xl.data.babilong.samples import samples
from xl.data.sources import StdlibSource
from xl.data.tokenizers import make_tokenizer
from xl.model.config import XLConfig
from xl.model.memory_settings import MemoryContext
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
    reader = Reader(model, tokenizer, MemoryContext(mem_len=200), seg_len=7,
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
        # Every answer is counted once by what it follows, the right ones as the accuracy counts them.
        assert set(cell["answers"]) <= set(ANSWERS) and sum(cell["answers"].values()) == 5
        assert cell["answers"].get("right", 0) == cell["correct"]
    assert 0 < values["cells"][1]["mean_context_tokens"] <= 300 < values["cells"][1]["mean_context_tokens"] + 256
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B really logged, offline
    printed = capsys.readouterr().out
    assert "babilong accuracy" in printed and "qa1" in printed and "heatmap.png" in printed
    assert "the model's wrong answers" in printed or all(c["correct"] == 5 for c in values["cells"])


def test_a_sweep_ends_with_one_summary_table_and_plot(qa1_run, tmp_path, monkeypatch):
    monkeypatch.setenv("XL_CACHE_DIR", str(qa1_run.parent / "cache"))
    sweep = tmp_path / "sweep"
    run_hydra_main(score.main, ["xl.babilong", "-m", f"ckpt={qa1_run}", "tasks=[qa1,qa4]", "lengths=[0]",
                                "samples=2", "seed=0,1", "logger=none", f"hydra.sweep.dir={sweep}"], monkeypatch)
    lines = (sweep / "summary.csv").read_text().splitlines()
    assert lines[0] == "job,qa1/0,qa4/0,mean/0"
    assert [line.split(",")[0] for line in lines[1:3]] == ["seed=0", "seed=1"]
    assert all(line.startswith("rule: ") for line in lines[3:])
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert "| job | qa1/0 |" in (sweep / "summary.md").read_text()


@pytest.mark.parametrize("setting,message", [
    ("tasks=[qa7]", "tasks must be a list of qa1, qa2, qa3, qa4, qa5"),
    ("lengths=[0,2kb]", "lengths must be a list of lengths"),
    ("samples=0", "samples must be"),
    ("+memory.mem_len=64", "memory.mem_len is the decoder's here: set mem_len=VALUE, the scorer's own key"),
    ("+memory.knn_top_k=4", "memory.knn_top_k is not a setting of the checkpoint's cache memory"),
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


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def scored(qa1_run: Path, out: Path, monkeypatch, *extra: str) -> dict:
    monkeypatch.setenv("XL_CACHE_DIR", str(qa1_run.parent / "cache"))
    run_hydra_main(score.main, ["xl.babilong", f"ckpt={qa1_run}", "tasks=[qa1,qa4]", "lengths=[0,300]", "samples=4",
                                "batch_size=3", "logger=none", f"hydra.run.dir={out}", *extra], monkeypatch)
    return json.loads((out / "results.json").read_text())


def test_the_rules_without_memory_are_scored_on_the_very_samples_and_reported(qa1_run, tmp_path, monkeypatch,
                                                                              capsys):
    values = scored(qa1_run, tmp_path / "score", monkeypatch, "logger=wandb")
    count = token_counter(make_tokenizer("byte"))
    for cell in values["cells"]:  # the same stories, made again here, give the same accuracies
        stream = samples(cell["task"], cell["tokens"], "test", 0, Sentences(StdlibSource(), "test", count), count)
        right = expected(cell["task"], [next(stream).story for _ in range(4)])
        assert cell["baselines"] == {rule: right[rule] / 4 for rule in RULES}
        for rule in RULES:
            assert values["baselines"][cell["task"]][rule][cell["length"]] == cell["baselines"][rule]
        assert sum(n for _, n in cell["facts"].values()) == cell["samples"] == 4  # each sample in one group
        stream = samples(cell["task"], cell["tokens"], "test", 0, Sentences(StdlibSource(), "test", count), count)
        stories = [next(stream).story for _ in range(4)]
        assert set(cell["facts_baselines"]) == set(cell["facts"]) == {facts_group(len(s.facts)) for s in stories}
        for name, rules in cell["facts_baselines"].items():
            group = [s for s in stories if facts_group(len(s.facts)) == name]
            assert rules == {rule: n / len(group) for rule, n in expected(cell["task"], group).items()}
    assert values["complete"] is True and values["identity"]["seed"] == 0
    printed = capsys.readouterr().out
    assert "rules without memory of the asked entity, on the same samples:" in printed
    qa1 = values["baselines"]["qa1"]["last named"]
    (line,) = [line for line in printed.splitlines() if line.startswith("  qa1 last named ")]
    assert line.split()[3:] == [f"{100 * qa1['0']:.0f}", f"{100 * qa1['300']:.0f}"]
    (table,) = (tmp_path / "score" / "wandb").glob("offline-run-*/files/media/table/babilong/accuracy_*.table.json")
    assert json.loads(table.read_text())["columns"][-4:] == list(RULES)


def test_the_heatmap_reads_at_a_glance(qa1_run, tmp_path, monkeypatch):
    values = scored(qa1_run, tmp_path / "score", monkeypatch)
    width, height = png_size(tmp_path / "score" / "heatmap.png")
    assert width >= 540 and height >= 300  # two lengths, two tasks
    fig = figure([("qa1 run", values)])
    panel, bar = fig.axes
    assert "4 samples per cell" in panel.get_title() and panel.get_title().startswith("qa1 run")
    assert bar.get_ylim() == (0.0, 100.0)  # the colour bar, from 0 to 100
    marks = {line.get_label(): line.get_ydata()[0] for line in bar.lines}
    cells = [100 * c["baselines"][rule] for c in values["cells"] for rule in RULES]
    for i, rule in enumerate(RULES):
        assert marks[rule] == pytest.approx(sum(cells[i::len(RULES)]) / len(values["cells"]))
    texts = [t.get_text() for t in panel.texts]
    best = max(RULES, key=lambda r: values["baselines"]["qa4"][r]["300"])
    assert f"{best} {100 * values['baselines']['qa4'][best]['300']:.0f}" in texts


def test_a_sweep_with_wandb_ends_with_its_summary_and_the_rules(qa1_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XL_CACHE_DIR", str(qa1_run.parent / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    sweep = tmp_path / "sweep"
    with warnings.catch_warnings(record=True) as warned:  # Hydra reports a failed callback as a warning
        warnings.simplefilter("always")
        run_hydra_main(score.main, ["xl.babilong", "-m", f"ckpt={qa1_run}", "tasks=[qa1]", "lengths=[0]",
                                    "samples=3", "seed=0,1", f"hydra.sweep.dir={sweep}"], monkeypatch)
    assert not [str(w.message) for w in warned if "Callback" in str(w.message)]
    assert "babilong summary: " + str(sweep / "summary.md") in capsys.readouterr().out
    assert len(list((sweep / "wandb").glob("offline-run-*"))) == 1
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert rows[0] == "job,qa1/0,mean/0"
    assert [r.split(",")[0] for r in rows[1:3]] == ["seed=0", "seed=1"]
    named = [r.split(",")[0] for r in rows[3:]]
    assert "rule: uniform" in named  # the same for both seeds: one row
    for rule in RULES:  # the others one row, or one per job where the seeds' samples differ
        assert f"rule: {rule}" in named or {f"rule: {rule} (seed=0)", f"rule: {rule} (seed=1)"} <= set(named)


class Unhandled(Exception):
    """A signal that reached the test's own handler: the scorer had none of its own."""


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """Each test leaves SIGTERM's and SIGINT's handlers as it found them; while it runs, a signal the scorer does not
    handle fails the test instead of ending pytest."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def unhandled(signum, frame):
        raise Unhandled(signal.Signals(signum).name)

    for s in before:
        signal.signal(s, unhandled)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def kill_at(monkeypatch, target: str, call: int, signum: int) -> None:
    """Send ``signum`` to this process at the ``call``-th call of score's ``target`` (inside it)."""
    real, calls = getattr(score, target), []

    def sending(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(score, target, sending)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_keeps_the_cells_finished_and_a_rerun_goes_on_from_them(qa1_run, tmp_path, monkeypatch, capsys,
                                                                         signum):
    whole = scored(qa1_run, tmp_path / "whole", monkeypatch)
    assert signal.getsignal(signum).__name__ == "unhandled"  # the scorer put the handler before back
    out = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        kill_at(patch, "score_cell", 3, signum)  # in the third of four cells
        with pytest.raises(SystemExit) as stop:
            scored(qa1_run, out, patch)
    assert stop.value.code == 128 + signum
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    assert err.strip().splitlines() == [
        f"error: stopped by {name}: 2 of 4 cells are kept in {out / 'results.json'} (marked "
        f"incomplete); to score the other 2, rerun the same command with "
        f"hydra.run.dir={out}"]
    kept = json.loads((out / "results.json").read_text())
    assert kept["complete"] is False
    assert [(c["task"], c["length"]) for c in kept["cells"]] == [("qa1", "0"), ("qa1", "300")]
    assert kept["accuracy"] == {"qa1": whole["accuracy"]["qa1"], "qa4": {}} and kept["mean"] == {}
    assert not (out / "heatmap.png").exists() and not list(out.glob("*.tmp"))
    cells = []
    real = score.score_cell
    monkeypatch.setattr(score, "score_cell", lambda *a: cells.append(a[2:4]) or real(*a))
    resumed = scored(qa1_run, out, monkeypatch)
    assert cells == [("qa4", 0), ("qa4", 300)]  # only the cells not kept
    assert resumed["complete"] is True
    assert [{k: v for k, v in c.items() if k not in ("seconds", "tok_s")} for c in resumed["cells"]] == \
        [{k: v for k, v in c.items() if k not in ("seconds", "tok_s")} for c in whole["cells"]]
    assert (resumed["accuracy"], resumed["mean"], resumed["baselines"]) == \
        (whole["accuracy"], whole["mean"], whole["baselines"])


def test_a_signal_while_results_are_written_stops_after_the_write(qa1_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "stopped"
    kill_at(monkeypatch, "write_json", 1, signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        scored(qa1_run, out, monkeypatch)
    assert stop.value.code == 143
    assert len(json.loads((out / "results.json").read_text())["cells"]) == 1
    assert not list(out.glob("*.tmp")) and "1 of 4 cells are kept" in capsys.readouterr().err


def test_a_signal_before_any_cell_says_that_nothing_is_kept(qa1_run, tmp_path, monkeypatch, capsys):
    kill_at(monkeypatch, "score_cell", 1, signal.SIGINT)
    with pytest.raises(SystemExit) as stop:
        scored(qa1_run, tmp_path / "out", monkeypatch)
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip() == (
        f"error: stopped by SIGINT before any cell was scored; nothing is kept; rerun "
        f"the same command with hydra.run.dir={tmp_path / 'out'} to start again")


def test_cells_of_other_settings_are_never_mixed_in(qa1_run, tmp_path, monkeypatch):
    out = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        kill_at(patch, "score_cell", 2, signal.SIGTERM)
        with pytest.raises(SystemExit):
            scored(qa1_run, out, patch)
    before = (out / "results.json").read_text()
    with pytest.raises(SystemExit) as stop:
        scored(qa1_run, out, monkeypatch, "seed=1")
    assert str(stop.value.code) == (f"error: {out / 'results.json'} holds another scoring (seed: 0, not 1); rerun it "
                                    f"with its own settings or set hydra.run.dir to another folder")
    assert (out / "results.json").read_text() == before


def test_a_study_tables_scorings_by_memory_over_seeds_against_the_rules(qa1_run, tmp_path, monkeypatch, capsys):
    """python -m xl.babilong.study: each memory's row is its scorings' mean and each seed's accuracy, counted above
    the best rule by the margin, the rules once; scorings of other samples or unfinished ones are refused."""
    from xl.babilong import study

    a, b, c = (scored(qa1_run, tmp_path / name, monkeypatch, *extra)
               for name, extra in (("a", ()), ("b", ("mem_len=8",)), ("c", ("mem_len=32",))))
    capsys.readouterr()
    study.main(["cache=" + ",".join(str(tmp_path / n) for n in "ac"), f"none={tmp_path / 'b'}",
                "--out", str(tmp_path / "study")])
    values = json.loads((tmp_path / "study" / "study.json").read_text())
    assert [(r["memory"], r["task"]) for r in values["rows"]] == [("cache", "qa1"), ("cache", "qa4"),
                                                                   ("none", "qa1"), ("none", "qa4")]
    for row, scorings in zip(values["rows"], ([a, c], [a, c], [b], [b]), strict=True):
        expected_seeds = [[100 * s["accuracy"][row["task"]][n] for n in ("0", "300")] for s in scorings]
        assert row["seeds"] == expected_seeds
        assert row["mean"] == pytest.approx([sum(x) / len(x) for x in zip(*expected_seeds, strict=True)])
        best = [max(100 * a["baselines"][row["task"]][r][n] for r in RULES) for n in ("0", "300")]
        assert row["above"] == [sum(s[i] > best[i] + study.MARGIN for s in expected_seeds) for i in range(2)]
    table = (tmp_path / "study" / "study.md").read_text()
    assert table.splitlines()[0] == "| memory | task | seeds | 0 | 300 |"
    assert f"| none | qa1 | 1 | {values['rows'][2]['mean'][0]:.0f} (" in table and "| rule: last named | qa1 |" in table
    assert table.strip() in capsys.readouterr().out
    assert png_size(tmp_path / "study" / "heatmap.png")[0] > png_size(tmp_path / "a" / "heatmap.png")[0]

    other = scored(qa1_run, tmp_path / "d", monkeypatch, "samples=3")
    assert other["samples"] == 3
    with pytest.raises(SystemExit, match=r"d read other samples than .*a \(samples differs\); score every run"):
        study.main([f"cache={tmp_path / 'a'}", f"none={tmp_path / 'd'}", "--out", str(tmp_path / "refused")])
    unfinished = json.loads((tmp_path / "a" / "results.json").read_text()) | {"complete": False}
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "results.json").write_text(json.dumps(unfinished))
    with pytest.raises(SystemExit, match=r"e is an incomplete scoring; finish it"):
        study.main([f"cache={tmp_path / 'e'}", "--out", str(tmp_path / "refused")])
    with pytest.raises(SystemExit, match=r"'cache': give each memory once as NAME=SCORING"):
        study.main(["cache", "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()  # nothing written for a refused study


def test_the_memory_s_evaluation_settings_are_the_scoring_s(tmp_path, monkeypatch):
    """+memory.knn_top_k (and the memory's other evaluation settings) read the samples with the trained weights and
    that setting: results.json names the memory the reader read with, and a rerun into the folder with another value
    is refused. A setting the weights were trained with is refused in one sentence."""
    from omegaconf import OmegaConf

    from xl.babilong.score import evaluated_model
    from xl.training.runs import TrainedRun

    monkeypatch.setenv("XL_CACHE_DIR", str(tmp_path / "cache"))
    knn = ["memory=knn", "memory.knn_size=64", "memory.knn_top_k=4", "memory.knn_recency=true"]
    run_hydra_main(train.main, ["train.py", *TRAIN, *knn, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch)
    out = tmp_path / "score"
    common = ["xl.babilong", f"ckpt={tmp_path / 'run'}", "tasks=[qa1]", "lengths=[300]", "samples=3", "logger=none"]
    run_hydra_main(score.main, [*common, "+memory.knn_top_k=2", f"hydra.run.dir={out}"], monkeypatch)
    values = json.loads((out / "results.json").read_text())
    assert "knn_top_k=2" in values["memory"] and values["identity"]["memory"] == {"knn_top_k": 2}
    run = TrainedRun.open(str(tmp_path / "run"))
    cfg = OmegaConf.create({"memory": {"knn_top_k": 2}})
    model = run.model(evaluated_model(cfg, run))
    assert model.memory.settings.knn_top_k == 2 and run.model().memory.settings.knn_top_k == 4
    with pytest.raises(SystemExit, match="holds another scoring"):
        run_hydra_main(score.main, [*common, "+memory.knn_top_k=3", f"hydra.run.dir={out}"], monkeypatch)
    with pytest.raises(SystemExit, match="memory.knn_recency cannot change at evaluation"):
        run_hydra_main(score.main, [*common, "+memory.knn_recency=false", f"hydra.run.dir={tmp_path / 'x'}"],
                       monkeypatch)
