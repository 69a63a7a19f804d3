"""Checkpoints on filesystems of a cluster's shape, run inside a private mount namespace (``unshare -rm``).

``python -m tests.helpers.filesystems REPORT CORPUS WORK [SCENARIO ...]`` mounts small tmpfs filesystems over
folders under WORK (visible to this process and its children only), trains tiny runs on them and writes what it
found to REPORT (JSON, on the real disk); without SCENARIOs it runs all but ``full_wandb``. Each scenario is a real
Trainer run through the project's checkpoint writer:

- ``small_tmpdir``: ``$TMPDIR`` on a 64 KiB tmpfs, the run folder on the disk.
- ``kill``: the run folder on one tmpfs, ``$TMPDIR`` on another; the training process is killed (SIGKILL) the moment
  the folder starts to change during the rewrite of ``last.ckpt``; then the run is resumed from its folder.
- ``full``: the run folder on a tmpfs that the run fills up while it rewrites ``last.ckpt`` (its second checkpoint
  is a little larger than the first), through ``train.fit_and_test``, whose closing sentence is recorded.
- ``full_first``: the same, but the disk is full before the first checkpoint.
- ``readonly``: the run's ``checkpoints/`` on a tmpfs that turns read-only before the run's second checkpoint, through
  ``train.fit_and_test``, whose closing sentence is recorded.
- ``full_wandb``: ``python train.py`` with the W&B logger (run in this process) on a disk too small for one
  checkpoint: its closing sentence and ``train.log``.

A callback pads every checkpoint with a few MiB, so that a rewrite lasts long enough to be seen and interrupted.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

PAD = 16 * 2**20  # bytes added to every checkpoint
GROWTH = 2**20  # what the second checkpoint of the ``full`` scenarios adds


def mount_tmpfs(folder: Path, size: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    return folder


def use_tmpdir(folder: Path) -> None:
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # tempfile caches the folder it found first


def fill(folder: Path) -> None:
    """Write a filler file into ``folder`` until its filesystem is full."""
    with open(folder / "filler", "wb", buffering=0) as f:  # unbuffered: nothing is left to write at close
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err


class Pad(L.Callback):
    """Pads each checkpoint; ``fill_at``: before the checkpoint with that number (1, 2, ...) fill the run folder's disk;
    ``readonly_at``: before that checkpoint, remount ``folder`` read-only; ``notify``: a file descriptor told the
    number of each checkpoint about to be written."""

    def __init__(self, fill_at: int | None = None, folder: str | None = None, notify: int | None = None,
                 readonly_at: int | None = None) -> None:
        self.count, self.fill_at, self.notify, self.readonly_at = 0, fill_at, notify, readonly_at
        self.folder = Path(folder) if folder else None

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.count += 1
        grow = GROWTH if self.fill_at is not None and self.count >= 2 else 0
        checkpoint["padding"] = torch.zeros(PAD + grow, dtype=torch.uint8)
        if self.count == self.fill_at:
            fill(self.folder)
        if self.count == self.readonly_at:
            subprocess.run(["mount", "-o", "remount,ro", str(self.folder)], check=True)
        if self.notify is not None:
            os.write(self.notify, bytes([self.count]))


def config(corpus: dict[str, Path], work: Path, run: Path, *extra: str, **pad: Any) -> Any:
    """The tiny run, checkpointing ``last.ckpt`` (only) every 2 steps, its checkpoints padded (``pad``: Pad's
    arguments)."""
    import xl.config.compose  # noqa: F401 (registers the schemas the configs name)
    from tests.conftest import compose_config, tiny_overrides

    overrides = [o for o in tiny_overrides(work, corpus) if not o.startswith(("paths.output_dir", "data.cache_dir"))]
    return compose_config(
        *overrides, f"paths.output_dir={run}", f"data.cache_dir={work / 'cache'}", "trainer.max_steps=6",
        "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.every_n_train_steps=2",
        "callbacks.model_checkpoint.save_top_k=0", "test=false", "+callbacks.pad._target_=" + __name__ + ".Pad",
        *(f"+callbacks.pad.{k}={v}" for k, v in pad.items()), *extra)


def fit(cfg: Any) -> L.Trainer:
    from xl.training.build import build_run

    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
    return run.trainer


def files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir())} if folder.is_dir() else {}


def resumable(run: Path) -> dict[str, Any]:
    """What a resume of the folder would start from: the checkpoint it picks, or why it refuses."""
    from xl.training.checkpoints.checkpoint import Checkpoint

    try:
        checkpoint = Checkpoint.open(run)
    except Exception as err:  # the report says what went wrong
        return {"error": f"{type(err).__name__}: {err}"}
    return {"path": checkpoint.path.name, "step": checkpoint.global_step}


def outcome(call: Any) -> str | None:
    try:
        call()
    except SystemExit as err:
        return str(err.code)
    except Exception as err:  # recorded, not raised: the other scenarios still run
        return f"{type(err).__name__}: {err}"
    return None


def small_tmpdir(corpus: dict[str, Path], work: Path) -> dict[str, Any]:
    tmp = mount_tmpfs(work / "small_tmpdir" / "tmp", "64k")
    use_tmpdir(tmp)
    run = work / "small_tmpdir" / "run"
    error = outcome(lambda: fit(config(corpus, work, run)))
    use_tmpdir(work)
    return {"error": error, "checkpoints": files(run / "checkpoints"), "tmpdir": files(tmp), **resumable(run)}


def kill(corpus: dict[str, Path], work: Path) -> dict[str, Any]:
    """SIGKILL the training while a checkpoint after the first is half-written; then resume the folder."""
    run = mount_tmpfs(work / "kill" / "fs", "256m") / "run"
    tmp = mount_tmpfs(work / "kill" / "tmp", "256m")
    use_tmpdir(tmp)
    folder = run / "checkpoints"
    read, write = os.pipe()
    cfg = config(corpus, work, run, "trainer.max_steps=12", notify=write)  # checkpoints at 2, 4, ..., 12
    pid = os.fork()
    if pid == 0:  # the training process
        os.close(read)
        try:
            fit(cfg)
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"\1"
    assert os.read(read, 1) == b"\2", "the first checkpoint was not written"
    before = files(folder)  # the first checkpoint is complete when the second one starts
    size = before["last.ckpt"]
    seen, deadline = None, time.monotonic() + 60
    while seen is None and time.monotonic() < deadline:
        now = files(folder)
        if any(0 < n < 0.99 * size for n in now.values()):  # a checkpoint file half-written
            os.kill(pid, signal.SIGKILL)
            seen = now
    os.waitpid(pid, 0)
    report = {"before": before, "seen": seen, "after_kill": files(folder), "tmpdir": files(tmp), **resumable(run)}
    error = outcome(lambda: fit(config(corpus, work, run, f"ckpt_path={run}", "trainer.max_steps=14")))
    report.update(resume_error=error, after_resume=files(folder), resumed=resumable(run))
    use_tmpdir(work)
    return report


def full(corpus: dict[str, Path], work: Path, fill_at: int) -> dict[str, Any]:
    """The run's disk fills up just before checkpoint number ``fill_at``; train.py's closing sentence is kept."""
    from xl import train

    name = "full" if fill_at > 1 else "full_first"
    disk = mount_tmpfs(work / name / "fs", "64m")
    run = disk / "run"
    cfg = config(corpus, work, run, fill_at=fill_at, folder=disk)
    message = outcome(lambda: train.fit_and_test(cfg) and None)
    (disk / "filler").unlink()
    return {"message": message, "checkpoints": files(run / "checkpoints"), **resumable(run)}


def readonly(corpus: dict[str, Path], work: Path) -> dict[str, Any]:
    """The run's checkpoints/ turns read-only before its second checkpoint; train.py's closing sentence is kept."""
    from xl import train

    run = work / "readonly" / "run"
    folder = mount_tmpfs(run / "checkpoints", "64m")
    cfg = config(corpus, work, run, readonly_at=2, folder=folder)
    message = outcome(lambda: train.fit_and_test(cfg) and None)
    return {"message": message, "checkpoints": files(folder), **resumable(run)}


def full_wandb(corpus: dict[str, Path], work: Path) -> dict[str, Any]:
    """``python train.py`` (in this process) with the W&B logger, on a disk too small for the first checkpoint."""
    from tests.conftest import tiny_overrides
    from xl import train

    run = mount_tmpfs(work / "full_wandb" / "fs", "350k") / "run"
    overrides = [o for o in tiny_overrides(work, corpus) if not o.startswith(("paths.output_dir", "logger"))]
    sys.argv = ["train.py", *overrides, "logger=wandb", f"hydra.run.dir={run}",
                "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.every_n_train_steps=2"]
    message = outcome(train.main)  # the last scenario: Hydra's globals are left as the command leaves them
    log = run / "train.log"
    return {"message": message, "log": log.read_text() if log.is_file() else None,
            "checkpoints": files(run / "checkpoints")}


def main() -> None:
    report_path, corpus_dir, work = (Path(a) for a in sys.argv[1:4])
    chosen = sys.argv[4:]
    corpus = {split: corpus_dir / f"{split}.txt" for split in ("train", "val", "test")}
    torch.set_num_threads(1)
    report, times = {}, {}
    scenarios = {"kill": lambda: kill(corpus, work),  # first: the training process is forked before this one trains
                 "small_tmpdir": lambda: small_tmpdir(corpus, work), "full": lambda: full(corpus, work, fill_at=2),
                 "full_first": lambda: full(corpus, work, fill_at=1), "readonly": lambda: readonly(corpus, work),
                 "full_wandb": lambda: full_wandb(corpus, work)}
    for name, scenario in scenarios.items():
        if name not in chosen if chosen else name == "full_wandb":
            continue
        start = time.monotonic()
        report[name] = scenario()
        times[name] = round(time.monotonic() - start, 2)
    report["seconds"] = times
    report_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
