"""Writing checkpoints so that a kill or a full disk never leaves the newest one truncated, on any filesystem.

Lightning's own writer stages a checkpoint with ``tempfile.mkstemp()`` in ``$TMPDIR`` and then moves it; when the
run folder is on another filesystem (a cluster's local ``/tmp`` and shared scratch), the move copies into the
checkpoint in place, so a kill or a full disk during the copy leaves it truncated, and a small ``$TMPDIR`` fails
every save. :class:`AtomicCheckpointIO`, a Lightning ``CheckpointIO`` plugin, writes the file beside its final name,
flushes it to the disk (fsync) and renames it into place (``os.replace``, atomic within one filesystem), then syncs
the folder so that the rename itself survives a crash. A failure removes the temporary; one that a kill leaves is
removed by :func:`remove_partial` when the run starts again. Remote paths (``s3://``, ...) keep Lightning's writer.
A local write or removal that fails raises :class:`CheckpointWriteError`, which names the folder
(:mod:`xl.training.services.stops` turns it into the run's closing sentence).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.plugins import TorchCheckpointIO

log = logging.getLogger(__name__)
PARTIAL = ".partial"  # a checkpoint being written: ``.<name>.<random>.partial`` beside ``<name>``


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written into (or removed from) its folder: the ``OSError``'s errno and cause,
    with the folder as ``filename``."""


def write_error(err: OSError, path: Any) -> CheckpointWriteError:
    return CheckpointWriteError(err.errno, err.strerror or str(err), str(Path(path).parent))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with an atomic save on the run folder's own filesystem.

    ``preloaded``: a checkpoint already read (path, state), handed to Lightning when it loads that path, once,
    instead of reading the file again (a resume reads its checkpoint once:
    :class:`xl.training.checkpoints.resume.Resume`).
    """

    def __init__(self, preloaded: tuple[Path, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.preloaded = preloaded

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self.preloaded is not None and Path(path) == self.preloaded[0]:
            state, self.preloaded = self.preloaded[1], None
            return state
        return super().load_checkpoint(path, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(url_to_fs(str(path))[0], LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # Lightning's refusal, or a remote store
            return
        try:
            save_atomically(checkpoint, Path(path))
        except OSError as err:
            raise write_error(err, path) from err

    def remove_checkpoint(self, path: Any) -> None:
        try:
            super().remove_checkpoint(path)
        except OSError as err:
            if not isinstance(url_to_fs(str(path))[0], LocalFileSystem):
                raise
            raise write_error(err, path) from err


def save_atomically(state: Any, path: Path) -> None:
    """``torch.save(state)`` to ``path`` by way of a temporary file beside it: ``path`` holds the old file or the new
    one, whole, whatever happens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.parent / f".{path.name}.{secrets.token_hex(4)}{PARTIAL}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except RuntimeError as err:  # torch reports a failed write as a RuntimeError, the OSError as its context
            if isinstance(err.__context__, OSError):
                raise err.__context__ from err
            raise
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):  # (a folder turned read-only keeps it: remove_partial removes it later)
            os.unlink(name)
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX: fsync the directory)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_partial(folder: Path) -> list[Path]:
    """Remove the temporaries that a killed save left in ``folder``; returns them."""
    partial = sorted(folder.glob(f".*{PARTIAL}")) if folder.is_dir() else []
    for path in partial:
        path.unlink(missing_ok=True)
    if partial:
        log.info("removed %d partial checkpoint file(s) a killed save left in %s", len(partial), folder)
    return partial
