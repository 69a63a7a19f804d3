"""A run folder holds one run: its CSV history survives every kind of resume and a kill between two checkpoints, a
new run into it is refused (unless overwrite=true, which starts clean), and a second process is refused while a
first one holds the folder."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import wandb

from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from tests.helpers import wandb_records
from tests.integration.test_stops import stop_cfg
from xl import train
from xl.training.checkpoints import run_lock


def csv_rows(run: Path) -> list[dict]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train_rows(run: Path) -> list[tuple[int, str]]:
    """The training rows (each step's, and each epoch's at its last step): (step, train/loss)."""
    return sorted((int(r["step"]), r["train/loss"]) for r in csv_rows(run) if r.get("train/loss"))


# ---- 1. a test-only resume keeps the history -------------------------------------------------------------------
def test_a_resume_that_only_tests_keeps_the_csv_history(tmp_path, corpus):
    """A stop during the final test, then `train.py ckpt_path=RUN` (which only tests): Lightning's CSV writer wrote
    metrics.csv afresh, and every training row was lost."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match="during the test"):
        train.fit_and_test(stop_cfg(tmp_path, corpus, "logger=csv", stage="test"))
    trained = [r for r in csv_rows(run) if not any(k.startswith("test/") and v for k, v in r.items())]
    assert {int(r["step"]) for r in trained if r.get("train/loss")} == set(range(20))
    metrics = train.fit_and_test(stop_cfg(tmp_path, corpus, "logger=csv", f"ckpt_path={run}"))
    rows = csv_rows(run)
    assert rows[:len(trained)] == [{k: r.get(k, "") for k in rows[0]} for r in trained], "the training's rows stay"
    tests = [r for r in rows if r.get("test/loss")]
    assert len(tests) == 1 and float(tests[0]["test/loss"]) == pytest.approx(metrics["test/loss"])
    assert not [r for r in rows[:len(trained)] if r.get("test/batches")], "no row of the stopped test is kept"


# ---- 4. a kill between two checkpoints of one step -------------------------------------------------------------
class KillBetweenCheckpoints(L.Callback):
    """At step ``at``, when the second checkpoint of the step (last.ckpt, after step{at}.ckpt) is about to be written,
    copy the run folder as a SIGKILL at that instant would leave it, and end the fit."""

    def __init__(self, folder: str, at: int) -> None:
        self.folder, self.at, self.saves = Path(folder), at, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step != self.at:
            return
        self.saves += 1
        if self.saves == 2:
            shutil.copytree(self.folder, self.folder.with_name("killed"))
            raise KeyError("killed")


def killed_at_step_7(tmp_path: Path, corpus, common: tuple[str, ...], kill: type) -> Path:
    """The run folder ``parts/run`` as a kill between ``step0000007.ckpt`` and ``last.ckpt`` leaves it (``kill``: the
    callback that copies the folder then and stops the run)."""
    run = tmp_path / "parts" / "run"
    callback = [f"+callbacks.kill._target_={__name__}.{kill.__name__}", f"+callbacks.kill.folder={run}",
                "+callbacks.kill.at=7"]
    with pytest.raises(KeyError):
        train.fit_and_test(compose_config(*tiny_overrides(tmp_path / "parts", corpus), *common, *callback))
    shutil.rmtree(run)
    (run.parent / "killed").rename(run)  # the folder as the kill left it
    return run


def test_a_kill_between_the_step_checkpoint_and_last_ckpt_loses_no_metric_row(tmp_path, corpus):
    common = ("logger=csv", "test=false", "trainer.limit_train_batches=5", "trainer.max_steps=12",
              "trainer.val_check_interval=3", "callbacks.model_checkpoint.monitor=null", "trainer.deterministic=true",
              "callbacks.model_checkpoint.every_n_train_steps=7")
    train.fit_and_test(compose_config(*tiny_overrides(tmp_path / "whole", corpus), *common))
    whole = train_rows(tmp_path / "whole" / "run")
    assert {s for s, _ in whole} == set(range(12))
    run = killed_at_step_7(tmp_path, corpus, common, KillBetweenCheckpoints)
    assert torch.load(run / "checkpoints" / "step0000007.ckpt", weights_only=True)["global_step"] == 7
    assert not (run / "checkpoints" / "last.ckpt").exists()
    train.fit_and_test(compose_config(*tiny_overrides(tmp_path / "parts", corpus), *common, f"ckpt_path={run}"))
    assert train_rows(run) == whole, "every step once, with the unbroken run's losses"


