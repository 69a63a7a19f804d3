"""Lightning callbacks of the callbacks group: stopping cleanly when asked, and the job's summary for sweeps.

A stop by a signal stops at a step boundary, where the memory, the data position and the weights agree, and loses
no validation: :class:`PreemptionCheckpoint` hears SIGTERM, SIGUSR1 (SLURM's warning before preemption) and SIGINT
(Ctrl+C) ahead of Lightning's own SIGTERM handler. In a fit the first signal lets the step under way finish, writes
``last.ckpt`` at its end, lets the validation due at that step (if any) run in full and write its checkpoints, and
ends the fit before the next step; several processes agree on the step. A second signal, and a signal in the sanity
check or a test, goes to Lightning's handler, which ends the loop under way after its current batch (and tells the
processes of a DDP launcher). The fit or test raises Lightning's ``SIGTERMException``, which train.py turns into one
sentence and a non-zero exit. A second Ctrl+C interrupts at once.

Lightning's own SLURM handler (SIGUSR1 with ``auto_requeue``) is not used: it saves ``hpc_ckpt_N.ckpt`` at whatever
point of a step the signal arrives, where the memory and the weights need not agree.

:class:`JobSummary` writes the job's metrics, training throughput and cost into ``results.json`` in the run
folder, which :mod:`xl.training.services.sweep` gathers into a sweep's summary.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from xl.device.footprint import memory_bytes
from xl.model.memory_settings import describe
from xl.training.loop.module import batch_tokens

log = logging.getLogger(__name__)
FORWARDED = tuple(s for s in (signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None)


class PreemptionCheckpoint(Checkpoint):
    """On SIGTERM/SIGUSR1/SIGINT: finish the step (and its validation, when one is due), save ``last.ckpt``, stop.

    A Lightning ``Checkpoint`` callback, so Lightning runs it after the other callbacks of each hook: the checkpoint
    it writes at a step holds their state at the end of that step (the job summary's counts included), and the one
    it writes after a validation holds ``ModelCheckpoint``'s record of that validation.

    During a fit's training and validations the first signal is only noted: the step under way finishes, ``last.ckpt``
    is written at its end, and the fit stops before the next step, after the validation that falls due at that step
    (if one does) has run in full and written its checkpoints, so that no validation is lost to a stop. Under several
    processes a signal seen by any rank stops every rank at the same step. A second signal, and a signal during the
    sanity check or a test, goes to Lightning's own handler, which ends the loop under way after its current batch.

    After a stop, :attr:`signal_name` names the signal, :attr:`saved_path` the checkpoint it wrote (None when
    nothing was trained since the fit started) and :attr:`stage` where the run stopped: ``"training"`` (at a step
    boundary), ``"validation"`` (after the step's validation ran in full), ``"interrupted validation"`` (a second
    signal cut a validation short), ``"sanity check"`` or ``"test"``.
    """

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)
        self.signal_name: str | None = None
        self.saved_path: Path | None = None
        self.stage: str | None = None
        self.lightning_handler: Any = None
        self.noted = False  # a first signal in a fit's training or validation, not yet acted on
        self.stopping = False  # every rank agreed to stop; last.ckpt is written
        self.in_fit = False  # between the sanity check and the end of training: a first signal is noted, not passed on

    # ---- hearing the signals ------------------------------------------------------------------------------------
    def heard(self, signum: int, frame: Any) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name
        if signum == signal.SIGINT:  # a second Ctrl+C falls through to Python's KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.in_fit and not self.noted:
            self.noted = True
            return
        if callable(self.lightning_handler):
            self.lightning_handler(signum, frame)

    def listen(self) -> None:
        """Hear all three signals ahead of Lightning's SIGTERM handler of this fit, validate or test (installed before
        its first hook; Lightning puts back the handlers of before when it ends, also on an exception)."""
        if signal.getsignal(signal.SIGTERM) == self.heard:  # (a bound method: equal, not identical)
            return
        self.lightning_handler = signal.getsignal(signal.SIGTERM)
        for signum in (signal.SIGTERM, *FORWARDED):
            signal.signal(signum, self.heard)

    def agreed(self, trainer: L.Trainer) -> bool:
        """Whether any rank noted a signal (every rank calls this at the same hook)."""
        if trainer.world_size > 1:
            return trainer.strategy.reduce_boolean_decision(self.noted, all=False)
        return self.noted

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.signal_name = self.saved_path = self.stage = None
        self.noted = self.stopping = self.in_fit = False
        self.listen()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.received_sigterm:  # during the sanity check: nothing was trained, nothing is saved
            self.stop(trainer, "sanity check")
        self.signal_name = self.saved_path = self.stage = None
        self.noted = self.stopping = False
        self.in_fit = True
        self.listen()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.stopping and not validation_due(trainer):  # run only because the fit was asked to stop
            self.stop(trainer, "training")
        self.listen()

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.signal_name = self.stage = None
        self.in_fit = False
        self.listen()

    # ---- stopping -----------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.stopping or not self.agreed(trainer):
            return
        self.stopping = True
        self.save(trainer)
        # Lightning logs the step, then starts a validation, due or not (on_validation_start tells them apart).
        trainer.should_stop = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if self.stopping or self.agreed(trainer):  # the validation has run in full: keep what it recorded too
            self.stopping = True
            self.save(trainer)
            self.stop(trainer, "validation")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.stopping:  # a fit without validations
            self.stop(trainer, "training")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.in_fit = False
        if self.stopping:  # the signal came in the last step: the run stops before its test
            self.stop(trainer, "training")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Lightning ended a loop on a signal (a second one in a fit, or one in the sanity check or a test)."""
        self.in_fit = False
        if not isinstance(exception, SIGTERMException) or self.stage is not None:
            return
        if trainer.sanity_checking:
            self.stage = "sanity check"
        elif trainer.state.fn == TrainerFn.FITTING and trainer.validating:
            self.stage = "interrupted validation"
            if self.saved_path is None and trainer.world_size == 1:  # keep the step the validation follows
                self.save(trainer)
        elif trainer.state.fn == TrainerFn.FITTING:
            self.stage = "training"
        else:
            self.stage = "test"

    def save(self, trainer: L.Trainer) -> None:
        self.saved_path = self.dirpath / "last.ckpt"
        trainer.save_checkpoint(self.saved_path)
        if trainer.is_global_zero:
            log.info("%s received: checkpoint %s at step %d", self.signal_name or "a signal on another rank",
                     self.saved_path, trainer.global_step)

    def stop(self, trainer: L.Trainer, stage: str) -> None:
        self.stage = stage  # (Lightning then calls on_exception, which ends the fit's listening)
        after = "step {} and its validation" if stage == "validation" else "step {}"
        saved = f" after {after.format(trainer.global_step)}; checkpoint {self.saved_path}" if self.saved_path else ""
        during = "" if stage == "validation" else f" during the {stage}"
        raise SIGTERMException(f"stopped by {self.signal_name or 'SIGTERM'}{during}{saved}")


