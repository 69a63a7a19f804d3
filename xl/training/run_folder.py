"""A run folder made from a model that train.py did not train: a converted or a shared model.

``xl.evaluate``, ``xl.generate``, ``train.py init_from=…`` and :class:`xl.training.checkpoint.Checkpoint` read it like a
run of ours::

    OUT/checkpoints/last.ckpt   the model config, the weights, the tokenizer's fingerprint, where the model came from
    OUT/<tokenizer file>        the vocabulary the data settings name (data.tokenizer_file=OUT/vocab.json, say)

The checkpoint has no training state: ``converted_from`` in its record says so (``ckpt_path`` naming it is refused,
``init_from`` starts a new run from it). OUT is written in a temporary folder beside it and renamed into place when
complete, so it is there whole or not at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from xl.training.checkpoint import XL_KEY


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
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise RunFolderError(f"{setting}={out} exists and is not empty; remove it or give another folder")
    return path


def run_state(values: dict[str, Any], weights: dict[str, torch.Tensor], unit: str, tokenizer_fingerprint: str,
              evaluation: dict[str, Any], converted_from: dict[str, Any], **record: Any) -> dict[str, Any]:
    """What train.py's checkpoints hold that evaluation, generation and init_from read: the weights under the
    Lightning module's ``model.`` prefix, the evaluation context (``mem_len``, ``clamp_len``, ``same_length``,
    None where it is the model's own, and optionally ``doc_boundaries``) as the evaluation defaults, and this
    project's record (model config, tokenizer fingerprint, provenance, and ``record``'s further entries)."""
    context = {f"eval_{k}": evaluation.get(k) for k in ("mem_len", "clamp_len", "same_length")}
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


@contextlib.contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside OUT (checked by :func:`check_new_folder`) to fill in the ``with`` block, renamed to
    OUT when the block completes and removed if it fails: OUT is there whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
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


def write_run_folder(out: Path, state: dict[str, Any], files: dict[str, bytes]) -> Path:
    """Write the run folder OUT (checked by :func:`check_new_folder`): the checkpoint, and ``files`` (name:
    content) beside it; returns the checkpoint's path."""
    with new_folder(out) as work:
        (work / "checkpoints").mkdir()
        torch.save(state, work / "checkpoints" / "last.ckpt")
        for name, content in files.items():
            (work / name).write_bytes(content)
    return out / "checkpoints" / "last.ckpt"
