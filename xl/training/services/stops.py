"""What a run says when it stops before its end: one sentence that says why, names the checkpoint a resume
continues from (or says that there is none) and gives the command that goes on.

:func:`stopping` wraps ``trainer.fit`` and ``trainer.test``: a signal (Lightning's ``SIGTERMException``, see
:class:`xl.training.services.callbacks.PreemptionCheckpoint`), a full disk, a checkpoint folder that refuses writes
(read-only, no permission: :class:`xl.training.checkpoints.checkpoint_io.CheckpointWriteError`) and too many non-finite
steps end the command with ``error: <sentence>`` and exit status 1. The sentence is the last line on the terminal (the
progress bars are closed first) and is written to the run's log file (``train.log``) too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError, newest_checkpoint
from xl.training.checkpoints.checkpoint_io import CheckpointWriteError
from xl.training.loop.nonfinite import NonFiniteError
from xl.training.services.callbacks import PreemptionCheckpoint
from xl.training.services.console import to_log_files

log = logging.getLogger(__name__)
FULL = (errno.ENOSPC, errno.EDQUOT)


def newest_complete(folder: Path) -> Checkpoint | None:
    """The checkpoint a resume of ``folder`` would continue from, or None."""
    try:
        return newest_checkpoint(folder)
    except CheckpointError:
        return None


def kept(folder: Path) -> str:
    """Which checkpoint of the run survives: 'the last complete checkpoint, PATH (step N), is intact'."""
    checkpoint = newest_complete(folder)
    if checkpoint is None:
        return ""
    return f"the last complete checkpoint, {checkpoint.path} (step {checkpoint.global_step}), is intact"


def resume_command(run_dir: str | Path) -> str:
    return f"python train.py ckpt_path={run_dir}"


def signal_sentence(callback: PreemptionCheckpoint | None, run_dir: Path) -> str:
    """What a stop by a signal says: where it came (:class:`PreemptionCheckpoint`'s record), what is saved."""
    name = "SIGTERM" if callback is None else callback.signal_name or "a signal to another process"
    stage = callback.stage if callback is not None else None
    checkpoint = newest_complete(run_dir)
    resume = f"resume with: {resume_command(run_dir)}"
    if stage == "test":
        where = f" ({checkpoint.path}, step {checkpoint.global_step})" if checkpoint else ""
        return f"stopped by {name} during the test; the training is complete{where}; test it with: " \
               f"{resume_command(run_dir)}"
    if stage == "sanity check":
        if checkpoint is None:
            return f"stopped by {name} during the sanity check, before the first training step; nothing was " \
                   "saved: run the command again"
        return f"stopped by {name} during the sanity check, before the first training step; the run is as it was " \
               f"(step {checkpoint.global_step}): {resume}"
    if callback is not None and callback.saved_path is not None and checkpoint is not None:
        step = f"step {checkpoint.global_step}"
        where = {"validation": f" after {step} and its validation",
                 "interrupted validation": f" during the validation after {step}"}
        return f"stopped by {name}{where.get(stage, f' after {step}')}, checkpoint {checkpoint.path}; {resume}"
    if checkpoint is not None:  # no step checkpoint of the stop (no PreemptionCheckpoint callback, or several ranks)
        return f"stopped by {name}; {kept(run_dir)}; {resume}"
    return f"stopped by {name} before the first complete checkpoint was written: run the command again"


def full_disk_sentence(err: OSError, run_dir: Path) -> str:
    intact = kept(run_dir)
    if intact:
        return (f"disk full while training ({err.strerror}); {intact}; free space and resume with: "
                f"{resume_command(run_dir)}")
    return (f"disk full while training ({err.strerror}) before the first complete checkpoint was written; free "
            "space and run the command again")


def unwritable_sentence(err: CheckpointWriteError, run_dir: Path) -> str:
    """A checkpoint folder that refuses writes for another reason than a full disk (read-only, no permission)."""
    where = f"cannot write checkpoints to {err.filename} ({err.strerror})"
    checkpoint = newest_complete(run_dir)
    if checkpoint is not None:
        return (f"{where}; {checkpoint.path} (step {checkpoint.global_step}) is intact; make the folder writable, "
                f"then resume: {resume_command(run_dir)}")
    return (f"{where} before the first complete checkpoint was written; make the folder writable and run the command "
            "again")


def nonfinite_sentence(err: NonFiniteError, run_dir: Path) -> str:
    intact = kept(run_dir)
    return f"{err}; " + (f"{intact}" if intact else "no checkpoint was written")


def close_progress_bars(trainer: L.Trainer) -> None:
    """Close the bars a stopped loop left open: closed later (when Python exits) they would be drawn again, after
    the sentence."""
    for callback in trainer.callbacks:
        if isinstance(callback, TQDMProgressBar):
            for name in ("val_progress_bar", "test_progress_bar", "train_progress_bar"):  # the main bar last
                with contextlib.suppress(TypeError, AttributeError):  # a bar this run never opened
                    getattr(callback, name).close()


def finish_wandb(trainer: L.Trainer, preempted: bool) -> None:
    """End the W&B run with the command's exit status (1); a stop by a signal is marked preempting first, which W&B
    records as a preempted run (one to resume), not a failed one."""
    for logger in trainer.loggers if trainer.is_global_zero else []:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            if preempted:
                run.mark_preempting()
            run.finish(exit_code=1)


def end(trainer: L.Trainer, sentence: str, preempted: bool = False) -> None:
    """End the command with exit status 1 and ``sentence``, said once: by rank 0 of several processes."""
    close_progress_bars(trainer)
    finish_wandb(trainer, preempted)
    if not trainer.is_global_zero:
        raise SystemExit(1)
    to_log_files(f"error: {sentence}")
    raise SystemExit(f"error: {sentence}")


@contextlib.contextmanager
def stopping(trainer: L.Trainer, run_dir: str | Path) -> Iterator[None]:
    """Turn a stop by a signal, a full disk, a checkpoint folder that refuses writes or non-finite steps into the run's
    closing sentence."""
    folder = Path(run_dir)
    try:
        yield
    except NonFiniteError as err:
        end(trainer, nonfinite_sentence(err, folder))
    except SIGTERMException:
        callback = next((c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
        end(trainer, signal_sentence(callback, folder), preempted=True)
    except OSError as err:
        if isinstance(err, CheckpointWriteError) and err.errno not in FULL:
            end(trainer, unwritable_sentence(err, folder))
        if err.errno not in FULL:
            raise
        logging.raiseExceptions = False  # a library's log file on the full disk: no traceback after the sentence
        end(trainer, full_disk_sentence(err, folder))
