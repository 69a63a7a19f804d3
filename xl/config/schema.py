"""The config schema: every key of ``conf/`` with its type, default, allowed values and meaning.

Every group of ``conf/`` is checked against a dataclass below (those of the callbacks and loggers:
:mod:`xl.config.callback_schema`), registered with Hydra's ConfigStore as ``<group>_schema`` (``conf/<group>/*.yaml``
name it first in their defaults list, as ``/<group>_schema@_here_``), and the three primary configs against
``train_schema``, ``evaluate_schema`` and ``generate_schema``. The type stops a misspelt key or a value of the wrong
type at composition; the bound beside it (:func:`xl.settings.bounds.setting`) is checked by :mod:`xl.config.rules`
before any work. :mod:`xl.config.reference` prints the tables of ``docs/configuration.md`` from these fields.

Importing ``xl`` registers the schemas, so composing ``conf/`` by hand (``hydra.compose``) finds them too.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from xl.config.callback_schema import CALLBACKS, LOGGERS
from xl.data.babilong.lengths import WORDS as LENGTH_WORDS
from xl.data.babilong.lengths import is_length
from xl.data.babilong.tasks import MOST_QUESTIONS, is_most_questions, is_train_support
from xl.data.babilong.tasks import QUESTIONS as TRAIN_QUESTIONS
from xl.data.babilong.tasks import TASKS as BABILONG_TASKS
from xl.model.config import XLConfig
from xl.model.memory_settings import EVALUATED, MemorySettings, overrides
from xl.settings.bounds import (
    Bound,
    above,
    at_least,
    between,
    check_fields,
    copied,
    is_int,
    is_number,
    one_of,
    optional,
    setting,
)

OUTPUT_DIR = "${hydra:runtime.output_dir}"
TOKENIZERS = ("byte", "char", "word", "bpe", "unigram")  # xl.data.tokenizers.TOKENIZERS (a test keeps them equal)
# xl.device.footprint's, likewise
PRECISIONS = ("64-true", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
STREAM = "stream"  # xl.data.babilong.generated.STREAM, likewise
BATCHES = Bound("a count >= 0 or a fraction in [0, 1]",
                lambda v: (is_int(v) and v >= 0) or (isinstance(v, float) and 0.0 <= v <= 1.0))


def _devices(v: Any) -> bool:
    """Lightning's trainer.devices: a count, -1 (all), "auto", indices "0,1", or a list of indices."""
    if isinstance(v, str):
        return v == "auto" or bool(re.fullmatch(r"\d+(,\d+)*,?", v))
    if OmegaConf.is_list(v):
        return len(v) > 0 and all(is_int(i) and i >= 0 for i in v)
    return v == -1 or (is_int(v) and v >= 1)


POSITIVE = at_least(1)
COUNT = at_least(0)
POSITIVE_OR_NULL = Bound("at least 1", lambda v: v is None or (is_int(v) and v >= 1))
STORY_QUESTIONS = Bound(f"a whole number from 1 to {MOST_QUESTIONS}", is_most_questions)


# ---- model and memory: the defaults are XLConfig's (config S of the benchmarks) -----------------------------------
#: The shape fields of :class:`XLConfig` that the ``model`` group sets (the vocabulary is fitted to the data, the
#: memory's context is the ``memory`` group's), in XLConfig's order, and the schema's types where a YAML value needs
#: another one than the dataclass's (lists for tuples; null cutoffs: fitted to the vocabulary).
MODEL_FIELDS = ("n_layer", "n_head", "d_model", "d_head", "d_inner", "dropout", "dropatt", "init_std", "pre_lnorm",
                "tie_weights", "cutoffs", "div_val", "tie_projs", "d_embed", "proj_all")
CUTOFFS = setting(None, help="adaptive input/softmax cluster boundaries, strictly increasing below the vocabulary; "
                             "[] one softmax; null fitted to the vocabulary (one softmax up to 32,768 ids or for "
                             "byte/char data; above, a head of the 8,192 most frequent ids and clusters 4x wider)")


