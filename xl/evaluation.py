"""The evaluation of ``python -m xl.evaluate`` (:mod:`xl.evaluate`, whose help describes its settings): the
evaluation module with warm-up segments, the vanilla mode and per-document figures, and :func:`evaluate`, which
scores a run on val and test."""


from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import Tensor

from xl.config.compose import command_line_keys
from xl.config.machine import check_device
from xl.config.rules import ConfigError, check_evaluate_config
from xl.config.schema import EvalContextSchema
from xl.memory.store import packed_size
from xl.model import memory_settings
from xl.model.adaptive import widen
from xl.model.documents import Documents, DocumentStats, split_batch, summary, target_bytes
from xl.model.memory_settings import MemoryContext
from xl.model.transformer import TransformerXL
from xl.training.build import build_datamodule, make_trainer
from xl.training.checkpoints.checkpoint import Checkpoint, describe_corpus
from xl.training.eval_results import (
    Progress,
    describe,
    format_table,
    log_results,
    record,
    scored_corpus,
    stopped_sentence,
    write_results,
)
from xl.training.loop.module import XLLitModule
from xl.training.runs import find_run_folder, run_data, use_run_data
from xl.training.services.console import errors_logged, quiet_warnings
from xl.training.services.signals import Stopped, end_stopped, stop_on_signals
from xl.training.services.stops import close_progress_bars

log = logging.getLogger("evaluate")
CONTEXT_KEYS = {f.name for f in dataclasses.fields(EvalContextSchema)}  # memory's keys that every variant shares


def vanilla_nll(model: TransformerXL, context: Tensor, x: Tensor, y: Tensor, attn_len: int, clamp_len: int,
                pos: Tensor | None = None) -> Tensor:
    """Summed NLL of ``y`` when each token is predicted by its own forward over the last ``attn_len`` inputs.

    ``context`` holds the inputs before ``x`` (at most ``attn_len - 1`` are used); nothing else is
    carried between forwards, so the cost is one window forward per predicted position. ``pos``: the positions
    of ``context ∘ x`` in their documents, when each window must stop at its last token's document start.
    """
    tokens = torch.cat([context, x], dim=1)
    total = x.new_zeros((), dtype=torch.float32)
    for i in range(x.size(1)):
        end = context.size(1) + i + 1
        begin = max(0, end - attn_len)
        window = tokens[:, begin:end]
        documents = None if pos is None else Documents.from_positions(pos[:, begin:end])
        logits = model(window, mem_len=0, clamp_len=clamp_len, same_length=False, documents=documents).logits[:, -1]
        total = total + F.cross_entropy(logits.float(), y[:, i], reduction="sum")
    return total


def default_attn_len(mem_len: int, tgt_len: int, same_length: bool) -> int:
    """The longest context a Transformer-XL query sees in the same evaluation."""
    return mem_len if same_length else mem_len + tgt_len


