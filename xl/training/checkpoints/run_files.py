"""Where a run folder keeps what its command composed (``.hydra/``), and the run folder of a path: shared by the
checkpoint reader (:mod:`xl.training.checkpoints.checkpoint`) and what is read back of a run (:mod:`xl.training.runs`).
Imports
neither torch nor Hydra."""

from __future__ import annotations

from pathlib import Path

CONFIG = Path(".hydra") / "config.yaml"
OVERRIDES = Path(".hydra") / "overrides.yaml"
HYDRA = Path(".hydra") / "hydra.yaml"


def find_run_folder(path: str | Path) -> Path | None:
    """The run folder of ``path`` (a run folder, or a checkpoint in it or in its ``checkpoints/``), if it holds
    the run's composed config."""
    p = Path(path).expanduser()
    candidates = (p, p.parent) if p.is_dir() else (p.parent, p.parent.parent)  # RUN, RUN/checkpoints, a file
    return next((folder for folder in candidates if (folder / CONFIG).is_file()), None)
