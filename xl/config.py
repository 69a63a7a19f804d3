"""The config schema, and the one way the entry points compose a config and report a bad one.

Every group of ``conf/`` is checked against a dataclass below, registered with Hydra's ConfigStore as
``<group>/schema`` (``conf/<group>/*.yaml`` name it first in their defaults list), and the two primary
configs against ``train_schema`` and ``evaluate_schema``. A schema gives every key its type and default, so
an option file states only what differs, and a misspelt key or a value of the wrong type stops composition;
:func:`describe_error` turns Hydra's report of it into one sentence naming the full key and the type expected.
Ranges and relations between keys, which a type cannot express, are checked in ``xl/build.py``.

Importing ``xl`` registers the schemas, so composing ``conf/`` by hand (``hydra.compose``) finds them too.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import hydra
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException, InstantiationException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from xl.model import XLConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
OUTPUT_DIR = "${hydra:runtime.output_dir}"


class ConfigError(ValueError):
    """A setting the user can fix; the message names it."""


# ---- the schema ---------------------------------------------------------------------------------------------
# Defaults of the model and memory groups are XLConfig's (config S of the benchmarks).


@dataclass
class ModelSchema:
    """``model``: the network's shape (XLConfig's fields other than the vocabulary and the memory context)."""

    n_layer: int = XLConfig.n_layer
    n_head: int = XLConfig.n_head
    d_model: int = XLConfig.d_model  # even: sinusoidal positions take pairs
    d_head: int = XLConfig.d_head
    d_inner: int = XLConfig.d_inner  # feed-forward width
    dropout: float = XLConfig.dropout
    dropatt: float = XLConfig.dropatt  # attention-probability dropout
    pre_lnorm: bool = XLConfig.pre_lnorm
    tie_weights: bool = XLConfig.tie_weights
    # Adaptive input/softmax cluster boundaries; []: one softmax; null: fitted to the vocabulary (one softmax up to
    # 32,768 ids or for byte/char data; above, a head of the 8,192 most frequent ids and clusters 4x wider)
    cutoffs: list[int] | None = None
    div_val: int = XLConfig.div_val  # cluster i is d_model // div_val**i wide
    tie_projs: bool = XLConfig.tie_projs


@dataclass
class MemorySchema:
    """``memory``: the context of training, and of evaluation (``eval_*``: null takes the training value)."""

    mem_len: int = XLConfig.mem_len
    eval_mem_len: int | None = None
    clamp_len: int = XLConfig.clamp_len  # -1: off; else distances beyond it share one embedding
    eval_clamp_len: int | None = None
    same_length: bool = XLConfig.same_length  # every query attends over exactly mem_len keys
    eval_same_length: bool | None = None
    mem_dtype: str = XLConfig.mem_dtype  # float32 (never rounded), bfloat16 or float16 (half the bytes)
    doc_boundaries: str = "reset"  # reset: a token sees only its own document; ignore: one endless text per row
    grad_segments: int = 1  # k: gradients cross segments inside windows of k (1: Transformer-XL's stop-gradient)
    # Compressive memory (Rae et al., 2019): states evicted from the memory are compressed cmem_rate to 1 into
    # cmem_len more slots per layer, attended before the memory. 0: none.
    cmem_len: int = XLConfig.cmem_len
    cmem_rate: int = XLConfig.cmem_rate  # c: evicted states per compressed slot
    cmem_fn: str = XLConfig.cmem_fn  # mean (pooling, no weights) | conv (learned, attention-reconstruction loss)


@dataclass
class DataSchema:
    """``data``: what every data option shares (``xl.data.SegmentDataModule``'s arguments)."""

    _target_: str = "xl.data.SegmentDataModule"
    tokenizer: str = "byte"  # byte | char | word | bpe | unigram
    # word: {min_freq: 1, max_size: null}; bpe/unigram: {vocab_size: 4096, special_tokens: [], pre_tokenizer: gpt2}
    # (Any, not dict | None: OmegaConf cannot merge a mapping into a node so typed that holds null)
    tokenizer_kwargs: Any = None
    batch_size: int = 8  # streams per device
    eval_batch_size: int | None = None  # null: batch_size
    tgt_len: int = 128  # tokens per segment
    eval_tgt_len: int | None = None  # null: tgt_len
    cache_dir: str | None = None  # token cache; null: $XL_CACHE_DIR, else ~/.cache/xl
    tokenizer_file: str | None = None  # bpe/unigram: a byte-level tokenizer.json to read instead of fitting one
    doc_sep: str | None = None  # a line that begins a new document (kept in the text), beyond the source's own
    doc_sep_regex: bool = False  # true: doc_sep is a regular expression that the whole line must match


@dataclass
class SourceDataSchema(DataSchema):
    """``data/schema``: a corpus given by a source object (stdlib, hub benchmarks, the probe's recall task)."""

    source: Any = MISSING


@dataclass
class FilesDataSchema(DataSchema):
    """``data/files_schema``: local text files, one path or a list of paths per split (each file a document)."""

    _target_: str = "xl.data.SegmentDataModule.from_files"
    train: Any = MISSING
    val: Any = MISSING
    test: Any = MISSING


@dataclass
class OptimSchema:
    """``optim``: AdamW, linear warm-up then cosine decay to ``min_lr_ratio × lr`` (xl.lit.OptimConfig)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.0


@dataclass
class TrainerSchema:
    """``trainer``: ``lightning.pytorch.Trainer``'s arguments that the configs set; ``+trainer.X=...`` adds others."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 1  # a count, a list of indices, or "auto"
    num_nodes: int = 1
    precision: str = "auto"  # set by the precision group
    strategy: Any = "auto"
    max_steps: int = 1500
    max_epochs: int | None = -1
    limit_train_batches: int | float = 1.0  # a float: a fraction; an int: a count of segments
    val_check_interval: int | float = 500
    check_val_every_n_epoch: int | None = None
    limit_val_batches: int | float = 100
    limit_test_batches: int | float = 1.0
    gradient_clip_val: float | None = 0.25
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    num_sanity_val_steps: int = 2
    deterministic: bool | str = False  # or "warn"
    default_root_dir: str | None = "${paths.output_dir}"


@dataclass
class ModelCheckpointSchema:
    _target_: str = "lightning.pytorch.callbacks.ModelCheckpoint"
    dirpath: str = "${paths.output_dir}/checkpoints"
    filename: str = "step{step:07d}"
    monitor: str | None = "val/loss"
    mode: str = "min"
    save_top_k: int = 1
    save_last: bool | str | None = True
    every_n_train_steps: int | None = None  # also save every N optimizer steps (null: at each validation)
    auto_insert_metric_name: bool = False


@dataclass
class LearningRateMonitorSchema:
    _target_: str = "lightning.pytorch.callbacks.LearningRateMonitor"
    logging_interval: str | None = "step"


@dataclass
class ThroughputMonitorSchema:
    _target_: str = "lightning.pytorch.callbacks.ThroughputMonitor"
    batch_size_fn: Any = field(default_factory=lambda: {"_target_": "xl.lit.batch_rows", "_partial_": True})
    length_fn: Any = field(default_factory=lambda: {"_target_": "xl.lit.batch_tokens", "_partial_": True})


@dataclass
class ProgressBarSchema:
    _target_: str = "lightning.pytorch.callbacks.TQDMProgressBar"
    refresh_rate: int = 10


@dataclass
class PreemptionSchema:
    _target_: str = "xl.callbacks.PreemptionCheckpoint"
    dirpath: str = "${paths.output_dir}/checkpoints"


@dataclass
class JobSummarySchema:
    _target_: str = "xl.callbacks.JobSummary"
    path: str = "${paths.output_dir}/results.json"


# The callbacks group is a mapping (so that ``~callbacks.X`` removes one); each known entry has its schema.
CALLBACKS = {"model_checkpoint": ModelCheckpointSchema, "lr_monitor": LearningRateMonitorSchema,
             "throughput": ThroughputMonitorSchema, "progress_bar": ProgressBarSchema,
             "preemption": PreemptionSchema, "job_summary": JobSummarySchema}


@dataclass
class WandbSchema:
    _target_: str = "lightning.pytorch.loggers.WandbLogger"
    project: str = "xl"
    save_dir: str = "${paths.output_dir}"
    offline: bool = True
    name: str | None = None  # null: run_name, else the overrides
    group: str | None = None  # null: the sweep folder under -m
    id: str | None = None  # null: the run folder's own (its file wandb_id), so that a resume continues the W&B run
    tags: list[str] = "${tags}"  # type: ignore[assignment]
    log_model: bool | str = False


@dataclass
class CSVLoggerSchema:
    _target_: str = "lightning.pytorch.loggers.CSVLogger"
    save_dir: str = "${paths.output_dir}"
    name: str = "csv"
    version: int | str | None = ""


@dataclass
class TensorBoardSchema:
    _target_: str = "lightning.pytorch.loggers.TensorBoardLogger"
    save_dir: str = "${paths.output_dir}"
    name: str = "tensorboard"
    version: int | str | None = ""


LOGGERS = {"wandb": WandbSchema, "csv": CSVLoggerSchema, "tensorboard": TensorBoardSchema}


@dataclass
class CompileSchema:
    """``compile``: ``torch.compile`` the model in place (checkpoint keys unchanged)."""

    enabled: bool = False
    mode: str | None = None  # null (default), reduce-overhead, max-autotune, max-autotune-no-cudagraphs
    backend: str = "inductor"


@dataclass
class PathsSchema:
    output_dir: str = OUTPUT_DIR  # everything a run writes; Hydra picks the folder


@dataclass
class TrainSchema:
    """``conf/config.yaml`` (``python train.py``): the groups, and the run's own keys."""

    model: ModelSchema = field(default_factory=ModelSchema)
    memory: MemorySchema = field(default_factory=MemorySchema)
    data: Any = MISSING
    optim: OptimSchema = field(default_factory=OptimSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    logger: Any = None
    callbacks: Any = None
    paths: PathsSchema = field(default_factory=PathsSchema)
    compile: CompileSchema = field(default_factory=CompileSchema)
    seed: int = 1234
    test: bool = True  # evaluate the best checkpoint on the test split after fitting
    train: bool = True
    ckpt_path: str | None = None  # resume (or, with train=false, evaluate) this checkpoint or run folder
    max_nonfinite_steps: int = 5  # skipped non-finite steps in a row that stop the run
    run_name: str | None = None  # null: the command-line overrides (or "default")
    tags: list[str] = field(default_factory=list)


@dataclass
class EvalContextSchema:
    """``memory`` of ``python -m xl.evaluate``: each of mem_len, clamp_len, same_length is memory.eval_X if set,
    else memory.X if set, else the checkpoint's own evaluation value."""

    mem_len: int | None = None
    eval_mem_len: int | None = None
    clamp_len: int | None = None
    eval_clamp_len: int | None = None
    same_length: bool | None = None
    eval_same_length: bool | None = None
    doc_boundaries: str | None = None  # reset | ignore; null: the checkpoint's


@dataclass
class EvaluateSchema:
    """``conf/evaluate.yaml`` (``python -m xl.evaluate``)."""

    ckpt: str = MISSING  # a .ckpt file, or a run folder (its checkpoints/last.ckpt)
    data: Any = MISSING
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    logger: Any = None
    memory: EvalContextSchema = field(default_factory=EvalContextSchema)
    paths: PathsSchema = field(default_factory=PathsSchema)
    warmup: int = 0  # segments of every stream fed to fill the memory but not scored
    vanilla: bool = False  # no cache: every token predicted by a fresh forward over attn_len tokens (slow)
    attn_len: int | None = None  # vanilla window; null: mem_len + tgt_len
    splits: list[str] = field(default_factory=lambda: ["val", "test"])
    per_document: bool = False  # also per document: count, mean, and by position in the document
    seed: int = 1234
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)


SCHEMAS: dict[str, Any] = {
    "model/schema": ModelSchema,
    "memory/schema": MemorySchema,
    "data/schema": SourceDataSchema,
    "data/files_schema": FilesDataSchema,
    "optim/schema": OptimSchema,
    "trainer/schema": TrainerSchema,
    "callbacks/schema": CALLBACKS,
    **{f"logger/{name}_schema": {name: schema} for name, schema in LOGGERS.items()},
    "train_schema": TrainSchema,
    "evaluate_schema": EvaluateSchema,
}


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    for path, node in SCHEMAS.items():
        group, _, name = path.rpartition("/")
        if isinstance(node, dict):
            node = {key: OmegaConf.structured(schema) for key, schema in node.items()}
        store.store(name=name, node=node, group=group or None, provider="xl")


register()

# ---- one sentence for a bad config ----------------------------------------------------------------------------


@functools.cache
def _schema_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for node in SCHEMAS.values():
        for schema in node.values() if isinstance(node, dict) else [node]:
            found[schema.__name__] = schema
    for schema in (DataSchema, CompileSchema, PathsSchema, EvalContextSchema):
        found[schema.__name__] = schema
    return found


TYPE_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
              str: ("a string", "strings")}


