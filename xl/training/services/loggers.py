"""Lightning's loggers, continuing a run's history when the run is resumed into its own folder.

- :class:`CSVLogger`: Lightning's CSVLogger writes ``<run folder>/csv/metrics.csv`` and, on a resume into the same
  folder, deletes the file. This one keeps the rows of the steps before the checkpoint the run continues from and
  appends the resumed session's rows (rows of steps after the checkpoint, which the resume trains again, go, and so
  do the rows of a test before the resume: the run's test is the one at its end). A session that only tests (the
  run's training is complete) keeps every training row likewise. The row of the checkpoint's own step is written
  after the checkpoint (Lightning's order); a kill between the two leaves the file without it, and the resume writes
  it from the checkpoint (``XLLitModule.step_row``).
- :class:`WandbLogger`: each offline W&B session of a resumed run is a new folder (W&B cannot resume an offline run
  in place, W&B issue #4624), and W&B numbers a session's rows (``_step``) from 0. This one gives W&B the trainer's
  step as ``_step``, so the resumed session's rows continue the run's and ``wandb sync`` of all its folders uploads
  one history; values a callback sends with a smaller step of its own (ThroughputMonitor counts test batches)
  join the current row. A resumed offline session first logs the checkpoint's ``step_row`` values that the earlier
  sessions lack at that step (a kill after the checkpoint, before Lightning logged the row); a row the kill cut in
  two (callbacks' values logged before the checkpoint, the step's figures after) stays two records of one step.

:meth:`continue_from` tells a logger the step of the checkpoint the run resumes from (xl.training.build does).
"""

from __future__ import annotations

import csv
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from xl.training.services import wandb_log


class CSVLogger(LightningCSVLogger):
    """``csv/metrics.csv`` over all the sessions of a run (see the module's notes)."""

    resume_step: int | None = None
    step_row: dict[str, Any] | None = None
    writer: ExperimentWriter | None = None

    def continue_from(self, step: int, step_row: dict[str, Any] | None = None) -> None:
        """Continue the history at ``step``; ``step_row``: the metric row of the checkpoint's step, which the file may
        lack (a kill after the checkpoint, before Lightning wrote the row)."""
        self.resume_step, self.step_row = step, step_row

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self.writer is not None:
            return self.writer
        path = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
        kept: list[dict[str, Any]] = []
        header: list[str] = []
        if self.resume_step is not None and path.is_file():
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                header = list(reader.fieldnames or [])
                kept = [row for row in reader if int(row["step"]) < self.resume_step and not tested(row)]
            if self.step_row is not None and not any(logged(row, self.step_row) for row in kept):
                kept.append({k: str(v) for k, v in self.step_row.items()})
                header = sorted({*header, *self.step_row})
            aside = path.with_name(path.name + ".resumed")
            path.replace(aside)  # Lightning's writer deletes a metrics.csv it finds; the rows are written back below
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
            self.writer = ExperimentWriter(log_dir=self.log_dir)
        if header:
            self.writer.metrics_keys = header
            self.writer.metrics = [{k: v for k, v in row.items() if v != ""} for row in kept]
            with open(path, "w", newline="") as f:
                csv.DictWriter(f, fieldnames=header).writeheader()
            self.writer.save()
            aside.unlink()
        return self.writer


def logged(row: dict[str, str], step_row: dict[str, Any]) -> bool:
    """Whether ``row`` of the file is the step's row ``step_row``."""
    return int(row["step"]) == step_row["step"] and all(row.get(k) for k in step_row if k not in ("step", "epoch"))


def tested(row: dict[str, str]) -> bool:
    """Whether a CSV row holds a value of a test."""
    return any(key.startswith("test/") and value != "" for key, value in row.items())


class WandbLogger(LightningWandbLogger):
    """Lightning's WandbLogger with W&B's ``_step`` set to the trainer's step (see the module's notes)."""

    step = 0  # the step of W&B's current row
    step_row: dict[str, Any] | None = None  # the checkpoint's row, until the session's first values are logged

    def continue_from(self, step: int, step_row: dict[str, Any] | None = None) -> None:
        """Continue W&B's rows at ``step``; ``step_row``: see :meth:`CSVLogger.continue_from` (W&B's record of each
        session is kept as it was written)."""
        self.step, self.step_row = step, step_row

    def log_step_row(self) -> None:
        """Log the values of the checkpoint's row that the run's earlier offline sessions lack, at its step."""
        row, self.step_row = self.step_row, None
        run = self.experiment
        if row is None or not run.offline:
            return
        current = Path(run.dir).parent
        earlier = [s for s in wandb_log.sessions(current.parent, run.id) if s != current]
        held = wandb_log.logged_at(earlier, row["step"])
        values = {k: v for k, v in row.items() if k != "step" and k not in held}
        if set(values) - {"epoch"}:  # W&B's x-axis value joins each record of the step (Lightning's step_sync)
            run.log({**values, "trainer/global_step": row["step"]}, step=row["step"])

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self.step_row is not None:
            self.log_step_row()
        if step is None:
            super().log_metrics(metrics)
            return
        if step < self.step:  # a callback's own count (ThroughputMonitor's test batches): into the current row
            self.experiment.log(dict(metrics), step=self.step)
            return
        self.step = step
        self.experiment.log({**metrics, "trainer/global_step": step}, step=step)