# ---- 2. a new run into a used folder ---------------------------------------------------------------------------
def command(tmp_path: Path, corpus, run: Path, *extra: str) -> list[str]:
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith("paths.output_dir")]
    return ["train.py", *overrides, "logger=csv", "test=false", f"hydra.run.dir={run}", *extra]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_run_into_a_folder_of_another_run_is_refused_unless_overwrite(tmp_path, corpus, monkeypatch):
    """A second run into a used folder was accepted: its metrics.csv replaced the first run's, and evaluation and
    resumes of the folder then read the older run's newest checkpoint without a word."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run_hydra_main(train.main, command(tmp_path, corpus, run, "trainer.max_steps=12"), monkeypatch)
    before = snapshot(run)
    with pytest.raises(SystemExit) as info:
        run_hydra_main(train.main, command(tmp_path, corpus, run, "trainer.max_steps=4", "seed=7"), monkeypatch)
    assert str(info.value.code) == (
        f"error: {run} holds another run's checkpoints; resume it with: python train.py ckpt_path={run}, or give "
        "another hydra.run.dir (overwrite=true replaces that run)")
    assert snapshot(run) == before, "nothing is written into the folder"

    run_hydra_main(train.main, command(tmp_path, corpus, run, "trainer.max_steps=4", "seed=7", "overwrite=true"),
                   monkeypatch)
    steps = {p.name: torch.load(p, weights_only=True)["global_step"] for p in (run / "checkpoints").glob("*.ckpt")}
    assert set(steps.values()) == {4}, steps
    assert max(int(r["step"]) for r in csv_rows(run)) < 4, "no row of the replaced run"
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    assert (run / "train.log").read_text().count("results") == 1


def test_a_resume_or_a_requeue_into_its_own_folder_is_no_new_run(tmp_path, corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run_hydra_main(train.main, command(tmp_path, corpus, run, "trainer.max_steps=4"), monkeypatch)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the same command, requeued: it continues the run
    run_hydra_main(train.main, command(tmp_path, corpus, run, "trainer.max_steps=6", "overwrite=true"), monkeypatch)
    assert (run / "train.log").read_text().count("results") == 2, "overwrite=true acts on a job's start only"
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    run_hydra_main(train.main, ["train.py", f"ckpt_path={run}", "trainer.max_steps=8"], monkeypatch)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
    with pytest.raises(SystemExit, match=r"^error: .*overwrite=true would (remove|be recorded)"):
        run_hydra_main(train.main, command(tmp_path, corpus, run, f"ckpt_path={run}", "overwrite=true"), monkeypatch)


# ---- 3. one process per run folder -----------------------------------------------------------------------------
HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_process_on_a_run_folder_is_refused_until_the_first_is_gone(tmp_path, corpus, monkeypatch):
    """Two train.py into one folder (or a requeued job beside the live one) ended in tracebacks or interleaved files.
    Another process holds the folder's lock here: the run is refused before it writes; once that process is killed
    (the kernel releases its lock) the same command runs."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run / run_lock.LOCK)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as info:
            run_hydra_main(train.main, command(tmp_path, corpus, run, "trainer.max_steps=2"), monkeypatch)
        assert str(info.value.code) == (
            f"error: another process is running in the run folder {run} (it holds {run / run_lock.LOCK}); wait for it "
            "to end, or give another hydra.run.dir")
        assert sorted(p.name for p in run.iterdir()) == [run_lock.LOCK], "nothing is written"
    finally:
        holder.kill()
        holder.wait()
    run_hydra_main(train.main, command(tmp_path, corpus, run, "trainer.max_steps=2"), monkeypatch)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_the_lock_is_held_by_the_run_and_given_back_when_it_stops(tmp_path):
    """In one process: a second claim of a held folder is refused (flock locks belong to the open file, so this does
    not depend on which process asks), and a claim ended by an exception gives the folder back."""
    with run_lock.hold(tmp_path):
        with pytest.raises(run_lock.RunFolderBusy), run_lock.hold(tmp_path):
            pass
    with pytest.raises(SystemExit), run_lock.hold(tmp_path):
        raise SystemExit(1)
    with run_lock.hold(tmp_path):
        pass


