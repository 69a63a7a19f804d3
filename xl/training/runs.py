"""A run folder read back: what resume, evaluation and generation take from the run they are given.

``python train.py`` writes one folder per run (Hydra's run folder, ``paths.output_dir``): ``.hydra/config.yaml``
(the composed config), ``.hydra/overrides.yaml`` (the command line), ``.hydra/hydra.yaml`` (among others the folder
the command ran in), ``checkpoints/`` (each checkpoint records the identity of its data,
:attr:`xl.data.SegmentDataModule.identity`), ``wandb_id`` (the W&B run that every resume continues), ``train.log``
and ``results.json``.

:func:`continue_run` turns ``python train.py ckpt_path=RUN [overrides]`` into the run's own command line plus the
new overrides, written into RUN; :func:`run_data` gives ``xl.evaluate`` and ``xl.generate`` the run's data
settings; :class:`TrainedRun` is the same for Python users (model and tokenizer of a run).
"""

from __future__ import annotations

import functools
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from xl.config.rules import ConfigError
from xl.model.memory_settings import EVALUATED
from xl.training.checkpoints.run_files import CONFIG, HYDRA, OVERRIDES, find_run_folder  # noqa: F401 (read from here too)

if TYPE_CHECKING:  # the checkpoint code imports torch, which train.py's start (continue_run) goes without
    from xl.model.transformer import TransformerXL
    from xl.training.checkpoints.checkpoint import Checkpoint

WANDB_ID = "wandb_id"
# Data settings that are paths: made absolute against the folder the run's command ran in.
PATH_KEYS = ("train", "val", "test", "tokenizer_file", "cache_dir")
# Overrides that choose the corpus or its tokens: a resume may not change them.
DATA_GROUPS = ("data", "experiment")
DATA_KEYS = ("train", "val", "test", "source", "tokenizer", "tokenizer_kwargs", "tokenizer_file", "doc_sep",
             "doc_sep_regex")
# What a resume may change (docs/runs.md): how long it trains, how it validates, logs, checkpoints, compiles and on
# which devices; the evaluation context of its validations and test. The rest (model, memory, optimizer and its
# schedule, data and its order, seed, precision) is the checkpoint's, or must match it.
RESUMABLE = ("trainer.max_steps", "trainer.max_epochs", "trainer.val_check_interval", "trainer.check_val_every_n_epoch",
             "trainer.limit_val_batches", "trainer.limit_test_batches", "trainer.num_sanity_val_steps",
             "trainer.log_every_n_steps", "trainer.gradient_clip_val", "trainer.gradient_clip_algorithm",
             "trainer.deterministic", "trainer.enable_model_summary", "trainer.accelerator", "trainer.devices",
             "trainer.num_nodes", "trainer.strategy", "trainer", *(f"memory.eval_{name}" for name in EVALUATED),
             "data.eval_tgt_len", "data.eval_batch_size", "data.cache_dir", "test", "run_name", "tags",
             "max_nonfinite_steps", "ckpt_path", "train")
NOT_CARRIED = ("hydra.run.dir", "ckpt_path", "overwrite")  # overrides of the run that its resume does not repeat
RESUMABLE_TREES = ("logger", "callbacks", "compile", "hydra", "paths")  # every key under these


def run_overrides(folder: Path) -> list[str]:
    """The run's command-line overrides, with its ``hydra.searchpath`` (the folders its config groups came from, a
    memory variant's config file outside ``conf/`` among them), which Hydra records apart from the others."""
    task = [str(o) for o in OmegaConf.load(folder / OVERRIDES)] if (folder / OVERRIDES).is_file() else []
    hydra = OmegaConf.select(OmegaConf.load(folder / HYDRA), "hydra.overrides.hydra") if (folder / HYDRA).is_file() \
        else None
    return [str(o) for o in hydra or [] if str(o).startswith("hydra.searchpath=")] + task


def run_cwd(folder: Path) -> Path | None:
    """The folder the run's command ran in (relative paths of its config are relative to it)."""
    if not (folder / HYDRA).is_file():
        return None
    cwd = OmegaConf.select(OmegaConf.load(folder / HYDRA), "hydra.runtime.cwd")
    return Path(cwd) if cwd else None