class Evaluator(XLLitModule):
    """XLLitModule's evaluation with warm-up segments, the vanilla mode, and scored tokens/s.

    Validation and test share one step; the memory (or, in the vanilla mode, the preceding tokens)
    restarts with every split. Time is counted over the scored segments after the first segment of the split: the
    first pays for warming up (allocations, kernels, caches), and would make the first split look slower than the
    next. A split of one scored segment is timed on that one.
    """

    def __init__(self, model: dict[str, Any], context: MemoryContext, unit: str, warmup: int = 0,
                 attn_len: int | None = None, per_document: bool = False) -> None:
        super().__init__(model=model, eval_mem_len=context.mem_len, eval_same_length=context.same_length,
                         eval_clamp_len=context.clamp_len, unit=unit, doc_boundaries=context.doc_boundaries)
        self.warmup, self.attn_len, self.per_document = warmup, attn_len, per_document
        self.history: Tensor | None = None
        self.pos_history: Tensor | None = None  # positions in their documents of the vanilla history
        self.stats: DocumentStats | None = None
        self.restart()

    def restart(self) -> None:
        self.history, self.pos_history, self.stats = None, None, None
        self.tokens = 0  # scored
        self.seconds, self.timed = 0.0, 0  # time of the timed segments, and their tokens
        self.untimed: tuple[float, int] | None = None  # (seconds, tokens) of a first scored segment, not timed

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self.restart()

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self.restart()

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self.score(batch, batch_idx, "val")

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self.score(batch, batch_idx, "test")

    def score(self, batch: tuple[Tensor, ...], batch_idx: int, stage: str) -> None:
        x, y, documents = split_batch(batch)
        if self.per_document and (documents is None or documents.target_pos is None):
            raise ConfigError("per_document=true needs batches that say where documents begin (xl.data's loaders)")
        scored = batch_idx >= self.warmup
        start = time.perf_counter()
        if self.attn_len is None and self.per_document:
            nll = F.cross_entropy(widen(self.run_segment(x, stage, documents=documents).logits).transpose(1, 2), y,
                                  reduction="none")
            loss = nll.mean()
        elif self.attn_len is None:
            loss = self.segment_loss(batch, stage)  # warm-up segments too: they fill the memory
        else:
            loss = self.vanilla_step(x, y, documents, scored)
        if not scored:
            return
        if x.is_cuda:  # kernels run asynchronously: wait before reading the clock
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if batch_idx == 0:
            self.untimed = (seconds, y.numel())
        else:
            self.seconds, self.timed = self.seconds + seconds, self.timed + y.numel()
        self.tokens += y.numel()
        self.metrics.update(stage, loss, y, target_bytes(batch))
        if self.per_document:
            if self.stats is None:
                self.stats = DocumentStats(x.size(0), x.device)
            self.stats.update(nll, documents.target_pos)

    def vanilla_step(self, x: Tensor, y: Tensor, documents: Documents | None, scored: bool) -> Tensor | None:
        """The mean NLL of a scored segment in the vanilla mode; every segment extends the history."""
        history = x[:, :0] if self.history is None else self.history
        pos = None
        if self.doc_boundaries == "reset" and documents is not None:
            pos_history = documents.pos[:, :0] if self.pos_history is None else self.pos_history
            pos = torch.cat([pos_history, documents.pos], dim=1)
        loss = None
        if scored:
            clamp_len = self.eval_context.clamp_len
            loss = vanilla_nll(self.model, history, x, y, self.attn_len, clamp_len, pos) / y.numel()
        keep = max(0, history.size(1) + x.size(1) - self.attn_len + 1)
        self.history = torch.cat([history, x], dim=1)[:, keep:]
        self.pos_history = None if pos is None else pos[:, keep:]
        return loss

    def on_validation_epoch_end(self) -> None:
        self.log_speed("val")
        self.log_documents("val")
        super().on_validation_epoch_end()

    def on_test_epoch_end(self) -> None:
        self.log_speed("test")
        self.log_documents("test")
        super().on_test_epoch_end()

    def log_documents(self, stage: str) -> None:
        """The per-document figures (reduced over ranks): count, mean over documents, and by position."""
        if self.stats is None:
            return
        totals = {k: self.trainer.strategy.reduce(v, reduce_op="sum") for k, v in self.stats.finish().items()}
        values = summary(totals)
        metrics = {f"{stage}/docs": values.pop("docs")}
        for name, nll in values.items():
            metrics[f"{stage}/{name}_{self.quality_name}"] = float(self.quality(torch.tensor(nll)))
        self.log_dict(metrics, sync_dist=False)

    def log_speed(self, stage: str) -> None:
        if not self.tokens:
            raise ConfigError(f"warmup={self.warmup} leaves no {stage} segment to score; lower warmup")
        world = self.trainer.world_size  # every rank scores batches of the same shape
        seconds, timed = (self.seconds, self.timed) if self.timed else self.untimed
        self.log_dict({f"{stage}/tokens": float(self.tokens * world),
                       f"{stage}/tok_s": timed * world / seconds}, sync_dist=False)


def eval_context(cfg: DictConfig, checkpoint: Checkpoint) -> MemoryContext:
    """The context this evaluation of ``checkpoint`` uses: each of mem_len/clamp_len/same_length from memory.eval_X,
    else memory.X, else the checkpoint's evaluation value, else its trained value; doc_boundaries from
    memory.doc_boundaries, else the checkpoint's, else ignore (what a checkpoint without the setting was trained
    with)."""
    saved = checkpoint.hyper_parameters
    return MemoryContext.of(
        memory_settings.eval_overrides(cfg.memory), cfg.memory, memory_settings.eval_overrides(saved), saved,
        {"doc_boundaries": "ignore"}, checkpoint.model_config).evaluated({})


