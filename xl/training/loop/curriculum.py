"""A curriculum that advances by itself (``curriculum=[...]``, :mod:`xl.config.curriculum`): one run, one run folder,
one W&B run, stage after stage.

:class:`CurriculumDataModule` holds one data module per stage, each the run's ``data`` with the stage's ``length``
(and ``tasks``), and serves the current stage's loaders; the Trainer reloads its loaders at every epoch
(``reload_dataloaders_every_n_epochs=1``), so a new stage's loaders take effect at the epoch after the validation
that began it. :class:`Curriculum`, a callback, decides after each validation: the stage ends when its budget of
optimizer steps is spent or its metric passes its threshold; the last stage's end ends the training. Each stage
starts from the weights, the optimizer state and the learning-rate schedule where the last one left them: the
schedule (warm-up, then cosine decay) runs once over ``trainer.max_steps``, whatever the stages' lengths.

Every stage's char or word vocabulary is fitted on the same samples, those of the longest stage's length over
every stage's tasks (``vocabulary`` of :class:`xl.data.babilong.data.BabilongDataModule`), so the stages share one
vocabulary; :meth:`CurriculumDataModule.prepare_data` checks that they do.

The stage, the step each stage began at and the current stage's loader position are the data module's state
(Lightning's ``LightningDataModule.state_dict``, saved in every checkpoint), and the loader Lightning is handed keeps
no state of its own: a checkpoint taken at the validation that ends a stage holds the next stage at its start, and a
resume from any checkpoint reads the batches the unbroken run reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L

from xl.config.curriculum import Stage, stages, vocabulary
from xl.data.errors import DataError

log = logging.getLogger(__name__)


class StageLoader:
    """The current stage's train loader as Lightning sees it: its batches and length, no state (the data module's
    state holds the position, so that a new stage's loader never receives the last stage's)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class CurriculumDataModule(L.LightningDataModule):
    """The data of a curriculum: ``modules[i]`` serves stage ``i`` (0-based here; the logs, ``results.json`` and
    error messages count from 1)."""

    def __init__(self, plan: list[Stage], modules: list[Any]) -> None:
        super().__init__()
        self.plan, self.modules = plan, modules
        self.index = 0
        self.starts = [0]  # the global step at which each stage so far began
        self.finished = False  # the last stage has ended
        self._pending: dict[str, Any] | None = None  # a checkpoint's loader position, for the stage's first loader

    @classmethod
    def from_config(cls, cfg: Any, make: Callable[..., Any]) -> CurriculumDataModule:
        """One data module per stage from ``make(**overrides)`` (the data group instantiated with them)."""
        plan = stages(cfg.curriculum)
        shared = vocabulary(cfg.curriculum, [str(t) for t in cfg.data.tasks])
        return cls(plan, [make(**stage.data, vocabulary=shared) for stage in plan])

    # ---- the stage --------------------------------------------------------------------------------------------
    @property
    def current(self) -> Any:
        return self.modules[self.index]

    @property
    def stage(self) -> Stage:
        return self.plan[self.index]

    def advance(self, step: int) -> None:
        """Begin the next stage at global step ``step``; its loaders are handed over at the next epoch."""
        self.index += 1
        self.starts.append(step)

    def summary(self) -> dict[str, Any]:
        """The stage for ``results.json``: counted from 1, the step each stage began at."""
        return {"stage": self.index + 1, "stages": len(self.plan), "stage_starts": list(self.starts),
                "stage_length": self.stage.data["length"]}

    def state_dict(self) -> dict[str, Any]:
        loader = self._pending if self._pending is not None else self.current.train_dataloader().state_dict()
        return {"stage": self.index, "starts": list(self.starts), "finished": self.finished, "loader": loader}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["stage"] >= len(self.plan):
            raise DataError(f"the checkpoint is at curriculum stage {state['stage'] + 1} and this run has "
                            f"{len(self.plan)} stages; resume with the run's curriculum")
        self.index, self.starts, self.finished = state["stage"], list(state["starts"]), state["finished"]
        self._pending = state["loader"]

    # ---- Lightning's hooks --------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        for module in self.modules:
            module.prepare_data()
        if len({module.tokenizer_fingerprint for module in self.modules}) > 1:
            raise DataError("the curriculum's stages were given different vocabularies; delete their token caches "
                            "(data.cache_dir) and run again")

    def setup(self, stage: str | None = None) -> None:
        for module in self.modules:
            module.trainer = self.trainer
        self.current.setup(stage)

    def train_dataloader(self) -> StageLoader:
        loader = self.current.train_dataloader()
        if self._pending is not None:
            loader.load_state_dict(self._pending)
            self._pending = None
        return StageLoader(loader)

    def val_dataloader(self) -> Any:
        return self.current.val_dataloader()

    def test_dataloader(self) -> Any:
        return self.current.test_dataloader()

    # ---- what the run reads of its data: the current stage's, the vocabulary every stage's ------------------------
    @property
    def identity(self) -> dict[str, str]:
        identities = [module.identity for module in self.modules]
        source = hashlib.sha256(json.dumps([i["source"] for i in identities]).encode()).hexdigest()[:16]
        lengths = " -> ".join(str(s.data["length"]) for s in self.plan)
        return {"source": f"curriculum-{source}", "tokenizer": identities[0]["tokenizer"],
                "corpus": f"a curriculum over lengths {lengths} ({identities[0]['corpus']} first)"}

    def __getattr__(self, name: str) -> Any:
        """Everything else (the vocabulary, the cache, the batch shape, what is scored) is the current stage's."""
        if name in ("cache", "tokenizer", "tokenizer_fingerprint", "vocab_size", "unit", "default_cutoffs",
                    "token_bytes", "unk_id", "scored", "batch_size", "tgt_len", "eval_batch_size", "eval_tgt_len",
                    "source"):
            return getattr(self.modules[self.__dict__["index"]], name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


class Curriculum(L.Callback):
    """Ends the current stage after a validation that passes its rule or follows its budget; logs ``train/stage``."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.datamodule.finished:  # resumed from the validation that ended the last stage
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.log("train/stage", float(trainer.datamodule.index + 1), on_step=True, on_epoch=False,
                      batch_size=batch[0].size(0))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        data = trainer.datamodule
        if trainer.sanity_checking or data.finished:
            return
        stage, steps = data.stage, trainer.global_step - data.starts[-1]
        value = trainer.callback_metrics.get(stage.metric)
        if stage.has_rule and value is None:
            log.warning("curriculum: %s has no value at step %d (no scored token in the validation); raise "
                        "trainer.limit_val_batches", stage.metric, trainer.global_step)
        passed = stage.has_rule and value is not None and stage.passed(float(value))
        if not passed and (stage.steps is None or steps < stage.steps):
            return
        why = f"{stage.metric}={float(value):.4g}" if passed else f"its {stage.steps} steps"
        if data.index + 1 == len(data.plan):
            data.finished = True
            trainer.should_stop = True
            log.info("curriculum: the last stage ended at step %d (%s); training ends", trainer.global_step, why)
            return
        data.advance(trainer.global_step)
        log.info("curriculum: stage %d of %d (length %s) begins at step %d (%s)", data.index + 1, len(data.plan),
                 data.stage.data["length"], trainer.global_step, why)