class KillBetweenCheckpointsOfWandb(KillBetweenCheckpoints):
    """As :class:`KillBetweenCheckpoints`, with the W&B session's file holding every row W&B was given before the
    kill (W&B's writer is a process of its own, which a kill of the training process leaves to finish its file)."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step == self.at and self.saves == 1:
            trainer.logger.experiment.finish()
            wandb_records.written()
        super().on_save_checkpoint(trainer, pl_module, checkpoint)


def wandb_rows(run: Path) -> list[dict]:
    """The history rows of every offline W&B session of the run folder, session after session."""
    sessions = sorted((run / "wandb").glob("offline-run-*"))
    return [row for s in sessions for row in wandb_records.history(next(s.glob("run-*.wandb")))]


def test_a_kill_between_the_step_checkpoint_and_last_ckpt_loses_no_wandb_row(tmp_path, corpus, monkeypatch):
    """The resume starts at step 7 and the row of step 6 was never given to W&B: the sessions' history lacked it."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    common = ("logger=wandb", "test=false", "trainer.limit_train_batches=5", "trainer.max_steps=12",
              "trainer.val_check_interval=3", "callbacks.model_checkpoint.monitor=null", "trainer.deterministic=true",
              "callbacks.model_checkpoint.every_n_train_steps=7")
    run = killed_at_step_7(tmp_path, corpus, common, KillBetweenCheckpointsOfWandb)
    killed = wandb_rows(run)
    assert [row["_step"] for row in killed] == list(range(7)), "W&B has every row it was given before the kill"
    assert "lr-AdamW/pg1" in killed[6] and "train/loss" not in killed[6], "step 6: the callbacks' values, no loss"
    # the unbroken run between the two sessions: W&B names a session's folder by the second it starts in
    train.fit_and_test(compose_config(*tiny_overrides(tmp_path / "whole", corpus), *common))
    wandb.finish()  # train.py's main ends the session; fit_and_test leaves it open
    whole = {row["_step"]: row for row in wandb_rows(tmp_path / "whole" / "run")}
    assert sorted(whole) == list(range(12))
    train.fit_and_test(compose_config(*tiny_overrides(tmp_path / "parts", corpus), *common, f"ckpt_path={run}"))
    wandb.finish()
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2
    rows = wandb_rows(run)
    assert rows[:7] == killed and [row["_step"] for row in rows[7:]] == list(range(6, 12))
    assert all(row["trainer/global_step"] == row["_step"] for row in rows), "W&B's x-axis value in every record"
    values = [(row["_step"], key) for row in rows for key in row if not key.startswith(("_", "trainer/"))]
    assert len(values) == len(set(values)), "each value of each step once"
    merged = {step: {k: v for row in rows if row["_step"] == step for k, v in row.items() if not k.startswith("_")}
              for step in range(12)}
    assert {s: set(r) for s, r in merged.items()} == {s: set(r) - {"_step", "_runtime", "_timestamp"}
                                                      for s, r in whole.items()}, "the unbroken run's values"
    figures = ["epoch", "train/loss", "train/bpb", "val/loss", "val/bpb", "lr-AdamW/pg1"]  # not the throughput's
    assert {s: [r[k] for k in figures if k in r] for s, r in merged.items()} == \
           {s: [r[k] for k in figures if k in r] for s, r in whole.items()}
