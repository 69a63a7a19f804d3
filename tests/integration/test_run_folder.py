"""A run folder across stops and resumes: it names its newest checkpoint, keeps its whole history (CSV, W&B,
results.json, the epoch's loss), refuses settings a resume would record without using, and tests its checkpoint
with train=false without writing into it."""

from __future__ import annotations

import csv
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from tests.helpers import wandb_records
from tests.integration.test_evaluate import compose_eval
from xl import train
from xl.evaluation import evaluate
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError


def signal_at(step: int, signum: int = 15) -> list[str]:
    """A real signal to this process in the middle of step ``step`` (tests/integration/test_resume.py's SendSignal)."""
    return ["+callbacks.signal._target_=tests.integration.test_resume.SendSignal", f"+callbacks.signal.signum={signum}",
            f"+callbacks.signal.at_step={step}"]


def stopped(cfg) -> str:
    with pytest.raises(SystemExit) as info:
        train.fit_and_test(cfg)
    return str(info.value.code)


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_run_folder_names_its_newest_checkpoint_across_stops_and_resumes(tmp_path, corpus, caplog):
    """Stopped before its first validation and resumed, the run wrote its later checkpoints to last-v1.ckpt beside a
    stale last.ckpt, which evaluation, generation and resumes then took. Now: one last.ckpt, the newest, and the best
    step file, whatever the stops; an unreadable last.ckpt gives way to the newest complete checkpoint, in one line."""
    run, common = tmp_path / "run", (*tiny_overrides(tmp_path, corpus), "trainer.max_steps=30")
    folder = run / "checkpoints"
    stopped(compose_config(*common, *signal_at(5)))  # before the first validation, at step 10
    assert names(folder) == ["last.ckpt"]
    stopped(compose_config(*common, f"ckpt_path={run}", *signal_at(15)))
    assert names(folder) == ["last.ckpt", "step0000010.ckpt"]
    train.fit_and_test(compose_config(*common, f"ckpt_path={run}", "test=false"))
    callbacks = torch.load(folder / "last.ckpt", weights_only=True)["callbacks"]
    best = next(Path(v["best_model_path"]).name for k, v in callbacks.items() if k.startswith("ModelCheckpoint"))
    assert names(folder) == sorted({"last.ckpt", best}) and re.fullmatch(r"step00000[123]0.ckpt", best)
    assert Checkpoint.open(run).global_step == 30  # what evaluation, generation and a resume take
    data = [f"data.{s}={corpus[s]}" for s in ("train", "val", "test")]
    results = evaluate(compose_eval(f"ckpt={run}", "data=text", *data, f"data.cache_dir={tmp_path / 'cache'}",
                                    "logger=none", "splits=[test]", f"paths.output_dir={tmp_path / 'e'}"))
    assert results["test"]["test/loss"] > 0
    assert json.loads((tmp_path / "e" / "results.json").read_text())["step"] == 30

    good = (folder / "last.ckpt").read_bytes()
    (folder / "last.ckpt").write_bytes(good[: len(good) // 3])  # as another program might leave it
    with caplog.at_level(logging.WARNING, logger="xl.training.checkpoints.checkpoint"):
        fallback = Checkpoint.open(run)
    assert fallback.path.name == best
    (line,) = [r.getMessage() for r in caplog.records if r.name == "xl.training.checkpoints.checkpoint"]
    assert line == (f"{folder / 'last.ckpt'} cannot be read, so it is left out: the newest complete checkpoint, "
                    f"{best} (step {fallback.global_step}), is used")
    train.fit_and_test(compose_config(*common, f"ckpt_path={run}", "trainer.max_steps=34", "test=false"))
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 34


class EpochLosses:
    """Records the epoch-level training figures the module logs (its metrics' ``compute("train")``)."""

    def __init__(self, module) -> None:
        self.values: list[float] = []
        compute = module.metrics.compute

        def recorded(stage: str):
            out = compute(stage)
            if stage == "train" and out:
                self.values.append(float(out["train/loss"]))
            return out

        module.metrics.compute = recorded


def fit_recording(cfg) -> tuple[list[float], dict]:
    run = build_run(cfg)
    epochs = EpochLosses(run.module)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
    return epochs.values, json.loads(Path(cfg.callbacks.job_summary.path).read_text())


def csv_rows(run: Path) -> list[dict]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train_rows(run: Path) -> list[tuple[int, str]]:
    return sorted((int(row["step"]), row["train/loss"]) for row in csv_rows(run) if row.get("train/loss"))


def test_a_resumed_run_keeps_its_history(tmp_path, corpus):
    """Stopped mid-epoch at step 7 and resumed to step 12: metrics.csv was deleted by the resume and lacked the
    interrupted step; the epoch's train/loss averaged only the resumed steps; results.json counted only the resumed
    part. Each now matches the unbroken run's."""
    common = ("trainer.limit_train_batches=5", "trainer.max_steps=12", "trainer.val_check_interval=3",
              "callbacks.model_checkpoint.monitor=null", "trainer.deterministic=true", "model.dropout=0.1",
              "logger=csv", "test=false")
    whole_epochs, whole = fit_recording(compose_config(*tiny_overrides(tmp_path / "whole", corpus), *common))
    cfg = compose_config(*tiny_overrides(tmp_path / "parts", corpus), *common, *signal_at(7))
    run = tmp_path / "parts" / "run"
    with pytest.raises(SystemExit):
        train.fit_and_test(cfg)
    first = json.loads((run / "results.json").read_text()) if (run / "results.json").exists() else {}
    logged = {int(r["step"]) for r in csv_rows(run) if r.get("train/loss")}
    assert max(logged) == 6, "the interrupted step (the 7th, logged at step 6) is in metrics.csv"
    epochs, parts = fit_recording(compose_config(*tiny_overrides(tmp_path / "parts", corpus), *common,
                                                 f"ckpt_path={run}"))
    assert epochs == whole_epochs[1:], "the epoch the stop fell in averages all its steps"
    assert train_rows(run) == train_rows(tmp_path / "whole" / "run"), "every step once, with the unbroken losses"
    assert (parts["steps"], parts["train_tokens"]) == (whole["steps"], whole["train_tokens"]) == (12, 12 * 4 * 16)
    assert parts["wall_s"] > first.get("wall_s", 0)


@pytest.fixture
def stopped_wandb_run(tmp_path, corpus, monkeypatch):
    """A run with the W&B logger, stopped by Ctrl+C after step 3, then resumed to step 8 with validations every 2."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if o not in ("logger=none",)
                 and not o.startswith("paths.output_dir")]
    with pytest.raises(SystemExit):  # its sentence: tests/integration/test_stops.py
        run_hydra_main(train.main, ["train.py", *overrides, "logger=wandb", "trainer.max_steps=8",
                                    f"hydra.run.dir={run}", *signal_at(3, signum=2)], monkeypatch)
    run_hydra_main(train.main, ["train.py", f"ckpt_path={run}", "trainer.val_check_interval=2"], monkeypatch)
    return run


def test_a_resumed_wandb_run_uploads_as_one_history(stopped_wandb_run):
    """The resumed session's W&B rows restarted at _step 0, the printed upload command named only the newest
    session, and the Ctrl+C stop was recorded as a failed run: read from the sessions' own .wandb logs."""
    run = stopped_wandb_run
    run_id = (run / "wandb_id").read_text().strip()
    sessions = sorted((run / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(sessions) == 2
    log = (run / "train.log").read_text()
    assert f"W&B run {run_id}: 2 offline session(s) in {run / 'wandb'} (upload: wandb sync {sessions[0]} " \
           f"{sessions[1]})" in log
    first, second = (next(s.glob("run-*.wandb")) for s in sessions)
    steps = [[row["_step"] for row in wandb_records.history(f)] for f in (first, second)]
    assert steps[0] == [0, 1, 2] and steps[1][0] == 3 and steps[1] == sorted(steps[1]), steps
    global_steps = [row.get("trainer/global_step") for row in wandb_records.history(second)]
    assert global_steps == steps[1], "each row's x-axis value is its step"
    assert len(wandb_records.of_type(first, "preempting")) == 1, "the stop is recorded as a preemption"
    assert [e.exit_code for e in wandb_records.of_type(second, "exit")] == [0]
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 8 and "val/loss" in results, "the validation interval given to the resume applies"


def test_a_resume_refuses_what_it_would_not_use_and_train_false_tests_elsewhere(stopped_wandb_run, corpus,
                                                                              monkeypatch):
    """optim.lr=1e10 on a resume was recorded in the run's overrides while the checkpoint's schedule trained on at
    the old rate; train=false ckpt_path=RUN ended in an AttributeError and would have written into RUN."""
    run = stopped_wandb_run
    overrides = (run / ".hydra" / "overrides.yaml").read_text()
    with pytest.raises(SystemExit, match=rf"^error: ckpt_path={run} continues the run with the checkpoint's model, "
                                         r"optimizer, schedule and data order, so optim.lr=1e10 would be recorded but"
                                         r" not used; remove optim.lr from the command line"):
        run_hydra_main(train.main, ["train.py", f"ckpt_path={run}", "optim.lr=1e10", "trainer.max_steps=12"],
                       monkeypatch)
    ckpt = run / "checkpoints" / "last.ckpt"
    alone = run.parent / "alone.ckpt"  # a checkpoint outside its run folder: the command line is all its settings
    shutil.copy(ckpt, alone)
    cfg = compose_config(*tiny_overrides(run.parent / "alone", corpus), f"ckpt_path={alone}", "optim.lr=1e10",
                         "trainer.max_steps=12")
    with pytest.raises(CheckpointError, match=r"continues its optimizer and learning-rate schedule, trained with "
                                              r"optim.lr=0.001, so optim.lr=1e\+10 would not be used"):
        train.fit_and_test(cfg)
    run_hydra_main(train.main, ["train.py", f"ckpt_path={run}", "train=false"], monkeypatch)
    assert (run / ".hydra" / "overrides.yaml").read_text() == overrides, "nothing is written into RUN"
    (tested,) = [p.parent for p in (run.parent / "outputs").rglob("results.json")]
    results = json.loads((tested / "results.json").read_text())
    assert results["test/loss"] > 0 and "train=false" in OmegaConf.load(tested / ".hydra" / "overrides.yaml")
    with pytest.raises(SystemExit, match="^error: train=false and test=false leave nothing to do"):
        run_hydra_main(train.main, ["train.py", f"ckpt_path={run}", "train=false", "test=false"], monkeypatch)
