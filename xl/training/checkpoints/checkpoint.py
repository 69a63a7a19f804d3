"""What a checkpoint holds beyond Lightning's own state, and reading one safely.

Lightning saves weights, optimizer, scheduler, loop counters and the train loader's position. We add
under ``checkpoint["xl"]`` what makes a resume exact: the model config, the identity of the data (what its token
cache is keyed by) and the tokenizer's fingerprint (so that another corpus, or another tokenizer of the same
vocabulary size, is noticed), and the training memory and the random-number
generators' states of every rank (gathered, since only rank 0 writes the file).
Checkpoints are read with ``weights_only=True``: no pickled code is ever executed.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xl.model import memory_settings
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.checkpoints.run_files import find_run_folder
from xl.training.checkpoints.torch_errors import load_failure

log = logging.getLogger(__name__)
XL_KEY = "xl"  # where this project's part of a checkpoint lives
# Fields that fix the shape of the weights: a checkpoint with other values cannot be loaded.
SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "d_model", "d_head", "d_inner", "pre_lnorm", "tie_weights",
                "cutoffs", "div_val", "tie_projs", "d_embed", "proj_all")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the setting to change."""


def describe_corpus(identity: dict[str, Any] | None) -> str:
    """A checkpoint's data identity (:attr:`Checkpoint.data_identity`) in words."""
    return identity.get("corpus", identity.get("source", "?")) if identity else "unknown data"


def checkpoint_folder(path: Path) -> Path:
    """Where a run folder keeps its checkpoints (``checkpoints/``, or the folder itself)."""
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def existing_path(path: str | Path, setting: str = "ckpt_path") -> Path:
    """``path`` (a checkpoint file or a run folder), refused in one sentence if it does not exist."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{setting}={path} does not exist; give a .ckpt file or a run folder")
    return p


def newest_checkpoint(folder: Path, setting: str = "ckpt_path") -> Checkpoint:
    """The checkpoint a run folder names: the complete one of the highest step (``last.ckpt`` on a tie). A file
    that cannot be read (a checkpoint that a kill, a full disk or another program cut short) is left out, in one
    line that says which one is used instead."""
    files = sorted(checkpoint_folder(folder).glob("*.ckpt"), key=lambda p: (p.name != "last.ckpt", p.name))
    run = find_run_folder(folder) is not None
    if not files and run:
        raise CheckpointError(f"{setting}={folder} is a run folder without checkpoints: its run stopped before the "
                              "first was written; train again, or give a .ckpt file or a run folder that has one")
    if not files:
        raise CheckpointError(f"{setting}={folder} is a folder without checkpoints; give a run folder or a .ckpt file")
    complete, broken = [], []
    for path in files:
        try:
            complete.append(Checkpoint.open(path, setting, beside=False))
        except CheckpointError as err:
            broken.append((path, err))
    if not complete:
        names = ", ".join(path.name for path, _ in broken[:3]) + (", …" if len(broken) > 3 else "")
        raise CheckpointError(f"{setting}={folder} holds no complete checkpoint ({names}: truncated or corrupt); "
                              "train again or give another checkpoint")
    newest = max(complete, key=lambda c: c.global_step or 0)  # the first of the highest step: last.ckpt first
    for path, _ in broken:
        log.warning("%s cannot be read, so it is left out: the newest complete checkpoint, %s (step %s), is used",
                    path, newest.path.name, newest.global_step)
    return newest


def read_checkpoint(path: Path, setting: str = "ckpt_path", beside: bool = True) -> dict[str, Any]:
    """Load on CPU without executing pickled code; a damaged file is one clear error, which names the newest
    complete checkpoint beside it, if any (``beside``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises many types for truncated/garbage files
        reason = load_failure(err)
        other = intact_beside(path) if beside else None
        if other is not None:
            raise CheckpointError(f"{setting}={path} cannot be read ({reason}); {other.path.name} beside it is "
                                  f"complete (step {other.global_step}): give {setting}={other.path}") from err
        raise CheckpointError(
            f"{setting}={path} cannot be read (truncated, corrupt or not a checkpoint): {reason}"
        ) from err


def intact_beside(path: Path) -> Checkpoint | None:
    """The complete checkpoint of the highest step in the folder of ``path``, other than ``path``; None if none."""
    found = []
    for other in sorted(path.parent.glob("*.ckpt")):
        if other.resolve() == path.resolve():
            continue
        try:
            found.append(Checkpoint.open(other, beside=False))
        except CheckpointError:
            continue
    return max(found, key=lambda c: c.global_step or 0, default=None)


@dataclass
class Checkpoint:
    """A checkpoint written by train.py, read safely: the one reader that training, evaluation and generation use.

    ``state`` is Lightning's whole dictionary; the fields are what this project adds under ``state["xl"]``.
    """

    path: Path
    state: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path, setting: str = "ckpt_path", beside: bool = True) -> Checkpoint:
        """Resolve (a file or a run folder: :func:`newest_checkpoint`), read without executing code, and check that
        train.py wrote it; a file that cannot be read is refused naming a complete checkpoint beside it (``beside``)."""
        resolved = existing_path(path, setting)
        if resolved.is_dir():
            return newest_checkpoint(resolved, setting)
        state = read_checkpoint(resolved, setting, beside)
        xl = state.get(XL_KEY)
        if not isinstance(xl, dict) or "model_config" not in xl:
            raise CheckpointError(f"{setting}={resolved} is not a checkpoint written by this project's train.py")
        return cls(resolved, state)

    @property
    def model_config(self) -> dict[str, Any]:
        return self.state[XL_KEY]["model_config"]

    @property
    def data_identity(self) -> dict[str, Any] | None:
        """The data the model was trained on (:attr:`xl.data.SegmentDataModule.identity`: the source with its document
        rule, the tokenizer's settings, the corpus in words); None in checkpoints written before it was recorded."""
        return self.state[XL_KEY].get("data")

    @property
    def train_memory(self) -> torch.Tensor | None:
        """Every rank's training memory, [world, n_layer, B, M, d], or None."""
        return self.state[XL_KEY].get("train_memory")

    @property
    def train_tgt_len(self) -> int | None:
        """The training segment length the module recorded (else the train loader's saved position); None if not
        recorded."""
        if self.state[XL_KEY].get("train_tgt_len") is not None:
            return self.state[XL_KEY]["train_tgt_len"]
        loaders = self.state.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader") or []
        return next((s["tgt_len"] for s in loaders if isinstance(s, dict) and "tgt_len" in s), None)

    @property
    def hyper_parameters(self) -> dict[str, Any]:
        return self.state.get("hyper_parameters", {})

    @property
    def global_step(self) -> int | None:
        return self.state.get("global_step")

    def model_weights(self) -> dict[str, torch.Tensor]:
        """The TransformerXL's own state dict (the Lightning module keeps it under ``model.``)."""
        prefix = "model."
        return {k[len(prefix):]: v for k, v in self.state["state_dict"].items() if k.startswith(prefix)}

    def check_tokenizer(self, vocab_size: int, fingerprint: str, setting: str = "ckpt") -> None:
        """Refuse data whose tokenizer is not the one the model was trained with: another vocabulary size, or the
        same size with other tokens (checkpoints that predate the fingerprint are checked on the size only)."""
        check_vocabulary(self.model_config["vocab_size"], vocab_size, self.path, setting)
        saved = self.state[XL_KEY].get("tokenizer")
        if saved is not None and saved != fingerprint:
            raise CheckpointError(
                f"{setting}={self.path} was trained with another tokenizer than this data gives (the same "
                f"{vocab_size} ids stand for other tokens); set data and data.tokenizer (and its file or settings) "
                "to what the model was trained on"
            )

    def check_weights(self, model: torch.nn.Module, setting: str = "ckpt",
                      saved: dict[str, torch.Tensor] | None = None, fresh: Iterable[str] = ()) -> None:
        """Refuse, before any work, weights that do not fit ``model`` (a TransformerXL): a tensor missing, one the
        model does not have, or one of another shape (a file edited by hand, or from another version of a module).
        The config checks catch a different shape setting; this catches everything else in one sentence.
        ``saved``: the weights to check (the checkpoint's by default); ``fresh``: the model's weights that may be
        missing (they keep their initial values)."""
        saved, wanted, fresh = (self.model_weights() if saved is None else saved), model.state_dict(), set(fresh)
        problems = [f"{k} is missing" for k in wanted if k not in saved and k not in fresh]
        problems += [f"{k} is not a weight of this model" for k in saved if k not in wanted]
        problems += [f"{k} has shape {list(saved[k].shape)} (this model: {list(v.shape)})"
                     for k, v in wanted.items() if k in saved and saved[k].shape != v.shape]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointError(f"{setting}={self.path} holds weights that do not fit this model: {problems[0]}"
                                  f"{more}; use a checkpoint this project's train.py wrote for these model options")

    def load_model(self, vocab_size: int | None = None, setting: str = "ckpt",
                   model_config: dict[str, Any] | None = None) -> TransformerXL:
        """The trained model in evaluation mode; ``vocab_size``: the tokenizer's, refused if it differs;
        ``model_config``: the checkpoint's with evaluation's values of its memory's evaluation settings (None: the
        checkpoint's own)."""
        if vocab_size is not None:
            check_vocabulary(self.model_config["vocab_size"], vocab_size, self.path, setting)
        model = TransformerXL(XLConfig.from_dict(model_config or self.model_config))
        self.check_weights(model, setting)
        model.load_state_dict(self.model_weights())
        return model.eval()