def describe_type(hint: Any) -> str:
    """``bool | None`` -> "true, false or null": what a user may write for a key of this type."""
    origin, args = get_origin(hint), get_args(hint)
    if origin not in (Union, types.UnionType):
        if hint in TYPE_WORDS:
            return TYPE_WORDS[hint][0]
        if origin is list:
            return f"a list of {TYPE_WORDS[args[0]][1]}" if args and args[0] in TYPE_WORDS else "a list"
        return "a mapping" if origin is dict else "a value"
    present = [a for a in args if a is not type(None)]
    choices = ["a number"] if set(present) == {int, float} else [
        word for a in present for word in (["true", "false"] if a is bool else [describe_type(a)])]
    choices += ["null"] if len(present) < len(args) else []
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def _expected(object_type: str | None, key: str) -> str | None:
    schema = _schema_classes().get(object_type or "")
    name = key.rsplit(".", 1)[-1].split("[")[0]
    if schema is None or name not in {f.name for f in fields(schema)}:
        return None
    return describe_type(get_type_hints(schema)[name])


def _settings(object_type: str | None) -> list[str]:
    schema = _schema_classes().get(object_type or "")
    return [f.name for f in fields(schema) if not f.name.startswith("_")] if schema else []


def describe_error(err: BaseException) -> str:
    """One sentence for a Hydra/OmegaConf composition error (the full key, and the type or the options)."""
    text = "\n".join(str(e) for e in (err, err.__cause__) if e is not None)
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if ambiguous:
        key, value = ambiguous.groups()
        return (f"{key}={value} gives several values: add -m to run one job for each, "
                f"or write {key}=[{value}] for a list")
    if isinstance(err, OverrideParseException):
        return f"the command line cannot be read ({text.splitlines()[0]}); see Hydra's override grammar"
    found = re.search(r"Could not find '([^']+)'", text)
    if found:  # a group option that does not exist
        group, _, option = found.group(1).rpartition("/")
        listed = re.search(r"Available options in '[^']*':\n((?:\t.*\n?)*)", text)
        names = [n.strip() for n in listed.group(1).splitlines()] if listed else []
        choices = [n for n in names if n and not n.endswith("schema")]
        return f"{group}={option} is not an option of the {group} group" + (
            f"; choose one of {', '.join(choices)}" if choices else "")
    key_match = re.search(r"full_key: (\S+)", text)
    object_type = re.search(r"object_type=(\w+)", text)
    source = re.search(r"In '([^']+)'", text)
    where = f" (in conf/{source.group(1)}.yaml)" if source else ""
    obj = object_type.group(1) if object_type else None
    key = key_match.group(1) if key_match else ""
    if key and re.search(r"not in '|is not in struct", text):
        parent, _, name = key.rpartition(".")
        options = _settings(obj)
        close = difflib.get_close_matches(name, options, n=1)
        hint = (f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else
                f"; {parent or 'the top level'} has {', '.join(options)}" if options else "")
        return f"{key} is not a setting{where}{hint}"
    if key and "does not support deletion" in text:
        return f"{key} cannot be removed; set it to another value"
    if key and "ValidationError" in text + type(err.__cause__).__name__:
        value = re.search(r"Value '(.*)' (?:of type|is not)", text)
        given = re.search(r"override ([^=\s]+)=(.*)", text)
        given_here = given.group(2) if given and given.group(1) == key else None
        got = "null" if "is not Optional" in text else value.group(1) if value else given_here
        item = re.fullmatch(r"(.+)\[(\d+)\]", key)
        listed = re.search(r"reference_type=(?:Optional\[)?List\[(\w+)\]", text)
        if item and listed:  # one element of a typed list
            plural = {t.__name__: words[1] for t, words in TYPE_WORDS.items()}
            return (f"{item.group(1)} must be a list of {plural.get(listed.group(1), listed.group(1))}, "
                    f"got {got!r} at position {item.group(2)}{where}")
        expected = _expected(obj, key) or "of another type"
        return f"{key} must be {expected}" + (f", got {got!r}" if got is not None else "") + where
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return first.rstrip(".")


