"""One launch per run folder: an OS lock on ``RUN/.lock``, held from before Hydra writes into the folder until the
command ends.

The lock is ``fcntl.flock`` on the open file: the kernel releases it when the process ends, however it ends (SIGKILL
and an out-of-memory kill included), so no stale lock is ever left to remove by hand. It belongs to the open file,
not to the process, so a second claim from the same process is refused too. Only the launch's rank 0 takes it
(:func:`launch_rank`): the other processes of a multi-process job (started by Lightning, ``torchrun`` or ``srun``)
write into the folder of their rank 0 and do not claim it.

Where the lock cannot be taken, the run goes on unlocked after one warning: on a system without ``fcntl`` (Windows;
Linux and macOS have it) and on a filesystem without locks (some network mounts).
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK = ".lock"
HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # what flock says when another open file holds the lock
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
_held: dict[Path, IO[str]] = {}  # the folders this process holds, by resolved path


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder; the message says what to do."""


def launch_rank() -> int:
    """This process's rank in its launch, from the variables that Lightning's, torchrun's and SLURM's launchers set
    (0 for a process that no launcher started); a process of another node counts as another rank."""
    return max((int(os.environ.get(name) or 0) for name in RANK_VARIABLES), default=0)


def acquire(folder: str | Path, setting: str = "hydra.run.dir") -> None:
    """Lock ``folder`` for this process until :func:`release`; :class:`RunFolderBusy` if another process (or another
    claim of this one) holds it."""
    folder = Path(folder).resolve()
    if fcntl is None:
        warnings.warn(f"this system has no fcntl: the run folder {folder} is not locked against a second process",
                      stacklevel=2)
        return
    path = folder / LOCK
    lock = open(path, "a")  # noqa: SIM115 (held open until release)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        lock.close()
        if err.errno in HELD:
            raise RunFolderBusy(f"another process is running in the run folder {folder} (it holds {path}); wait "
                                f"for it to end, or give another {setting}") from None
        warnings.warn(f"the run folder {folder} cannot be locked ({err.strerror}): a second process would not be "
                      "refused", stacklevel=2)
        return
    _held[folder] = lock


def release(folder: str | Path | None = None) -> None:
    """Give back the lock of ``folder`` (None: every folder this process holds)."""
    folders = list(_held) if folder is None else [Path(folder).resolve()]
    for path in folders:
        lock = _held.pop(path, None)
        if lock is not None:
            lock.close()  # closing the file releases its flock


@contextlib.contextmanager
def hold(folder: str | Path, setting: str = "hydra.run.dir") -> Iterator[None]:
    """The lock of ``folder`` for the ``with`` block."""
    acquire(folder, setting)
    try:
        yield
    finally:
        release(folder)
