"""Checkpoints survive a cluster's filesystems: a run folder on another filesystem than ``$TMPDIR``, a small
``$TMPDIR``, a kill or a full disk while ``last.ckpt`` is rewritten (real tmpfs mounts, in a private mount namespace).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import compose_config, tiny_overrides
from tests.helpers.paths import ROOT


def unshare_missing() -> str | None:
    """Why a private mount namespace with a tmpfs cannot be made here, or None."""
    if shutil.which("unshare") is None:
        return "the unshare command is not installed"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -rm cannot mount a tmpfs here: {probe.stderr.strip()}"


def run_scenarios(corpus: dict[str, Path], work: Path, *scenarios: str) -> dict:
    """tests/helpers/filesystems.py inside a private mount namespace: its report, and its standard error."""
    missing = unshare_missing()
    if missing:
        pytest.skip(missing)
    out = work / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        ["unshare", "-rm", sys.executable, "-m", "tests.helpers.filesystems", str(out), str(corpus["train"].parent),
         str(work), *scenarios], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {**json.loads(out.read_text()), "stderr": result.stderr}


@pytest.fixture(scope="module")
def report(corpus, tmp_path_factory) -> dict:
    """One run of the scenarios every test below reads."""
    return run_scenarios(corpus, tmp_path_factory.mktemp("filesystems"))


def test_a_small_tmpdir_does_not_matter(report):
    """Lightning's own writer stages every checkpoint in $TMPDIR: on a 64 KiB tmpfs every save failed."""
    small = report["small_tmpdir"]
    assert small["error"] is None
    assert small["step"] == 6 and list(small["checkpoints"]) == ["last.ckpt"]
    assert small["tmpdir"] == {}, "nothing is staged in $TMPDIR"


def test_a_kill_during_the_rewrite_of_last_ckpt_leaves_a_checkpoint_to_resume(report):
    """The run folder on one filesystem, $TMPDIR on another: SIGKILL the moment the folder changes while last.ckpt
    is rewritten. A move across filesystems copied into last.ckpt in place and left it truncated; now the previous
    last.ckpt stays whole until the new one replaces it, and the resume continues from the folder."""
    kill = report["kill"]
    assert kill["seen"] is not None, "the kill did not happen during the rewrite"
    assert kill["step"] in range(2, 12, 2), kill  # the checkpoint a resume picks is complete
    assert kill["tmpdir"] == {}, "no temporary is left in $TMPDIR"
    assert kill["resume_error"] is None
    assert kill["resumed"] == {"path": "last.ckpt", "step": 14}
    assert list(kill["after_resume"]) == ["last.ckpt"], "the temporary the kill left beside it is cleaned"


def test_a_full_disk_during_the_rewrite_keeps_the_previous_checkpoint_and_says_so(report):
    """The run folder's disk fills while last.ckpt is rewritten: the copy in place left it unloadable while the run
    said the last complete checkpoint was intact; now the partial file goes and the sentence names what is kept."""
    full = report["full"]
    assert full["path"] == "last.ckpt" and full["step"] == 2
    assert list(full["checkpoints"]) == ["last.ckpt"], "the partial file is removed"
    assert re.fullmatch(r"error: disk full while training \(No space left on device\); the last complete checkpoint, "
                        r"(\S+)/checkpoints/last.ckpt \(step 2\), is intact; free space and resume with: "
                        r"python train.py ckpt_path=\1", full["message"]), full["message"]


def test_a_full_disk_before_the_first_checkpoint_says_there_is_none(report):
    first = report["full_first"]
    assert first["checkpoints"] == {} and "is a folder without checkpoints" in first["error"]
    assert first["message"] == ("error: disk full while training (No space left on device) before the first "
                                "complete checkpoint was written; free space and run the command again")


def test_a_read_only_checkpoint_folder_ends_the_run_in_one_sentence(report):
    """checkpoints/ turns read-only mid-run (a real remount): the write ended in a raw OSError traceback; now the run
    ends with a sentence naming the folder, the cause and what is kept, and no partial file is left."""
    readonly = report["readonly"]
    assert readonly["path"] == "last.ckpt" and readonly["step"] == 2
    assert list(readonly["checkpoints"]) == ["last.ckpt"]
    assert re.fullmatch(r"error: cannot write checkpoints to (\S+)/checkpoints \(Read-only file system\); "
                        r"\1/checkpoints/last.ckpt \(step 2\) is intact; make the folder writable, then resume: "
                        r"python train.py ckpt_path=\1", readonly["message"]), \
        readonly["message"]