def check_compatible(saved: dict[str, Any], current: dict[str, Any], resuming: bool, path: Path) -> None:
    """Refuse a checkpoint whose weights do not fit the configured model, naming every mismatch."""
    checked = SHAPE_FIELDS + (("mem_len", "memory") if resuming else ())
    saved, current = ({**values, "memory": memory_settings.describe(memory_settings.variant(values.get("memory")))}
                      for values in (saved, current))
    diff = [f"{f}={saved.get(f)} (this run: {current.get(f)})" for f in checked if saved.get(f) != current.get(f)]
    if diff:
        what = "resumed" if resuming else "loaded"
        raise CheckpointError(
            f"ckpt_path={path} cannot be {what} with this config: the checkpoint has {', '.join(diff)}; "
            "set the model/memory options to the checkpoint's values"
        )


def check_vocabulary(saved_vocab: int, data_vocab: int, path: Path | str, setting: str = "ckpt") -> None:
    """A model read with another tokenizer than it was trained with would score or print nonsense."""
    if saved_vocab != data_vocab:
        raise CheckpointError(
            f"{setting}={path} has a vocabulary of {saved_vocab} but this data gives {data_vocab}; "
            "set data (and data.tokenizer) to what the model was trained on"
        )


def rng_state() -> dict[str, Any]:
    """Every generator that dropout or data code may draw from, in weights_only-loadable types."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def gather_rng_states(world_size: int) -> list[dict[str, Any]]:
    """Every rank's :func:`rng_state`, in rank order (every rank calls this; rank 0 writes them all)."""
    state = rng_state()
    if world_size == 1:
        return [state]
    states: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(states, state)
    return states


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