def eval_model_config(cfg: DictConfig, checkpoint: Checkpoint) -> dict[str, Any]:
    """The checkpoint's model config, with the evaluation's values of its memory's evaluation settings: every key of
    ``memory`` other than the shared context's (``+memory.NAME=VALUE``; see
    :attr:`xl.model.memory_settings.MemoryConfig.evaluation_settings`)."""
    given = {k: v for k, v in OmegaConf.to_container(cfg.memory).items() if k not in CONTEXT_KEYS}
    try:
        return memory_settings.evaluated_model(checkpoint.model_config, given)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def build_evaluator(cfg: DictConfig, checkpoint: Checkpoint, datamodule: Any,
                    model: dict[str, Any] | None = None) -> Evaluator:
    """The evaluation module of ``checkpoint``'s weights; ``model``: its model config (:func:`eval_model_config`)."""
    model = eval_model_config(cfg, checkpoint) if model is None else model
    checkpoint.check_tokenizer(datamodule.vocab_size, datamodule.tokenizer_fingerprint)
    context = eval_context(cfg, checkpoint)
    attn_len = None
    if cfg.vanilla:
        attn_len = cfg.attn_len or default_attn_len(context.mem_len, datamodule.eval_tgt_len, context.same_length)
    check_evaluate_config(cfg, model, attn_len)
    per_document = bool(cfg.get("per_document", False))
    scored = getattr(datamodule, "scored", "every token")
    if scored != "every token" and (cfg.vanilla or per_document):
        raise ConfigError(f"vanilla=true and per_document=true score every target, but this data scores {scored}; "
                          "set data.loss=all, or vanilla=false and per_document=false")
    try:
        module = Evaluator(model, context, datamodule.unit, cfg.warmup, attn_len, per_document)
    except ValueError as err:
        raise ConfigError(f"invalid memory setting: {err}") from err
    checkpoint.check_weights(module.model)
    module.load_state_dict(checkpoint.state["state_dict"])
    return module


def corpus_note(checkpoint: Checkpoint, datamodule: Any, from_run: bool) -> str:
    """Whether the data scored is the run's own (the splits of the corpus it was trained on), in words."""
    saved, current = checkpoint.data_identity, datamodule.identity
    if saved is None:
        return ("the run's data settings; the checkpoint does not record its data" if from_run else
                "as named; the checkpoint does not record the data it was trained on")
    if (saved["source"], saved["tokenizer"]) == (current["source"], current["tokenizer"]):
        return "the run's data" if from_run else "the run's data, named again"
    return f"other data than the run's, which trained on {describe_corpus(saved)}"


SEGMENT_KEYS = ("tgt_len", "batch_size", "eval_tgt_len", "eval_batch_size")  # of the data group


def run_segments(checkpoint: Checkpoint, folder: Path | None) -> tuple[dict[str, Any], str]:
    """The run's segment lengths and batch sizes (the data group's SEGMENT_KEYS), and whose they are in words: its
    folder's settings, else what the checkpoint records of its training (the evaluation's then follow them)."""
    if folder is not None:
        data = run_data(folder)
        return {key: data.get(key) for key in SEGMENT_KEYS}, "the run's"
    memory = checkpoint.train_memory
    recorded = {"tgt_len": checkpoint.train_tgt_len, "batch_size": None if memory is None else packed_size(memory)[1]}
    return {key: value for key, value in recorded.items() if value is not None}, "the checkpoint's"


def keep_run_segments(cfg: DictConfig, checkpoint: Checkpoint, folder: Path | None, set_keys: set[str] | None
                      ) -> str:
    """Data other than the run's (``data=text ...``) is scored with the run's segment length and batch: each of
    SEGMENT_KEYS that the command line does not set (``set_keys``: the data keys it sets; None: unknown, every key
    is as given) takes the run's value. Returns where the segment length and the batch come from, in words."""
    if set_keys is None:
        return "as set"
    recorded, whose = run_segments(checkpoint, folder)
    with open_dict(cfg):
        for key, value in recorded.items():
            if key not in set_keys:
                cfg.data[key] = value
    return segments_note(set_keys, whose if recorded else "the schema's (the checkpoint records none)")


