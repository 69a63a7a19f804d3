"""A resume, checked in one place before any long work: ``python train.py ckpt_path=RUN`` (or a requeued job).

:meth:`Resume.open` reads the checkpoint once (for a run folder, its newest complete checkpoint:
:func:`xl.training.checkpoints.checkpoint.newest_checkpoint`); that same state serves every check here,
:func:`xl.training.build.check_checkpoint` (tokenizer, model shape, memory, weights, batch size) and Lightning's own
restore (:class:`xl.training.checkpoints.checkpoint_io.AtomicCheckpointIO` hands it over instead of reading the file
again). What only a running fit can check stays where Lightning hands the state over: the process count
(``XLLitModule.on_load_checkpoint``) and the data position (the train loader's ``load_state_dict``). The command line of
a run folder is checked before Hydra writes into the folder (:func:`xl.training.runs.continue_run`: which settings a
resume may change).

A resume continues the checkpoint's optimizer, its schedule and its random states, so an optimizer setting other
than the checkpoint's would be recorded but not used: it is refused, as another corpus is. A run whose every step
is trained but whose test did not finish (stopped during the test) is finished by testing it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from xl.training.checkpoints.checkpoint import XL_KEY, Checkpoint, CheckpointError, checkpoint_folder, describe_corpus
from xl.training.checkpoints.checkpoint_io import remove_partial

log = logging.getLogger(__name__)


def plain(value: Any) -> Any:
    value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return list(value) if isinstance(value, (list, tuple)) else value


def shown(value: Any) -> Any:
    """A setting as a command line would give it (1e+10, not 10000000000.0)."""
    return f"{value:g}" if isinstance(value, float) else value


def tested(cfg: DictConfig) -> bool:
    """Whether the run's results.json holds test metrics (the run's test finished)."""
    summary = OmegaConf.select(cfg, "callbacks.job_summary.path")
    path = Path(summary) if summary else Path(cfg.paths.output_dir) / "results.json"
    try:
        return any(key.startswith("test/") for key in json.loads(path.read_text()))
    except (OSError, ValueError):
        return False


@dataclass
class Resume:
    """The checkpoint a fit continues from, read once; ``finished``: every step is trained, only the test is left."""

    checkpoint: Checkpoint
    finished: bool = False

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @classmethod
    def open(cls, cfg: DictConfig) -> Resume | None:
        """The resume ``cfg`` asks for (``ckpt_path`` with ``train=true``), or None; refused in one sentence when it
        cannot continue: a converted model, another optimizer setting, nothing left to train."""
        if not cfg.get("ckpt_path") or not cfg.get("train", True):
            return None
        checkpoint = Checkpoint.open(cfg.ckpt_path)
        source = checkpoint.state[XL_KEY].get("converted_from")
        if source:
            raise CheckpointError(f"ckpt_path={cfg.ckpt_path} is a converted model ({source['source']}) with no "
                                  f"training state to continue; start a new run from it with init_from={cfg.ckpt_path}")
        remove_partial(checkpoint_folder(checkpoint.path.parent))
        resume = cls(checkpoint)
        resume.check_optimizer(cfg)
        resume.finished = resume.check_steps(cfg)
        return resume

    def check_optimizer(self, cfg: DictConfig) -> None:
        saved = self.checkpoint.hyper_parameters.get("optim") or {}
        current = plain(cfg.optim) if cfg.get("optim") is not None else {}
        for key, value in current.items():
            if key in saved and plain(saved[key]) != plain(value):
                raise CheckpointError(
                    f"ckpt_path={cfg.ckpt_path} continues its optimizer and learning-rate schedule, trained with "
                    f"optim.{key}={shown(plain(saved[key]))}, so optim.{key}={shown(plain(value))} would not be used; "
                    f"remove it, or start a new run from these weights with init_from={cfg.ckpt_path}")

    def check_steps(self, cfg: DictConfig) -> bool:
        """Whether the training is complete (and the test is left); refuse a resume with nothing left to do."""
        step, max_steps = self.checkpoint.global_step or 0, cfg.trainer.max_steps
        if not 0 <= max_steps <= step:
            return False
        if cfg.get("test", True) and not tested(cfg):
            log.info("ckpt_path=%s is at step %d of trainer.max_steps=%d: the training is complete, its test is not; "
                     "testing it", cfg.ckpt_path, step, max_steps)
            return True
        raise CheckpointError(
            f"ckpt_path={cfg.ckpt_path} is at step {step} and trainer.max_steps={max_steps} counts all the run's "
            f"steps, so nothing is left to train; set trainer.max_steps above {step} to train on")

    def check_data(self, cfg: DictConfig, current: dict[str, Any] | None) -> None:
        """A resume continues the checkpoint's corpus: refuse another one, before the corpus is read."""
        saved = self.checkpoint.data_identity
        if saved is None or current is None:
            return
        if (saved["source"], saved["tokenizer"]) == (current["source"], current["tokenizer"]):
            return
        if describe_corpus(saved) == describe_corpus(current) and saved["tokenizer"] == current["tokenizer"]:
            raise CheckpointError(
                f"ckpt_path={cfg.ckpt_path} was trained on {describe_corpus(saved)}, whose files have changed "
                "since (size or modification time): a resume reads the corpus it was trained on; restore the "
                "files, or train a new run on them")
        raise CheckpointError(
            f"ckpt_path={cfg.ckpt_path} was trained on {describe_corpus(saved)} but this run reads "
            f"{describe_corpus(current)}; resume with the run's data settings (data, data.train/val/test, "
            "data.tokenizer), or give the run folder so that they are read from it")

    def best_path(self) -> Path:
        """The checkpoint the run's test scores: the best one its ModelCheckpoint recorded, if complete."""
        for state in (self.checkpoint.state.get("callbacks") or {}).values():
            best = state.get("best_model_path") if isinstance(state, dict) else None
            if best and Path(best).is_file():
                try:
                    return Checkpoint.open(best).path
                except CheckpointError:
                    break
        return self.checkpoint.path