def validation_due(trainer: L.Trainer) -> bool:
    """Whether the fit's schedule validates after the step just trained (Lightning's rule for validations by
    ``val_check_interval`` and ``check_val_every_n_epoch``, without the one that validates a fit asked to stop)."""
    loop = trainer.fit_loop.epoch_loop
    every = trainer.check_val_every_n_epoch
    if not trainer.enable_validation or (every is not None and (trainer.current_epoch + 1) % every):
        return False
    if trainer.val_check_batch == float("inf"):  # an iterable of unknown length: at its end
        return loop.batch_progress.is_last_batch
    done = (loop.total_batch_idx if every is None else loop.batch_idx) + 1
    return done % trainer.val_check_batch == 0


class JobSummary(L.Callback):
    """Write the job's numbers to ``path`` after fitting, and again after testing.

    Training throughput counts only the time inside training steps (forward, backward, optimizer),
    not validation, data loading or checkpointing; wall time runs from the trainer's creation. A resumed run counts
    the whole run: the checkpoint carries the counts up to its step (:meth:`state_dict`), so ``steps``,
    ``train_tokens``, ``train_tok_s`` and ``wall_s`` cover the work that led to the final weights, every session
    up to the checkpoint the next one resumed from (steps trained after it and lost are not counted). A session that
    only tests keeps the training figures the file already holds.
    """

    TRAINING = ("steps", "train_tokens", "train_tok_s", "wall_s")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.created = time.perf_counter()
        self.train_seconds = 0.0
        self.train_tokens = 0
        self.earlier_wall_s = 0.0  # sessions before this one, up to the checkpoint it resumed from
        self.fitted = False
        self.metrics: dict[str, float] = {}
        self._batch_start = 0.0

    def state_dict(self) -> dict[str, float]:
        return {"train_seconds": self.train_seconds, "train_tokens": self.train_tokens, "wall_s": self.wall_s()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed fit continues the checkpoint's counts; a test after a fit in this process (which reloads the
        best checkpoint) keeps this process's counts, which already include the checkpoint's."""
        if self.fitted:
            return
        self.train_seconds = state_dict["train_seconds"]
        self.train_tokens = state_dict["train_tokens"]
        self.earlier_wall_s = state_dict["wall_s"]

    def wall_s(self) -> float:
        return self.earlier_wall_s + time.perf_counter() - self.created

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.strategy.root_device.type == "cuda":  # kernels run asynchronously: wait before reading the clock
            torch.cuda.synchronize()
        self.train_seconds += time.perf_counter() - self._batch_start
        self.train_tokens += batch_tokens(batch) * trainer.world_size  # every rank reads a batch of the same shape

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fitted = True
        self._record(trainer, pl_module, "val/")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, pl_module, "test/")

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, prefix: str) -> None:
        self.metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)})
        if trainer.is_global_zero:
            values = self.describe(trainer, pl_module)
            if not self.fitted and self.path.is_file():  # this process only tests: the training is the file's
                earlier = json.loads(self.path.read_text())
                values.update({k: earlier[k] for k in self.TRAINING if k in earlier})
                values.update({k: v for k, v in earlier.items() if k.startswith("val/")})
            write_json(self.path, {**values, **self.metrics})

    def describe(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The run's context and cost; ``cache_mb`` is one rank's training memory, compressed slots and memory tokens
        included (:func:`xl.device.footprint.memory_bytes`)."""
        cfg = pl_module.config
        datamodule = trainer.datamodule
        dtype = next(pl_module.parameters()).dtype
        return {
            "mem_len": cfg.mem_len,
            "eval_mem_len": pl_module.eval_context.mem_len,
            "memory": describe(cfg.memory),
            "grad_segments": pl_module.grad_segments,
            "doc_boundaries": pl_module.doc_boundaries,
            "scored": getattr(datamodule, "scored", "every token"),  # which targets the metrics count
            "tgt_len": datamodule.tgt_len,
            "batch_size": datamodule.batch_size,
            "unit": pl_module.quality_name,
            "params": sum(p.numel() for p in pl_module.parameters()),
            "cache_mb": memory_bytes(cfg, cfg.mem_len, datamodule.batch_size, dtype, datamodule.tgt_len) / 2**20,
            "steps": trainer.global_step,
            "train_tokens": self.train_tokens,
            "train_tok_s": self.train_tokens / self.train_seconds if self.train_seconds else None,
            "wall_s": self.wall_s(),
            **(datamodule.summary() if hasattr(datamodule, "summary") else {}),  # a curriculum's stage
        }


def write_json(path: Path, values: dict[str, Any]) -> None:
    """Write via a temporary file, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values, indent=1) + "\n")
    tmp.replace(path)
