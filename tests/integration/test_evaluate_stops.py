"""python -m xl.evaluate stopped by a signal: one sentence, the exit status 128 + the signal's number, and the splits it
finished kept in results.json, marked incomplete; a sweep (-m) stops at the job under way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import xl.evaluate
import xl.evaluation
from tests.conftest import run_hydra_main
from tests.helpers.paths import ROOT
from tests.integration.test_evaluate import compose_eval, eval_overrides, trained  # noqa: F401 (a fixture)
from xl.evaluation import evaluate
from xl.training.eval_results import Progress, stopped_sentence
from xl.training.services.signals import exit_status

BATCHES = ("trainer.limit_val_batches=3", "trainer.limit_test_batches=3")


def signal_at(monkeypatch, stage: str, signum: int, nth: int = 1) -> None:
    """Send ``signum`` to this process in the second batch of the ``nth`` scoring of ``stage`` (val or test)."""
    score, seen = xl.evaluation.Evaluator.score, []

    def scoring(self, batch, batch_idx, split):
        if split == stage and batch_idx == 1:
            seen.append(split)
            if len(seen) == nth:
                os.kill(os.getpid(), signum)
        return score(self, batch, batch_idx, split)

    monkeypatch.setattr(xl.evaluation.Evaluator, "score", scoring)


@pytest.mark.parametrize(("signum", "stage"), [(signal.SIGTERM, "test"), (signal.SIGINT, "test"),
                                               (signal.SIGTERM, "val")])
def test_a_signal_stops_the_evaluation_in_one_sentence_and_keeps_the_finished_split(trained, corpus, tmp_path,  # noqa: F811
                                                                                   monkeypatch, capsys, signum, stage):
    """SIGTERM exited 0 in silence and wrote nothing (Lightning's SIGTERMException is a SystemExit without a code);
    Ctrl+C exited 1. Now: 143 or 130, one sentence, and val's figures (those of an evaluation of val alone) kept."""
    out = tmp_path / "ev"
    overrides = [o for o in eval_overrides(trained, corpus, *BATCHES, f"hydra.run.dir={out}")
                 if not o.startswith("paths.output_dir")]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal_at(monkeypatch, stage, signum)
    with pytest.raises(SystemExit) as stop:
        run_hydra_main(xl.evaluate.main, ["xl/evaluate.py", *overrides], monkeypatch)
    assert stop.value.code == exit_status(signum) == 128 + signum
    name = signal.Signals(signum).name
    results = out / "results.json"
    if stage == "test":
        sentence = (f"error: stopped by {name} while scoring test; val is kept in {results}, marked incomplete: run "
                    "the command again to score every split")
    else:
        sentence = (f"error: stopped by {name} while scoring val, before any split was finished; nothing was "
                    "written: run the command again")
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == sentence
    assert (out / "evaluate.log").read_text().rstrip().endswith(sentence)
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "the handlers of before are back"
    if stage == "val":
        assert not results.exists() and not any(p.suffix == ".tmp" for p in out.iterdir())
        return
    kept = json.loads(results.read_text())
    assert kept["complete"] is False and not any(k.startswith("test/") for k in kept)
    monkeypatch.undo()
    alone = evaluate(compose_eval(*eval_overrides(trained, corpus, *BATCHES, "splits=[val]",
                                                  f"paths.output_dir={tmp_path / 'val'}")))["val"]
    assert {k: v for k, v in kept.items() if k.startswith("val/") and k != "val/tok_s"} == pytest.approx(
        {k: v for k, v in alone.items() if k != "val/tok_s"})
    assert json.loads((tmp_path / "val" / "results.json").read_text())["complete"] is True


def test_a_signal_stops_a_sweep_at_the_job_under_way(trained, corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    """-m: the first job's results are complete, the second's keep its val, marked incomplete, and the sweep
    writes no summary of jobs it did not run."""
    sweep = tmp_path / "sweep"
    overrides = [o for o in eval_overrides(trained, corpus, *BATCHES) if not o.startswith("paths.output_dir")]
    signal_at(monkeypatch, "test", signal.SIGTERM, nth=2)
    with pytest.raises(SystemExit) as stop:
        run_hydra_main(xl.evaluate.main, ["xl/evaluate.py", "-m", *overrides, "memory.eval_mem_len=16,32",
                                          f"hydra.sweep.dir={sweep}"], monkeypatch)
    assert stop.value.code == 143
    first, second = (json.loads((sweep / str(job) / "results.json").read_text()) for job in (0, 1))
    assert first["complete"] is True and "test/loss" in first
    assert second["complete"] is False and "val/loss" in second and "test/loss" not in second
    assert not (sweep / "summary.md").exists()
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        f"error: stopped by SIGTERM while scoring test; val is kept in {sweep / '1' / 'results.json'}, marked "
        "incomplete: run the command again to score every split (the sweep stops at its job 1)")


WAITING_EVALUATION = """
import sys
import xl.evaluate
import xl.evaluation

score = xl.evaluation.Evaluator.score

def scoring(self, batch, batch_idx, split):
    if split == "test" and batch_idx == 1:
        print("scoring test", flush=True)
        sys.stdin.read()  # the signal comes here, from the test
    return score(self, batch, batch_idx, split)

xl.evaluation.Evaluator.score = scoring
sys.argv = ["xl/evaluate.py", *sys.argv[1:]]
xl.evaluate.main()
"""


@pytest.mark.slow
def test_sigterm_from_outside_ends_the_command_with_143(trained, corpus, tmp_path):  # noqa: F811
    """The command as a scheduler stops it: SIGTERM from another process while the test split is scored."""
    out = tmp_path / "ev"
    overrides = [o for o in eval_overrides(trained, corpus, *BATCHES, f"hydra.run.dir={out}")
                 if not o.startswith("paths.output_dir")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", WAITING_EVALUATION, *overrides], cwd=tmp_path, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    while line != "scoring test\n":
        line = child.stdout.readline()
        assert line, f"the evaluation ended before the test split (rc {child.wait()}): {child.stderr.read()[-2000:]}"
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 143, err[-2000:]
    assert err.rstrip().splitlines()[-1] == (f"error: stopped by SIGTERM while scoring test; val is kept in "
                                             f"{out / 'results.json'}, marked incomplete: run the command again to "
                                             "score every split")
    assert json.loads((out / "results.json").read_text())["complete"] is False


def test_the_sentence_says_where_the_evaluation_stopped_and_what_it_kept(tmp_path):
    path = tmp_path / "results.json"
    assert stopped_sentence("SIGTERM", Progress()) == ("stopped by SIGTERM before scoring began; nothing was written: "
                                                       "run the command again")
    assert stopped_sentence("SIGINT", Progress(finished=["val"], written=path)) == (
        f"stopped by SIGINT after scoring val; val is kept in {path}, marked incomplete: run the command again to "
        "score every split")
    assert stopped_sentence("SIGUSR1", Progress(finished=["val", "test"], written=path, complete=True)) == (
        f"stopped by SIGUSR1 after every split was scored; the results are complete in {path}")
