"""A run folder made from a model that train.py did not train: a converted or a shared model.

``xl.evaluate``, ``xl.generate``, ``train.py init_from=…`` and :class:`xl.training.checkpoints.checkpoint.Checkpoint`
read it like a run of ours::

    OUT/checkpoints/last.ckpt   the model config, the weights, the tokenizer's fingerprint, where the model came from
    OUT/<tokenizer file>        the vocabulary the data settings name (data.tokenizer_file=OUT/vocab.json, say)

The checkpoint has no training state: ``converted_from`` in its record says so (``ckpt_path`` naming it is refused,
``init_from`` starts a new run from it). OUT is written in a temporary folder beside it and renamed into place when
complete, so it is there whole or not at all (:func:`new_folder`, which ``xl.export`` uses too).

A staging folder is locked (``flock``) by the process that fills it; the kernel drops the lock when that process
ends, killed or not. A later write of the same OUT removes the staging folders that no process holds, and leaves
those of a write still under way.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from xl.model.memory_settings import EVALUATED
from xl.training.checkpoints.checkpoint import XL_KEY

log = logging.getLogger(__name__)

class RunFolderError(ValueError):
    """The folder to write cannot be used; the message says what to change."""


def sha256(path: Path) -> str:
    """The file's SHA-256, read in pieces (a published model's weights take a gigabyte)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(2**24), b""):
            digest.update(piece)
    return digest.hexdigest()


def check_new_folder(out: str | os.PathLike, setting: str = "OUT") -> Path:
    """OUT as a path, refused (before any work) if it exists and is not an empty folder."""
    path = Path(out).expanduser()
    remove_stale_staging(path)  # before any work: a killed write's staging folder can hold a full weights file
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise RunFolderError(f"{setting}={out} exists and is not empty; remove it or give another folder")
    return path


def run_state(values: dict[str, Any], weights: dict[str, torch.Tensor], unit: str, tokenizer_fingerprint: str,
              evaluation: dict[str, Any], converted_from: dict[str, Any], **record: Any) -> dict[str, Any]:
    """What train.py's checkpoints hold that evaluation, generation and init_from read: the weights under the
    Lightning module's ``model.`` prefix, the evaluation context (``mem_len``, ``clamp_len``, ``same_length``,
    None where it is the model's own, and optionally ``doc_boundaries``) as the evaluation defaults, and this
    project's record (model config, tokenizer fingerprint, provenance, and ``record``'s further entries)."""
    context = {f"eval_{k}": evaluation.get(k) for k in EVALUATED}
    if "doc_boundaries" in evaluation:
        context["doc_boundaries"] = evaluation["doc_boundaries"]
    return {
        "state_dict": {f"model.{k}": v for k, v in weights.items()},
        "global_step": 0,
        "epoch": 0,
        "hyper_parameters": {"model": values, "unit": unit, **context},
        XL_KEY: {"model_config": values, "tokenizer": tokenizer_fingerprint, "converted_from": converted_from,
                 **record},
    }


def staging_folders(out: Path) -> list[Path]:
    """The staging folders of OUT that :func:`new_folder` makes (``.OUT.<8 random characters>.tmp``), live or not."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}\.tmp")
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def same_folder(fd: int, folder: Path) -> bool:
    """Whether ``folder`` is still the folder ``fd`` opened (it may have gone, or been renamed to OUT, meanwhile)."""
    try:
        now, held = os.stat(folder), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def lock(folder: Path, wait: bool) -> int | None:
    """An open descriptor of ``folder`` holding its exclusive lock, or None: the folder is gone (or replaced), or
    another process holds the lock and ``wait`` is false. On a filesystem without locks: None when not waiting
    (nothing is taken for stale), the descriptor unlocked when waiting (the write goes on)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError:  # held by another process, or no locks on this filesystem
            if not wait:
                os.close(fd)
                return None
        if same_folder(fd, folder):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the staging folders of OUT that no live process holds (left by a killed ``xl.export`` or
    ``xl.convert``); returns them."""
    removed = []
    for folder in staging_folders(out):
        fd = lock(folder, wait=False)
        if fd is None:
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d unfinished folder(s) that a killed write of %s left: %s", len(removed), out,
                 ", ".join(p.name for p in removed))
    return removed


@contextlib.contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside OUT (checked by :func:`check_new_folder`) to fill in the ``with`` block, renamed to
    OUT when the block completes and removed if it fails: OUT is there whole or not at all. The folder is locked
    while this process fills it; those that killed writes of OUT left are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    fd = None
    while fd is None:  # a folder removed as stale between its creation and its lock is made again
        work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        fd = lock(work, wait=True)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(work, 0o777 & ~umask)  # a folder like any other, not mkdtemp's private one
    try:
        yield work
        if out.exists():
            out.rmdir()  # empty, checked before
        os.rename(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.close(fd)


def write_run_folder(out: Path, state: dict[str, Any], files: dict[str, bytes]) -> Path:
    """Write the run folder OUT (checked by :func:`check_new_folder`): the checkpoint, and ``files`` (name:
    content) beside it; returns the checkpoint's path."""
    with new_folder(out) as work:
        (work / "checkpoints").mkdir()
        torch.save(state, work / "checkpoints" / "last.ckpt")
        for name, content in files.items():
            (work / name).write_bytes(content)
    return out / "checkpoints" / "last.ckpt"
