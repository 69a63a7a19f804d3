"""A scoring that stops keeps what it finished, and a rerun with the same settings goes on from there.

The scorer rewrites ``results.json`` (atomically) after every cell, marked ``"complete": false`` until the last one,
with the ``identity`` of what its cells depend on: the checkpoint (its path, step, size and time of writing) and every
setting that changes a cell's samples or answers. A rerun into the same folder takes the cells of a file of the same
identity and scores only the others; a file of another identity is refused in one sentence, so that cells of two
settings are never mixed.

SIGTERM, SIGINT (Ctrl+C) and SIGUSR1 end the scoring as they end xl.evaluate (:mod:`xl.training.services.signals`): one
sentence that says what is kept and how to go on, and exit status 128 + the signal's number. A signal that comes
while ``results.json`` is written waits for the write to end.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from xl.babilong.report import Cell
from xl.config.rules import ConfigError
from xl.data.babilong.lengths import length_name
from xl.training.services.signals import SIGNALS, Stopped, end_stopped


def identity(cfg: DictConfig, checkpoint: Any, decoding: str, background: str, device: str) -> dict[str, Any]:
    """What the cells of a scoring depend on."""
    path = Path(checkpoint.path).resolve()
    stat = path.stat()
    return {"ckpt": str(path), "step": checkpoint.global_step, "ckpt_bytes": stat.st_size,
            "ckpt_mtime_ns": stat.st_mtime_ns, "tasks": [str(t) for t in cfg.tasks],
            "lengths": [length_name(n) for n in cfg.lengths], "samples": cfg.samples, "seed": cfg.seed,
            "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens, "decoding": decoding,
            "background": background, "device": device,
            # the memory's evaluation settings, where the scoring gives any
            **({"memory": dict(OmegaConf.to_container(cfg.memory))} if cfg.get("memory") else {})}


def kept_cells(path: Path, expected: dict[str, Any], setting: str) -> list[Cell]:
    """The cells of ``path`` (a results.json) if it is a scoring of ``expected``; none if there is no file; a
    scoring of other settings is refused."""
    if not path.is_file():
        return []
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        values = {}
    found = values.get("identity") if isinstance(values, dict) else None
    if found != expected:
        differs = next((k for k in expected if not isinstance(found, dict) or found.get(k) != expected[k]), "")
        what = f" ({differs}: {found.get(differs)!r}, not {expected[differs]!r})" if isinstance(found, dict) else ""
        raise ConfigError(f"{path} holds another scoring{what}; rerun it with its own settings or set {setting} to "
                          f"another folder")
    return [Cell.from_dict(c) for c in values["cells"]]


@dataclass
class Progress:
    """Where the scoring stands, for the sentence a stop prints."""

    path: Path | None = None
    total: int = 0
    kept: int = 0
    setting: str = "hydra.run.dir"
    folder: str = ""


def stop_sentence(signum: int, progress: Progress) -> str:
    name = signal.Signals(signum).name
    again = f"rerun the same command with {progress.setting}={progress.folder}"
    if not progress.kept or progress.path is None:
        return f"stopped by {name} before any cell was scored; nothing is kept; {again} to start again"
    return (f"stopped by {name}: {progress.kept} of {progress.total} cells are kept in {progress.path} (marked "
            f"incomplete); to score the other {progress.total - progress.kept}, {again}")


class SignalStop:
    """While entered: the stopping signals raise :class:`~xl.training.services.signals.Stopped` (or, inside
    :meth:`held`, when it ends); on leaving, the handlers before are back. A :class:`Stopped` that leaves the block ends
    the command with :func:`stop_sentence` and exit status 128 + the signal's number
    (:func:`xl.training.services.signals.end_stopped`)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.signum: int | None = None
        self.holding = False
        self.before: dict[int, Any] = {}

    def handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        if not self.holding:
            raise Stopped(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A block a signal does not cut (a file being written): the stop comes after it."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.signum is not None:
            raise Stopped(self.signum)

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():  # handlers can be set in the main thread only
            self.before = {s: signal.signal(s, self.handle) for s in SIGNALS}
        return self

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        for s, handler in self.before.items():
            signal.signal(s, handler)
        if isinstance(error, Stopped):
            end_stopped(error, stop_sentence(error.signum, self.progress))