def run_data(folder: Path) -> dict[str, Any]:
    """The run's data group as it trained (interpolations resolved, relative paths made absolute); a curriculum's run:
    its last stage's, with the vocabulary every stage shares (:func:`xl.config.curriculum.final_data`)."""
    cfg = OmegaConf.load(folder / CONFIG)
    try:
        data = OmegaConf.to_container(cfg.data, resolve=True)
    except Exception as err:  # an interpolation that only the training command could resolve
        raise ConfigError(f"the data settings in {folder / CONFIG} cannot be read ({err}); name the data "
                          "(data=..., data.train=...)") from None
    if cfg.get("curriculum") is not None:
        from xl.config.curriculum import final_data

        data = final_data(OmegaConf.to_container(cfg.curriculum, resolve=True), data)
    cwd = run_cwd(folder)
    if cwd is not None:
        for key in PATH_KEYS:
            value = data.get(key)
            if isinstance(value, str):
                data[key] = str(cwd / Path(value).expanduser())
            elif isinstance(value, list):
                data[key] = [str(cwd / Path(v).expanduser()) for v in value]
    return data


def use_run_data(cfg: DictConfig, ckpt: str, setting: str = "ckpt") -> str | None:
    """With ``data=run`` (the default of evaluation and generation), put the run's data settings into ``cfg.data``
    with the keys set on the command line (``data.eval_tgt_len=64``) on top; returns the run folder, or None when
    the command names other data. A checkpoint outside its run folder has no recorded settings to read."""
    from xl.training.checkpoints.checkpoint import existing_path

    if not cfg.data.get("from_run"):
        return None
    folder = find_run_folder(existing_path(ckpt, setting))
    if folder is None:
        raise ConfigError(f"{setting}={ckpt} is not inside its run folder (no {CONFIG} beside it), so its data "
                          "settings are unknown; give the run folder, or name the data (data=..., data.train=...)")
    data = run_data(folder)
    data.update({k: v for k, v in cfg.data.items() if k != "from_run" and v is not None})
    with open_dict(cfg):
        cfg.data = OmegaConf.create(data)
    return str(folder)


def run_setting(folder: str | Path | None, key: str) -> Any:
    """One setting of the run's composed config (None when the folder or the key is absent)."""
    path = Path(folder) / CONFIG if folder else None
    return OmegaConf.select(OmegaConf.load(path), key) if path is not None and path.is_file() else None


def wandb_id(folder: str | Path) -> str:
    """The W&B run id of the run folder (``<folder>/wandb_id``), made once: every resume and requeue that writes
    into the folder continues that W&B run."""
    path = Path(folder) / WANDB_ID
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(4)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new + "\n")
    tmp.replace(path)
    return new


def requeued(cfg: DictConfig) -> bool:
    """Whether this is a SLURM job requeued (``SLURM_RESTART_COUNT`` above 0) to train on: it continues the run in
    its folder."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0 and bool(cfg.get("train", True))


def holds_run(folder: str | Path) -> bool:
    """Whether ``folder`` holds a run's checkpoints."""
    return any((Path(folder) / "checkpoints").glob("*.ckpt"))


def resumes(cfg: DictConfig, folder: str | Path) -> bool:
    """Whether ``ckpt_path`` names ``folder`` or a file in it."""
    ckpt = cfg.get("ckpt_path")
    if not ckpt:
        return False
    path = Path(str(ckpt)).expanduser().resolve()
    return Path(folder).resolve() in (path, *path.parents)


def recorded_wandb_id(folder: str | Path | None) -> str | None:
    """The run folder's W&B id if it has one (nothing is created)."""
    path = Path(folder) / WANDB_ID if folder else None
    return path.read_text().strip() if path is not None and path.is_file() else None


# ---- train.py ckpt_path=RUN ----------------------------------------------------------------------------------
def _parsed(overrides: list[str]) -> list[Any]:
    return OverridesParser.create().parse_overrides(overrides)


def resumable(key: str) -> bool:
    """Whether a resume may change the setting ``key`` (an override's key or group): :data:`RESUMABLE`."""
    return key in RESUMABLE or any(key == k or key.startswith((f"{k}.", f"{k}/")) for k in RESUMABLE_TREES)