def test_a_checkpoint_write_refused_by_permissions_is_said_in_train_log(tmp_path, corpus, monkeypatch):
    """EACCES at the checkpoint writer (tests run as root, where chmod stops no write: the error is injected at
    the writer's save): one sentence on the console and in train.log, the previous checkpoint intact."""
    import errno

    from tests.conftest import run_hydra_main
    from xl import train
    from xl.training.checkpoints import checkpoint_io

    saves, save = [], checkpoint_io.save_atomically

    def refused(state, path):
        saves.append(path)
        if len(saves) > 1:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        save(state, path)

    monkeypatch.setattr(checkpoint_io, "save_atomically", refused)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith("paths.output_dir")]
    with pytest.raises(SystemExit) as stop:
        run_hydra_main(train.main, ["train.py", *overrides, f"hydra.run.dir={run}", "trainer.max_steps=6",
                                    "callbacks.model_checkpoint.monitor=null",
                                    "callbacks.model_checkpoint.every_n_train_steps=2",
                                    "callbacks.model_checkpoint.save_top_k=0"], monkeypatch)
    sentence = (f"error: cannot write checkpoints to {run}/checkpoints (Permission denied); "
                f"{run}/checkpoints/last.ckpt (step 2) is intact; make the folder writable, then resume: "
                f"python train.py ckpt_path={run}")
    assert stop.value.code == sentence
    assert (run / "train.log").read_text().rstrip().endswith(sentence)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["last.ckpt"]


@pytest.mark.slow
def test_a_full_disk_with_the_wandb_logger_ends_in_the_sentence_alone(corpus, tmp_path):
    """W&B's own log file is on the full disk too: its writes failed with a '--- Logging error ---' traceback after
    the sentence, which claimed a complete checkpoint that did not exist."""
    report = run_scenarios(corpus, tmp_path, "full_wandb")
    run = report["full_wandb"]
    sentence = ("error: disk full while training (No space left on device) before the first complete checkpoint was "
                "written; free space and run the command again")
    assert run["message"] == sentence and run["checkpoints"] == {}
    assert run["log"].rstrip().endswith(sentence), "the sentence is in train.log"
    assert "Logging error" not in report["stderr"]


def test_every_trainer_the_project_builds_writes_through_the_atomic_plugin(tmp_path, corpus):
    from tests.integration.test_evaluate import compose_eval
    from xl.training.build import build_run, make_trainer
    from xl.training.checkpoints.checkpoint_io import AtomicCheckpointIO

    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus)))  # train.py and the probe
    assert isinstance(run.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    cfg = compose_eval("ckpt=unused", "data=text", "trainer.precision=32-true", f"paths.output_dir={tmp_path / 'e'}")
    evaluation = make_trainer(cfg, logger=False, callbacks=[])  # xl.evaluate's
    assert isinstance(evaluation.strategy.checkpoint_io, AtomicCheckpointIO)


def test_a_resume_reads_each_checkpoint_file_once(tmp_path, corpus, monkeypatch):
    """The resume's checks and Lightning's restore opened the same checkpoint four times; now the state read once
    serves them all (xl.training.checkpoints.resume.Resume, handed to Lightning by the plugin)."""
    import torch

    from xl import train

    common = (*tiny_overrides(tmp_path, corpus), "callbacks.model_checkpoint.monitor=null",
              "callbacks.model_checkpoint.every_n_train_steps=2", "test=false")
    train.fit_and_test(compose_config(*common, "trainer.max_steps=4"))
    loaded, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: loaded.append(str(f)) or load(f, *a, **k))
    train.fit_and_test(compose_config(*common, f"ckpt_path={tmp_path / 'run'}", "trainer.max_steps=6"))
    assert loaded and len(loaded) == len(set(loaded)), loaded
    assert all(f.startswith(str(tmp_path)) for f in loaded), "Lightning reads no file of its own (an fsspec opener)"
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