def _model_schema() -> type:
    """``model``: the network's shape (XLConfig's fields other than the vocabulary and the memory context), each field
    XLConfig's own (default, bound, help)."""
    hints = typing.get_type_hints(XLConfig)
    own = {f.name: f for f in dataclasses.fields(XLConfig)}
    yaml_types = {"cutoffs": list[int] | None, "tie_projs": Any}
    specs = [(name, yaml_types.get(name, hints[name]), CUTOFFS if name == "cutoffs" else copied(own[name]))
             for name in MODEL_FIELDS]
    cls = dataclasses.make_dataclass("ModelSchema", specs)
    cls.__doc__, cls.__module__ = _model_schema.__doc__.split(", each field")[0] + ".", __name__
    return cls


ModelSchema = _model_schema()


# ---- data ---------------------------------------------------------------------------------------------------------
@dataclass
class DataSchema:
    """``data``: what every data option shares (``xl.data.SegmentDataModule``'s arguments)."""

    _target_: str = "xl.data.SegmentDataModule"
    tokenizer: str = setting("byte", bound=one_of(*TOKENIZERS),
                             help="byte (256 ids), char and word (fitted on the training split), bpe and unigram "
                                  "(byte-level subwords, fitted or read from tokenizer_file)")
    # (Any, not dict | None: OmegaConf cannot merge a mapping into a node so typed that holds null)
    tokenizer_kwargs: Any = setting(
        None, help="word: {min_freq: 1, max_size: null, punctuation: false (true: each punctuation mark a word)}; "
                   "bpe/unigram: {vocab_size: 4096, special_tokens: [], pre_tokenizer: gpt2}; a key the config does "
                   "not have yet is added with + (+data.tokenizer_kwargs.vocab_size=8000)")
    batch_size: int = setting(8, bound=Bound("at least 1", lambda v: is_int(v) and v >= 1), help="streams per device")
    eval_batch_size: int | None = setting(None, bound=POSITIVE_OR_NULL, help="null: batch_size")
    tgt_len: int = setting(128, bound=Bound("at least 1", lambda v: is_int(v) and v >= 1), help="tokens per segment")
    eval_tgt_len: int | None = setting(None, bound=POSITIVE_OR_NULL, help="null: tgt_len")
    cache_dir: str | None = setting(None, help="the token cache; null: $XL_CACHE_DIR, else ~/.cache/xl")
    tokenizer_file: str | None = setting(
        None, help="read instead of fitting: bpe/unigram a byte-level Hugging Face tokenizer.json, word a vocabulary "
                   "file (vocab.json)")
    doc_sep: str | None = setting(
        None, help="a line that begins a new document (kept in the text), beyond the source's own")
    doc_sep_regex: bool = setting(False, help="true: doc_sep is a regular expression that the whole line must match")


@dataclass
class SourceDataSchema(DataSchema):
    """``data/schema``: a corpus given by a source object (stdlib, hub benchmarks, the probe's recall task)."""

    source: Any = setting(MISSING, help="the corpus: a _target_ of xl.data.sources")


@dataclass
class FilesDataSchema(DataSchema):
    """``data/files_schema``: local text files, one path or a list of paths per split (each file a document)."""

    _target_: str = "xl.data.SegmentDataModule.from_files"
    train: Any = setting(MISSING, help="a text file, or a list of them")
    val: Any = setting(MISSING, help="a text file, or a list of them")
    test: Any = setting(MISSING, help="a text file, or a list of them")