def continue_run(argv: list[str]) -> list[str]:
    """``train.py``'s command line for ``ckpt_path=RUN``: the run's own overrides, then the new ones (a key given
    again takes the new value; ``overwrite``, which acted on the run's start, is left out), and ``hydra.run.dir=RUN``
    so that the resumed run writes into its folder and continues its W&B run. Other command lines (no ckpt_path, a
    checkpoint outside a run folder, ``-m``) are returned as they are. A new override of the corpus or its tokens,
    or of a setting a resume keeps (not in :data:`RESUMABLE`), is refused in one sentence. With ``train=false``
    (test the run's newest checkpoint) the run's settings are read but nothing is written into RUN: the test gets a
    folder of its own."""
    if any(a in ("-m", "--multirun") or a.startswith("-") for a in argv):
        return argv
    try:
        new = _parsed(argv)
    except Exception:  # Hydra reports a command line it cannot read itself
        return argv
    ckpt = next((o.value() for o in new if o.key_or_group == "ckpt_path" and not o.is_delete()), None)
    if not ckpt or not Path(str(ckpt)).expanduser().exists():
        return argv
    folder = find_run_folder(str(ckpt))
    if folder is None:
        return argv
    from xl.training.checkpoints.checkpoint import CheckpointError  # (imports torch: only for a resume)

    old = run_overrides(folder)
    testing = any(o.key_or_group == "train" and o.value() is False for o in new)
    for o in new:
        key = o.key_or_group
        if o.input_line in old:  # the run's own setting, given again, is fine
            continue
        if key in DATA_GROUPS or (key.startswith("data.") and key.split(".")[1] in DATA_KEYS):
            raise CheckpointError(
                f"ckpt_path={ckpt} continues a run with its own data, but {o.input_line} changes it; a resume "
                f"cannot change the corpus or its tokenizer: remove {key} from the command line (evaluate on other "
                "data with python -m xl.evaluate, or train a new run)")
        if not testing and not resumable(key):
            raise CheckpointError(
                f"ckpt_path={ckpt} continues the run with the checkpoint's model, optimizer, schedule and data order, "
                f"so {o.input_line} would be recorded but not used; remove {key} from the command line (a resume can "
                f"change the step count, validation, logging and checkpoint settings: docs/runs.md), or start a new "
                f"run from the run's weights with init_from={ckpt}")
    given = {(o.key_or_group, o.package) for o in new}
    kept = [line for line, o in zip(old, _parsed(old), strict=True)
            if (o.key_or_group, o.package) not in given and o.key_or_group not in NOT_CARRIED]
    if testing or ("hydra.run.dir", None) in given:
        return [*kept, *argv]
    return [*kept, *argv, f"hydra.run.dir='{folder}'"]


@dataclass
class TrainedRun:
    """A trained run for Python users: the checkpoint, its model, and the tokenizer it was trained with.

    >>> run = TrainedRun.open("outputs/2026-01-01/12-00-00")  # doctest: +SKIP
    >>> prompt = torch.tensor(run.tokenizer.encode("def main("), dtype=torch.long)[None]  # doctest: +SKIP
    >>> run.tokenizer.decode(generate(run.model(), prompt, 50)[0].numpy())  # doctest: +SKIP
    """

    checkpoint: Checkpoint
    folder: Path | None

    @classmethod
    def open(cls, path: str | Path, setting: str = "ckpt") -> TrainedRun:
        """A run folder (its newest complete checkpoint) or a checkpoint file."""
        from xl.training.checkpoints.checkpoint import Checkpoint

        checkpoint = Checkpoint.open(path, setting)
        return cls(checkpoint, find_run_folder(checkpoint.path))

    @property
    def data(self) -> dict[str, Any]:
        """The run's data settings (the data group it trained with)."""
        if self.folder is None:
            raise ConfigError(f"{self.checkpoint.path} is not inside its run folder (no {CONFIG} beside it), so "
                              "its data settings are unknown; open the run folder")
        return run_data(self.folder)

    def datamodule(self) -> Any:
        """The run's data module, its corpus tokenised (the token cache is reused when it exists)."""
        from xl.training.build import build_datamodule  # Lightning: only when the data is read

        cfg = OmegaConf.create({"data": self.data})
        datamodule = build_datamodule(cfg)
        self.checkpoint.check_tokenizer(datamodule.vocab_size, datamodule.tokenizer_fingerprint)
        return datamodule

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The fitted tokenizer the model was trained with (checked against the checkpoint's fingerprint)."""
        return self.datamodule().tokenizer

    def model(self, model_config: dict[str, Any] | None = None) -> TransformerXL:
        """The trained model in evaluation mode (``model_config``: see :meth:`Checkpoint.load_model`)."""
        return self.checkpoint.load_model(model_config=model_config)