def check_complete(cfg: DictConfig) -> None:
    """Refuse a config with an interpolation that cannot be resolved, or required keys left unset (``???``)."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "a setting"
        raise ConfigError(f"{key} cannot be resolved ({str(err).splitlines()[0]})") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        names = ", ".join(missing)
        raise ConfigError(f"{names} {'has' if len(missing) == 1 else 'have'} no value; "
                          f"set {' '.join(f'{k}=...' for k in missing)} on the command line")


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """``conf/<config_name>.yaml`` with ``overrides``, or :class:`ConfigError` in one sentence."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name, overrides=list(overrides))
    except (CompactHydraException, OmegaConfBaseException) as err:
        raise ConfigError(describe_error(err)) from None


# ---- entry points -----------------------------------------------------------------------------------------


def user_errors() -> tuple[type[Exception], ...]:
    """The errors a user fixes by changing a setting or a file: reported in one sentence, no traceback."""
    from xl.checkpoint import CheckpointError
    from xl.data import DataError

    return ConfigError, DataError, CheckpointError


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn a :func:`user_errors` exception into ``error: <sentence>`` on stderr and exit status 1."""
    try:
        yield
    except user_errors() as err:
        sys.exit(f"error: {err}")


T = TypeVar("T")


def entry_point(config_name: str) -> Callable[[Callable[[DictConfig], T]], Callable[[], T]]:
    """Decorator for a command's ``main(cfg)``: Hydra composes ``conf/<config_name>.yaml`` with the command line
    (``-m`` sweeps included), and any bad setting ends the command with ``error: <one sentence>``.

    Hydra prints composition errors over several lines; with ``HYDRA_FULL_ERROR`` set it raises them instead,
    so the command sets it while Hydra runs and reports them itself (unless the user had set it).
    """

    def decorate(task: Callable[[DictConfig], T]) -> Callable[[], T]:
        @functools.wraps(task)
        def job(cfg: DictConfig) -> T:
            with exit_on_user_error():
                check_complete(cfg)
                try:
                    return task(cfg)
                except Exception as err:
                    err.raised_by_job = True  # a failure of the command, not of composition: keep its traceback
                    raise

        hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(job)

        @functools.wraps(task)
        def main() -> T:
            if os.environ.get("HYDRA_FULL_ERROR"):
                return hydra_main()
            os.environ["HYDRA_FULL_ERROR"] = "1"
            try:
                return hydra_main()
            except (CompactHydraException, OmegaConfBaseException) as err:
                if isinstance(err, InstantiationException) or getattr(err, "raised_by_job", False):
                    raise
                sys.exit(f"error: {describe_error(err)}")
            finally:
                del os.environ["HYDRA_FULL_ERROR"]

        return main

    return decorate