@dataclass
class BabilongDataSchema(DataSchema):
    """``data/babilong_schema``: BABILong-style samples (xl.data.babilong.data), the background a data source."""

    _target_: str = "xl.data.babilong.data.BabilongDataModule"
    background: Any = setting(MISSING, help="the background text: data/background=stdlib (default), pg19 or text")
    tasks: list[str] = setting(factory=lambda: ["qa1"], help="the bAbI tasks, in turn", bound=Bound(
        f"a list of {', '.join(BABILONG_TASKS)}", lambda v: len(v) > 0 and all(t in BABILONG_TASKS for t in v)))
    length: Any = setting("1k", bound=Bound(LENGTH_WORDS, is_length),
                          help="tokens of each sample's context (facts and background); the question follows")
    train_samples: Any = setting(2000, bound=POSITIVE | one_of(STREAM, words=STREAM),
                                 help="samples of the train split; stream: new samples made while training, an "
                                      "endless seeded stream (val and test stay cached)")
    eval_samples: int = setting(200, bound=POSITIVE, help="samples of the val and of the test split")
    seed: int = setting(0, bound=COUNT, help="which stories and background positions")
    loss: str = setting("answer", bound=one_of("answer", "all", words="answer or all"),
                        help="answer: the answer's tokens only; all: every token")
    train_questions: str = setting("last", bound=one_of(*TRAIN_QUESTIONS),
                                   help="last: one question ends a training story (BABILong's); all: each of its "
                                        "questions in turn (bAbI's); every: qa1 asks of every actor at each; end: "
                                        "after all facts, of every actor (qa1) or object (qa2, qa3); end_actors: and "
                                        "of every actor who moved; end_holders: and who has each object held")
    train_most_questions: int = setting(5, bound=STORY_QUESTIONS,
                                        help="a training story runs to its k-th question, k from 1 to this (bAbI's "
                                             "5, above it longer than a test's; qa1: two moves each); test keeps 5")
    train_support: Any = setting(None, bound=Bound("tasks mapped to lists of what their answers follow from, as "
                                                   "{qa2: ['get, move']}", lambda v: v is None or is_train_support(v)),
                                 help="keeps a task's training stories whose answer follows from facts of those kinds "
                                      "in order (qa2: move, get; get, move; move, drop); null: all")
    val_most_questions: int = setting(5, bound=STORY_QUESTIONS,
                                      help="a validation story runs to its k-th question, k from 1 to this: a "
                                           "curriculum stage validated on its own stories; test keeps 5")


@dataclass
class OptimConfig:
    """``optim``: AdamW, linear warm-up then cosine decay to ``min_lr_ratio × lr``. The ``optim`` group's schema too
    (the optimizer of :mod:`xl.training.loop.optim` takes it): each field's type, default, bound and help are declared
    once, here."""

    lr: float = setting(1e-3, bound=above(0), help="peak learning rate")
    weight_decay: float = setting(0.0, bound=at_least(0, "a finite number"), help="AdamW's, on matrices only")
    betas: list[float] = setting(factory=lambda: [0.9, 0.999], help="AdamW's", bound=Bound(
        "two numbers in [0, 1)", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v)))
    eps: float = setting(1e-8, bound=above(0), help="AdamW's")
    warmup_steps: int = setting(100, bound=at_least(0), help="linear warm-up")
    min_lr_ratio: float = setting(0.0, bound=between(0, 1, high_open=False), help="the LR at the end, × lr")

    def __post_init__(self) -> None:
        check_fields(self, "optim.")



