"""Where a token cache is built: a private temporary folder beside the cache, locked while its build runs.

A build writes into ``.<cache folder>.<random>.tmp`` under the cache root and renames it to the cache folder when
it is complete (:func:`publish`), so a cache that a later run finds is whole. A build that is killed (SIGKILL, an
out-of-memory kill, a node that goes down) leaves its temporary folder behind; every later open of a cache under
the same root removes such folders (:func:`sweep`) once no process holds their lock.

The lock is an ``flock`` on ``.lock`` inside the folder, which the kernel releases when its process dies, on every
host that shares the filesystem where the filesystem supports locks. A folder whose lock cannot be tested (a
filesystem without locks) is left alone; a folder without a lock file (a build killed before it took its lock, or
a damaged cache moved aside by :func:`discard`) is removed once it is an hour old.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

LOCK = ".lock"
UNLOCKED_AGE = 3600  # seconds after which a temporary folder without a lock file is taken as abandoned
SUFFIX = ".tmp"


@contextlib.contextmanager
def workspace(folder: Path) -> Iterator[Path]:
    """A new temporary folder beside ``folder``, locked until the block ends, then removed (unless it was
    published: renamed to ``folder``)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=SUFFIX))
    lock = open(work / LOCK, "w")
    try:
        with contextlib.suppress(OSError):  # no locks on this filesystem: sweep() then leaves the folder alone
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield work
    finally:
        lock.close()
        shutil.rmtree(work, ignore_errors=True)


def publish(work: Path, folder: Path, complete: str) -> None:
    """Rename the finished ``work`` folder to ``folder``. A complete cache (one holding the file ``complete``) that
    another process published first wins; an incomplete one is replaced."""
    (work / LOCK).unlink(missing_ok=True)  # the lock stays held (by its open file) until the workspace ends
    if folder.exists() and not (folder / complete).is_file():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rename(work, folder)
    except OSError:
        if not (folder / complete).is_file():
            raise


def discard(folder: Path) -> None:
    """Move ``folder`` out of the way under a temporary name, then remove it (what a kill leaves is swept later).
    Memory maps that a process still holds on its files stay valid; a folder that cannot be moved raises OSError."""
    aside = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.discarded{SUFFIX}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:  # another process moved it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def sweep(root: Path) -> None:
    """Remove the temporary folders under ``root`` whose builds no longer run."""
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(".") and p.name.endswith(SUFFIX)]
    except OSError:  # no root yet, or one this process may not read
        return
    for work in candidates:
        if work.is_dir() and abandoned(work):
            size = folder_bytes(work)
            shutil.rmtree(work, ignore_errors=True)
            if not work.exists():  # a root this process may not write keeps them
                log.info("removed %s (%.1f MB), left by a cache build that did not finish", work, size / 1e6)


def folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            total += path.stat().st_size if path.is_file() else 0
    return total


def abandoned(work: Path) -> bool:
    """Whether no process builds in ``work`` any more: its lock can be taken, or it has none and is old."""
    try:
        lock = open(work / LOCK)
    except FileNotFoundError:
        try:
            return time.time() - work.stat().st_mtime > UNLOCKED_AGE
        except FileNotFoundError:  # removed meanwhile
            return False
    except OSError:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a running build, or this filesystem has no locks
            return False
    return True
