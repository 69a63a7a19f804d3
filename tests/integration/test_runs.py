"""A run folder is the unit: evaluation, generation and Python users take the run's data and tokenizer from it;
evaluation results land in results.json and in the run's W&B run; an evaluation sweep ends with a summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import xl.evaluate
import xl.evaluation
import xl.generate
import xl.generation
from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from tests.integration.test_evaluate import compose_eval
from xl import train
from xl.config.rules import ConfigError
from xl.data.tokenizers import fingerprint
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import Checkpoint
from xl.training.runs import TrainedRun, find_run_folder, run_data

PNG = b"\x89PNG\r\n\x1a\n"


def cli_overrides(tmp: Path, corpus, *extra: str) -> list[str]:
    """A tiny char-level run on the corpus files, trained as ``python train.py`` runs it, into ``tmp/run``."""
    overrides = [o for o in tiny_overrides(tmp, corpus) if not o.startswith("logger=")]
    return [*overrides, "logger=wandb", "data.tokenizer=char", f"hydra.run.dir={tmp / 'run'}", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus) -> Path:
    tmp = tmp_path_factory.mktemp("cli_run")
    monkeypatch = pytest.MonkeyPatch()
    try:
        run_hydra_main(train.main, ["train.py", *cli_overrides(tmp, corpus)], monkeypatch)
    finally:
        monkeypatch.undo()
    return tmp / "run"


def evaluate_cli(argv: list[str], monkeypatch) -> None:
    flags = [a for a in argv if a.startswith("-")]
    overrides = [a for a in argv if not a.startswith("-")]
    run_hydra_main(xl.evaluate.main, ["xl/evaluate.py", *flags, "+trainer.enable_progress_bar=false", *overrides],
                   monkeypatch)


def explicit_data(corpus, run: Path) -> list[str]:
    return ["data=text", *(f"data.{s}={corpus[s]}" for s in ("train", "val", "test")), "data.tokenizer=char",
            f"data.cache_dir={run.parent / 'cache'}", "data.batch_size=4", "data.tgt_len=16"]


def test_evaluate_a_run_folder_scores_its_own_data_and_logs_into_its_wandb_run(run, corpus, tmp_path, monkeypatch):
    """`python -m xl.evaluate ckpt=RUN` with nothing else: the run's files, tokenizer and segments, the same figures
    as naming them all; results.json and the run's own W&B run (resumed offline) hold them."""
    evaluate_cli([f"ckpt={run}", f"hydra.run.dir={tmp_path / 'ev'}"], monkeypatch)
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    named = xl.evaluation.evaluate(compose_eval(*[
        f"ckpt={run}", *explicit_data(corpus, run), "logger=none", f"paths.output_dir={tmp_path / 'named'}",
        "+trainer.enable_progress_bar=false"]))
    for split in ("val", "test"):
        assert results[f"{split}/loss"] == pytest.approx(named[split][f"{split}/loss"], abs=1e-6)
        assert results[f"{split}/tokens"] == named[split][f"{split}/tokens"]
        assert str(corpus[split]) in results["corpus"][split]
    assert results["run_data"] is True and results["run"] == str(run.resolve()) and results["unit"] == "bpc"
    assert (results["eval_mem_len"], results["tgt_len"], results["batch_size"]) == (16, 16, 4)
    log = (tmp_path / "ev" / "evaluate.log").read_text()
    assert f"scored: data.val ({corpus['val']}); data.test ({corpus['test']}) (the run's data)" in log
    run_id = (run / "wandb_id").read_text().strip()
    offline = list((tmp_path / "ev" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and offline[0].name.endswith(f"-{run_id}") and list(offline[0].glob("*.wandb"))
    assert [p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")] == [run_id]


def test_evaluate_on_other_data_says_so(run, corpus, tmp_path, monkeypatch):
    data = explicit_data(corpus, run)
    swapped = [d.replace(str(corpus["val"]), str(corpus["test"])) if d.startswith("data.val=") else d for d in data]
    evaluate_cli([f"ckpt={run}", *swapped, "logger=none", "splits=[val]", f"hydra.run.dir={tmp_path / 'ev'}"],
                 monkeypatch)
    log = (tmp_path / "ev" / "evaluate.log").read_text()
    assert f"scored: data.val ({corpus['test']}) (other data than the run's, which trained on data.train (" in log
    assert json.loads((tmp_path / "ev" / "results.json").read_text())["run_data"] is False


def test_evaluate_on_other_data_keeps_the_runs_segments_unless_they_are_set(run, corpus, tmp_path, monkeypatch):
    """data=text names other files; the segment length and batch stay the run's (16 and 4, not the schema's 128 and
    8) unless the command line sets them, and the output says where they come from."""
    named = [d for d in explicit_data(corpus, run) if not d.startswith(("data.batch_size=", "data.tgt_len="))]
    other = [d.replace(str(corpus["val"]), str(corpus["test"])) if d.startswith("data.val=") else d for d in named]
    for extra, segments, words in [([], (16, 4), "the run's"), (["data.tgt_len=8"], (8, 4), "data.tgt_len as set, "
                                                                                         "data.batch_size the run's")]:
        out = tmp_path / f"ev{len(extra)}"
        evaluate_cli([f"ckpt={run}", *other, *extra, "logger=none", "splits=[val]", "trainer.limit_val_batches=2",
                      f"hydra.run.dir={out}"], monkeypatch)
        saved = json.loads((out / "results.json").read_text())
        assert (saved["tgt_len"], saved["batch_size"]) == segments
        assert f"tgt_len={segments[0]} clamp_len=-1 batch={segments[1]} ({words})" in (out / "evaluate.log").read_text()


def test_generate_reads_the_run_tokenizer_and_python_users_get_it(run, tmp_path, monkeypatch, capsys):
    """A char model generates with `ckpt=RUN` alone (before, the default data's byte tokenizer was refused), and
    TrainedRun gives the same tokenizer and model, so ids generated in Python decode to the same text."""
    capsys.readouterr()
    run_hydra_main(xl.generate.main, ["xl.generate", f"ckpt={run}", "prompt=\"def main(\"", "max_new_tokens=30",
                                      "temperature=0", f"hydra.run.dir={tmp_path / 'gen'}"], monkeypatch)
    printed = capsys.readouterr().out
    trained = TrainedRun.open(run)
    tokenizer = trained.tokenizer
    assert tokenizer.unit == "char" and trained.checkpoint.state["xl"]["tokenizer"] == fingerprint(tokenizer)
    prompt = torch.tensor([list(tokenizer.encode("def main("))])
    new = xl.generation.generate(trained.model(), prompt, 30, temperature=0)
    assert printed == "def main(" + tokenizer.decode(new[0].numpy()) + "\n"


def test_checkpoints_record_their_data_and_older_ones_still_load(run, corpus, tmp_path, monkeypatch):
    """A checkpoint without the data record (written before it was kept) evaluates on named data, saying that it
    cannot tell; inside its run folder it still gives its tokenizer."""
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["xl"]["data"]["corpus"] == f"data.train ({corpus['train']})"
    assert "|doc_sep" not in state["xl"]["data"]["source"] and state["xl"]["data"]["tokenizer"] == "char"
    del state["xl"]["data"]
    old = run / "checkpoints" / "old.ckpt"
    torch.save(state, old)
    evaluate_cli([f"ckpt={old}", *explicit_data(corpus, run), "logger=none", "splits=[test]",
                  f"hydra.run.dir={tmp_path / 'ev'}"], monkeypatch)
    assert "(as named; the checkpoint does not record the data it was trained on)" in (
        tmp_path / "ev" / "evaluate.log").read_text()
    assert Checkpoint.open(old).data_identity is None and TrainedRun.open(old).tokenizer.unit == "char"
    old.unlink()


def test_a_checkpoint_outside_its_run_folder_needs_its_data_named(run, tmp_path):
    loose = tmp_path / "loose.ckpt"
    loose.write_bytes((run / "checkpoints" / "last.ckpt").read_bytes())
    cfg = compose_eval(f"ckpt={loose}", f"paths.output_dir={tmp_path / 'ev'}", "logger=none")
    with pytest.raises(ConfigError, match=r"^ckpt=.*loose.ckpt is not inside its run folder .* name the data"):
        xl.evaluation.evaluate(cfg)


def test_run_data_paths_are_relative_to_where_the_run_was_started(tmp_path, corpus, monkeypatch):
    """data.train=train.txt was relative to the training command's folder: evaluation from elsewhere finds it."""
    work = tmp_path / "work"
    work.mkdir()
    for split in ("train", "val", "test"):
        (work / f"{split}.txt").write_bytes(corpus[split].read_bytes())
    monkeypatch.chdir(work)
    named = ("data.train", "data.val", "data.test")
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith(named)]
    run_hydra_main(train.main, ["train.py", *overrides, "data.train=train.txt", "data.val=val.txt",
                                "data.test=test.txt", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
                   monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert find_run_folder(tmp_path / "run" / "checkpoints" / "last.ckpt") == tmp_path / "run"
    assert run_data(tmp_path / "run")["val"] == str(work / "val.txt")


def test_evaluation_sweep_over_memory_lengths_ends_with_the_summary(run, tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    evaluate_cli(["-m", f"ckpt={run}", "memory.eval_mem_len=0,8,32", "splits=[test]", "logger=none",
                  f"hydra.sweep.dir={sweep}"], monkeypatch)
    rows = (sweep / "summary.md").read_text().splitlines()
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[:3] == ["job", "mem_len", "eval_mem_len"] and "test/bpc" in header and "test/tok_s" in header
    assert [r.split("|")[3].strip() for r in rows[2:]] == ["0", "8", "32"]
    assert (sweep / "summary.png").read_bytes().startswith(PNG)


def test_bad_input_reaches_the_run_log(tmp_path, corpus, monkeypatch):
    """The one sentence printed on the console is in the run's train.log too."""
    with pytest.raises(SystemExit, match=r"^error: memory.mem_len must be"):
        run_hydra_main(train.main, ["train.py", *tiny_overrides(tmp_path, corpus), "memory.mem_len=-3",
                                    f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch)
    assert "error: memory.mem_len must be" in (tmp_path / "run" / "train.log").read_text()


def test_generate_refuses_a_warmup_file_that_does_not_exist(run, tmp_path, monkeypatch):
    argv = ["xl.generate", f"ckpt={run}", "prompt=\"x\"", f"hydra.run.dir={tmp_path / 'gen'}"]
    with pytest.raises(SystemExit, match=r"^error: warmup=.*promt.txt is not a file; give the path of a text file"):
        run_hydra_main(xl.generate.main, [*argv, f"warmup={tmp_path / 'promt.txt'}"], monkeypatch)
    (tmp_path / "prompt.txt").write_text("import os\n")
    run_hydra_main(xl.generate.main, [*argv, f"warmup={tmp_path / 'prompt.txt'}", "max_new_tokens=2"], monkeypatch)


def test_build_run_without_hydra_records_data_too(tmp_path, corpus):
    """Checkpoints of Python users' runs (no run folder) carry the data record as well."""
    built = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=1", "test=false"))
    built.trainer.fit(built.module, datamodule=built.datamodule)
    saved = Checkpoint.open(tmp_path / "run").data_identity
    assert saved == built.datamodule.identity
