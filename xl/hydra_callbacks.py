"""Hydra callbacks: checks and reports around whole runs and sweeps (configured under ``hydra.callbacks``)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def ensure_writable(folder: str, setting: str) -> None:
    """Create ``folder`` and prove a file can be written there, or exit with one sentence."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        sys.exit(f"error: cannot write to the output folder {folder} ({err.strerror}); set {setting} to a writable folder")


class CheckOutputDir(Callback):
    """Hydra creates the run folder itself and fails with a traceback; check it first."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        ensure_writable(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        ensure_writable(config.hydra.sweep.dir, "hydra.sweep.dir")