# ---- optimization and the trainer ---------------------------------------------------------------------------------
@dataclass
class TrainerSchema:
    """``trainer``: ``lightning.pytorch.Trainer``'s arguments that the configs set; ``+trainer.X=...`` adds others."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = setting("cpu", bound=one_of("auto", "cpu", "gpu", "cuda", "mps"), help="set by trainer=")
    devices: Any = setting(1, bound=Bound("a count >= 1, -1 (all), auto, or a list of device indices", _devices),
                           help="a count, a list of indices, or auto")
    num_nodes: int = setting(1, bound=POSITIVE, help="machines")
    precision: str = setting("auto", bound=one_of("auto", *PRECISIONS), help="set by precision=")
    strategy: Any = setting("auto", help="auto, ddp, or a strategy's _target_ (trainer=ddp, trainer=fsdp)")
    max_steps: int = setting(1500, bound=Bound("-1 (no limit) or an integer >= 0", lambda v: is_int(v) and v >= -1),
                             help="optimizer steps in all, resumed runs included")
    max_epochs: int | None = setting(
        -1, bound=Bound("null, -1 (no limit) or an integer >= 0", lambda v: v is None or v >= -1), help="-1: no limit")
    limit_train_batches: int | float = setting(1.0, bound=BATCHES, help="a fraction of the epoch, or a count")
    val_check_interval: int | float = setting(
        500, bound=Bound("a count of batches >= 1 or a fraction in (0, 1]",
                         lambda v: (is_int(v) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0)),
        help="validate every N training segments (or a fraction of the epoch)")
    check_val_every_n_epoch: int | None = setting(None, bound=optional(POSITIVE), help="null: by val_check_interval")
    limit_val_batches: int | float = setting(100, bound=BATCHES, help="segments of validation")
    limit_test_batches: int | float = setting(1.0, bound=BATCHES, help="segments of the test")
    gradient_clip_val: float | None = setting(0.25, bound=optional(at_least(0, "a finite number")), help="null: none")
    accumulate_grad_batches: int = setting(1, bound=POSITIVE, help="windows per optimizer step")
    log_every_n_steps: int = setting(10, bound=POSITIVE, help="steps between logged values")
    num_sanity_val_steps: int = setting(2, bound=Bound("-1 (all) or an integer >= 0", lambda v: is_int(v) and v >= -1),
                                        help="validation segments before training")
    deterministic: bool | str = setting(False, bound=Bound("true, false or warn",
                                                           lambda v: isinstance(v, bool) or v == "warn"),
                                        help="torch's deterministic algorithms")
    default_root_dir: str | None = setting("${paths.output_dir}", help="the run folder")


# ---- the primary configs --------------------------------------------------------------------------------------------
@dataclass
class CompileSchema:
    """``compile``: ``torch.compile`` the model in place (checkpoint keys unchanged)."""

    enabled: bool = setting(False, help="compile the model")
    mode: str | None = setting(None, help="torch.compile's mode", bound=one_of(
        *COMPILE_MODES, words=f"null or one of {', '.join(COMPILE_MODES[1:])}"))
    backend: str = setting("inductor", help="one of torch.compiler.list_backends()")


@dataclass
class PathsSchema:
    output_dir: str = setting(OUTPUT_DIR, help="everything a run writes; Hydra picks the folder")


@dataclass
class TrainSchema:
    """``conf/config.yaml`` (``python train.py``): the groups, and the run's own keys."""

    model: ModelSchema = setting(factory=ModelSchema)
    memory: Any = setting(MISSING)  # typed by its variant (xl.model.memory_settings.typed)
    data: Any = setting(MISSING)
    optim: OptimConfig = setting(factory=OptimConfig)
    trainer: TrainerSchema = setting(factory=TrainerSchema)
    logger: Any = setting(None)
    callbacks: Any = setting(None)
    paths: PathsSchema = setting(factory=PathsSchema)
    compile: CompileSchema = setting(factory=CompileSchema)
    seed: int = setting(1234, bound=Bound("an integer in [0, 2**32)", lambda v: is_int(v) and 0 <= v < 2**32),
                        help="seeds torch, numpy and Python's random")
    test: bool = setting(True, help="evaluate the best checkpoint on the test split after fitting")
    train: bool = setting(True, help="false: only test ckpt_path (a run folder: in a folder of its own)")
    ckpt_path: str | None = setting(None, help="resume (or, with train=false, test) this checkpoint or run folder "
                                               "(its newest complete checkpoint)")
    init_from: str | None = setting(None, help="start a new run from this run's (or converted model's) weights")
    curriculum: Any = setting(None, help="stages over data.length and data.tasks, each from the last one's weights, "
                                         "each ending after its steps or when its metric passes below/above "
                                         "(docs/babilong.md)")
    overwrite: bool = setting(False, help="a new run into a folder that holds another run: empty the folder first")
    max_nonfinite_steps: int = setting(5, bound=POSITIVE, help="skipped non-finite steps in a row that stop the run")
    run_name: str | None = setting(None, help="null: the command-line overrides (or default)")
    tags: list[str] = setting(factory=list, help="the run's tags (W&B)")


