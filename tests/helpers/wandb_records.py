"""What an offline W&B run folder would upload, read once W&B has finished writing it (xl.training.services.wandb_log
reads the ``.wandb`` transaction logs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import wandb

from xl.training.services import wandb_log


def written() -> None:
    """Wait until W&B has written every record it was given. ``run.finish()`` returns when W&B's service process has
    the records, not when its writer has flushed them to the file; ``wandb.teardown()`` returns when that process has
    exited. A later run starts a new one."""
    wandb.teardown()


def records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, in order, once every writer has finished."""
    written()
    return wandb_log.records(path)


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows: each history record's values, with ``_step`` W&B's step of the row."""
    written()
    return wandb_log.history(path)


def of_type(path: Path, kind: str) -> list[Any]:
    """The records of one type (``run``, ``exit``, ``preempting``, ...), as W&B's messages."""
    return [getattr(r, kind) for r in records(path) if r.WhichOneof("record_type") == kind]