def segments_note(set_keys: set[str], whose: str) -> str:
    """``the run's``, ``as set``, or which of the segment length and the batch was set (``data.tgt_len as set,
    data.batch_size the run's``)."""
    given = {quantity: next((f"data.{k}" for k in (f"eval_{quantity}", quantity) if k in set_keys), None)
             for quantity in ("tgt_len", "batch_size")}
    if not any(given.values()):
        return f"{whose} training segments" if whose == "the checkpoint's" else whose
    if all(given.values()):
        return "as set"
    return ", ".join(f"{key} as set" if key else f"data.{quantity} {whose}" for quantity, key in given.items())


def evaluate(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """``{split: {"<split>/loss", "<split>/<bpb|bpc|ppl>", "<split>/bpb", "<split>/tokens", "<split>/tok_s"}}`` for
    val and test, and ``<split>/unk_share`` for a tokenizer with ``<unk>`` (:mod:`xl.data.metrics`);
    with ``per_document``, also ``<split>/docs``, ``<split>/doc_mean_<unit>`` and ``<split>/pos_<range>_<unit>``.
    Also written to ``results.json`` in ``paths.output_dir`` and logged to W&B (with ``logger=wandb``). A signal
    ends the command (:func:`xl.training.services.signals.end_stopped`), keeping the splits finished in
    ``results.json``."""
    progress = Progress()
    with stop_on_signals():
        try:
            return scored(cfg, progress)
        except Stopped as stop:
            trainer = progress.trainer
            if trainer is not None:
                close_progress_bars(trainer)
            end_stopped(stop, stopped_sentence(stop.name, progress) + sweep_note(),
                        say=trainer is None or trainer.is_global_zero)


def sweep_note() -> str:
    """Under ``-m``: which job of the sweep the stop came in."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    return f" (the sweep stops at its job {HydraConfig.get().job.num})"


def scored(cfg: DictConfig, progress: Progress) -> dict[str, dict[str, float]]:
    """:func:`evaluate`'s work; ``progress`` follows it."""
    check_evaluate_config(cfg)
    check_device(cfg)
    L.seed_everything(cfg.seed, verbose=False)
    on_run_data = bool(cfg.data.get("from_run"))
    given = {k for k in SEGMENT_KEYS if cfg.data.get(k) is not None} if on_run_data else command_line_keys()
    set_keys = None if given is None else {k.removeprefix("data.") for k in given}
    from_run = use_run_data(cfg, cfg.ckpt)  # data=run: the run's data settings, with the keys set here on top
    checkpoint = Checkpoint.open(cfg.ckpt, setting="ckpt")
    model = eval_model_config(cfg, checkpoint)
    folder = find_run_folder(checkpoint.path)
    about = {"path": str(checkpoint.path.resolve()), "step": checkpoint.global_step,
             "run": str(folder.resolve()) if folder else None}
    segments = segments_note(set_keys, "the run's") if from_run else keep_run_segments(cfg, checkpoint, folder,
                                                                                       set_keys)
    datamodule = build_datamodule(cfg)
    note = corpus_note(checkpoint, datamodule, from_run is not None)
    module = build_evaluator(cfg, checkpoint, datamodule, model)
    del checkpoint  # the weights are in the module now; free the optimizer state before evaluating
    trainer = progress.trainer = make_trainer(cfg, logger=False, callbacks=[])
    results = {}
    corpus = scored_corpus(datamodule, list(cfg.splits))
    for split in cfg.splits:
        run = {"val": trainer.validate, "test": trainer.test}[split]
        progress.scoring = split
        (results[split],) = run(module, datamodule=datamodule, verbose=False)
        complete = len(results) == len(cfg.splits)
        values = record(module, datamodule, results, about, corpus, from_run is not None, complete)
        written = write_results(cfg.paths.output_dir, values)
        progress.written, progress.finished, progress.complete = written, list(results), complete
        progress.scoring = None
    logged = log_results(cfg, values)
    log.info("evaluation\n  %s\n%s\n  results: %s%s", describe(module, about["path"], about["step"], datamodule, corpus,
                                                           note, segments),
             format_table(results, module.quality_name), written, f"\n  {logged}" if logged else "")
    return results



def run(cfg: DictConfig) -> None:
    """The command (:func:`xl.evaluate.main`), once its command line has composed."""
    quiet_warnings()
    with errors_logged():
        evaluate(cfg)