EvalContextSchema = overrides("EvalContextSchema", (
    "``memory`` of ``python -m xl.evaluate``: each of mem_len, clamp_len, same_length is memory.eval_X if set, else "
    "memory.X if set, else the checkpoint's own evaluation value."), {
    **{key: (name, help) for name in EVALUATED
       for key, help in ((name, "null: the checkpoint's"), (f"eval_{name}", f"null: {name}"))},
    "doc_boundaries": ("doc_boundaries", "null: the checkpoint's")})

DecodingContext = overrides("DecodingContext", (
    "The decoder's context of ``python -m xl.generate`` and ``python -m xl.babilong``: null keeps the checkpoint's."), {
    "mem_len": ("mem_len", "the memory each new token attends over; null: the checkpoint's (without memory: its "
                           "training segment length minus one)"),
    "clamp_len": ("clamp_len", "null: the checkpoint's"),
    "same_length": ("same_length", "null: the checkpoint's")})


@dataclass
class EvaluateSchema:
    """``conf/evaluate.yaml`` (``python -m xl.evaluate``)."""

    ckpt: str = setting(MISSING, help="a .ckpt file, or a run folder (its newest complete checkpoint)")
    data: Any = setting(MISSING)
    trainer: TrainerSchema = setting(factory=TrainerSchema)
    logger: Any = setting(None)
    memory: EvalContextSchema = setting(factory=EvalContextSchema)
    paths: PathsSchema = setting(factory=PathsSchema)
    warmup: int = setting(0, bound=COUNT, help="segments of every stream fed to fill the memory but not scored")
    vanilla: bool = setting(False, help="no cache: every token predicted by a fresh forward over attn_len tokens")
    attn_len: int | None = setting(None, bound=optional(POSITIVE), help="vanilla window; null: mem_len + tgt_len")
    splits: list[str] = setting(factory=lambda: ["val", "test"], help="the splits scored", bound=Bound(
        "a list of val and test", lambda v: len(v) > 0 and all(split in ("val", "test") for split in v)))
    per_document: bool = setting(False, help="also per document: count, mean, and by position in the document")
    seed: int = setting(1234, help="seeds the evaluation")
    run_name: str | None = setting(None, help="the name of the evaluation's run")
    tags: list[str] = setting(factory=list, help="its tags")


@dataclass
class GenerateSchema(DecodingContext):
    """``conf/generate.yaml`` (``python -m xl.generate``): the decoder's context (:data:`DecodingContext`), and the
    sampling's settings."""

    ckpt: str = setting(MISSING, help="a run folder (its checkpoints/last.ckpt), or a .ckpt file")
    data: Any = setting(MISSING)
    paths: PathsSchema = setting(factory=PathsSchema)
    prompt: str = setting("", help="the text to continue; quote it for Hydra inside the shell's quotes")
    warmup: str | None = setting(None, help="a text file read before the prompt to fill the memory (not printed)")
    warmup_text: str | None = setting(None, help="or the warm-up text itself")
    max_new_tokens: int = setting(200, bound=COUNT, help="tokens sampled")
    temperature: float = setting(1.0, bound=at_least(0, "a finite number"), help="0: greedy")
    top_k: int = setting(0, bound=COUNT, help="sample among the k likeliest tokens; 0: off")
    top_p: float = setting(1.0, bound=Bound("a number in (0, 1]", lambda v: is_number(v) and 0 < v <= 1),
                           help="sample within the smallest set of tokens that holds this mass; 1.0: off")
    seed: int = setting(1234, help="seeds the sampling")
    seg_len: int = setting(128, bound=POSITIVE, help="segment length for reading the warm-up and the prompt")


@dataclass
class ExportSchema:
    """``conf/export.yaml`` (``python -m xl.export``)."""

    ckpt: str = setting(MISSING, help="a run folder (its checkpoints/last.ckpt) or a .ckpt file")
    out: str = setting(MISSING, help="the folder to write: model.safetensors, config.json, the tokenizer, README.md")
    push: str | None = setting(None, help="also push it to this hub repository (org/name)")
    private: bool = setting(False, help="with push: a repository it creates is private")
    data: Any = setting(MISSING)


@dataclass
class ScoreSchema(DecodingContext):
    """``conf/babilong.yaml`` (``python -m xl.babilong``): the decoder's context (:data:`DecodingContext`), and the
    scoring's settings."""

    ckpt: str = setting(MISSING, help="a run folder (its checkpoints/last.ckpt) or a .ckpt file")
    tasks: list[str] = setting(factory=lambda: list(BABILONG_TASKS), help="the bAbI tasks", bound=Bound(
        f"a list of {', '.join(BABILONG_TASKS)}", lambda v: len(v) > 0 and all(t in BABILONG_TASKS for t in v)))
    lengths: list[Any] = setting(factory=lambda: [0, "1k", "2k", "4k"], help="context lengths in the run's tokens",
                                 bound=Bound(f"a list of lengths, each {LENGTH_WORDS}",
                                             lambda v: len(v) > 0 and all(is_length(x) for x in v)))
    samples: int = setting(100, bound=POSITIVE, help="samples per task and length")
    seed: int = setting(0, bound=COUNT, help="which test stories and background")
    batch_size: int = setting(8, bound=POSITIVE, help="samples read at once")
    max_new_tokens: int = setting(16, bound=POSITIVE, help="the longest answer generated")
    seg_len: int | None = setting(None, bound=optional(POSITIVE), help="segments read; null: the run's training length")
    device: str = setting("auto", bound=one_of("auto", "cpu", "cuda"), help="auto: a CUDA GPU if there is one")
    data: Any = setting(None, help="data/background=stdlib, pg19 or text: another background than the run's")
    memory: dict[str, Any] = setting(factory=dict, help="the memory's evaluation settings, +memory.NAME=VALUE (the "
                                                        "retrieval memory's knn_size, knn_top_k, knn_search; the "
                                                        "compressive memory's cmem_len); the checkpoint's otherwise")
    logger: Any = setting(None)
    paths: PathsSchema = setting(factory=PathsSchema)
    run_name: str | None = setting(None, help="the W&B run's name; null: the overrides")
    tags: list[str] = setting(factory=list, help="the W&B run's tags")



# Registered at the top level, not in the groups, so that no schema is an option of its group (``model=schema``) or
# listed in ``--help``: each option file names its schema with an absolute path, ``/model_schema@_here_``.
SCHEMAS: dict[str, Any] = {
    "model_schema": ModelSchema,
    # The shared context as a plain node: a variant's own keys follow it (xl.model.memory_settings types the whole).
    "memory_schema": OmegaConf.to_container(OmegaConf.structured(MemorySettings)),
    "data_schema": SourceDataSchema,
    "data_files_schema": FilesDataSchema,
    "data_babilong_schema": BabilongDataSchema,
    "optim_schema": OptimConfig,
    "trainer_schema": TrainerSchema,
    "callbacks_schema": CALLBACKS,
    **{f"logger_{name}_schema": {name: schema} for name, schema in LOGGERS.items()},
    "train_schema": TrainSchema,
    "evaluate_schema": EvaluateSchema,
    "generate_schema": GenerateSchema,
    "export_schema": ExportSchema,
    "babilong_score_schema": ScoreSchema,
}


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        if isinstance(node, dict) and all(isinstance(schema, type) for schema in node.values()):
            node = {key: OmegaConf.structured(schema) for key, schema in node.items()}
        store.store(name=name, node=node, provider="xl")


register()
