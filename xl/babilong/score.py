"""Score a trained run on BABILong-style tasks, with Hydra's command line (``key=value`` settings, ``-m`` sweeps).

For every task and length (``tasks=[qa1,qa2,qa3] lengths=[0,1k,4k,16k] samples=100``) the scorer makes ``samples``
test-split samples (:mod:`xl.data.babilong.samples`: never a story the run trained on, the same ones for a seed),
lengths in the run's tokens, the background the run's (``data/background=...`` names another). Each sample is read
through the model's memory segment by segment with its incremental decoder
(:meth:`xl.model.transformer.TransformerXL.decoder`), so the memory held does not grow with the length; the answer is
then generated greedily up to its line end (``max_new_tokens`` at most) and judged by BABILong's rule
(:mod:`xl.data.babilong.answers`). Samples are read ``batch_size`` at a time, each row's sample preceded by filler that
it never sees (a document of its own), so that the rows end together.

The decoder's context is the run's: its memory (``mem_len``, a model without memory its training segment),
``clamp_len`` and ``same_length``, each replaced by the key of the same name, and segments of the run's training
length (``seg_len``). Results: ``results.json``, ``heatmap.png`` (tasks x lengths, accuracy in each cell, as
BABILong's leaderboard draws it) and the printed table in the output folder, and a W&B table (offline). Under
``-m`` the sweep folder gets ``summary.csv``, ``summary.md`` and ``summary.png``, one heatmap per job. Beside the
model, each cell scores the rules that need no memory of the asked entity on the same samples
(:mod:`xl.babilong.baselines`). ``results.json`` is written as cells finish; a stopped scoring goes on from its
cells when rerun into the same folder with the same settings (:mod:`xl.babilong.resume`).

Example, with runs/qa1 the run folder (docs/babilong.md)::

    python -m xl.babilong ckpt=runs/qa1 tasks=[qa1] lengths=[0,1k,2k,4k] samples=100
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from xl.babilong import main  # noqa: F401 (the command, also importable from here)
from xl.babilong.baselines import expected, follows
from xl.babilong.report import HEATMAP, Cell, facts_group, log_results, record, table, write_results
from xl.babilong.resume import Progress, SignalStop, identity, kept_cells
from xl.config.rules import ConfigError, check_bounds
from xl.data.babilong.background import Sentences
from xl.data.babilong.data import token_counter
from xl.data.babilong.lengths import length_name, parse_length
from xl.data.babilong.samples import Sample, samples
from xl.data.babilong.tasks import Story, support
from xl.data.sources import StdlibSource
from xl.generation import decoding_context
from xl.model import memory_settings
from xl.model.memory_settings import MemoryContext
from xl.training.runs import TrainedRun
from xl.training.services.callbacks import write_json
from xl.training.services.console import errors_logged, quiet_warnings
from xl.training.services.sweep import RESULTS_FILE

log = logging.getLogger("babilong")


@dataclass
class Reader:
    """A trained model, its tokenizer and its decoding context: reads prompts and answers them greedily."""

    model: Any
    tokenizer: Any
    context: MemoryContext  # the decoder's (its mem_len the decoder's window)
    seg_len: int
    max_new_tokens: int
    stops: torch.Tensor = field(init=False)  # ids whose text holds a line end: they close an answer

    def __post_init__(self) -> None:
        vocab = self.model.config.vocab_size
        self.stops = torch.tensor([i for i in range(vocab) if "\n" in self.tokenizer.decode([i])],
                                  dtype=torch.long, device=self.model.device)

    def answer(self, prompts: list[str]) -> list[str]:
        """Each prompt's greedy answer: its continuation's text up to the first line end."""
        return [self.tokenizer.decode(ids).split("\n")[0] for ids in self.continuations(prompts)]

    @torch.no_grad()
    def read(self, prompts: list[str]) -> tuple[Any, torch.Tensor]:
        """A decoder that has read the prompts, one per row, and the logits [B, vocab] after each. The rows end
        together: each prompt is preceded by filler, which it never sees (the prompt begins a document)."""
        ids = [self.tokenizer.encode(p) for p in prompts]
        width = max(len(i) for i in ids)
        tokens = torch.zeros(len(ids), width, dtype=torch.long)
        starts = torch.zeros(len(ids), width, dtype=torch.bool)
        for row, row_ids in enumerate(ids):
            tokens[row, width - len(row_ids):] = torch.tensor(np.asarray(row_ids), dtype=torch.long)
            starts[row, width - len(row_ids)] = True
        padded = any(len(i) < width for i in ids)
        device = self.model.device
        decoder = self.model.decoder(len(ids), self.context.mem_len, clamp_len=self.context.clamp_len,
                                     same_length=self.context.same_length)
        return decoder, decoder.prefill(tokens.to(device), self.seg_len, starts.to(device) if padded else None)

    @torch.no_grad()
    def continuations(self, prompts: list[str]) -> list[list[int]]:
        """Each prompt's greedy continuation, up to and with its first line end (at most ``max_new_tokens``)."""
        decoder, logits = self.read(prompts)
        new, done = [], torch.zeros(len(prompts), dtype=torch.bool, device=logits.device)
        for step in range(self.max_new_tokens):
            token = logits.argmax(-1)
            new.append(token)
            done |= torch.isin(token, self.stops)
            if bool(done.all()) or step + 1 == self.max_new_tokens:
                break
            logits = decoder.feed(token)
        stops = set(self.stops.tolist())
        rows = torch.stack(new, 1).tolist()
        return [row[: next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in rows]


def check_settings(cfg: DictConfig) -> None:
    """The schema's bounds, and a device that exists, before the run is read."""
    check_bounds(cfg)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")


def background_of(cfg: DictConfig, run: TrainedRun) -> Any:
    """``data.background`` if given, else the run's (if it trained on data=babilong), else the embedded corpus."""
    node = OmegaConf.select(cfg, "data.background")
    if node is None:
        node = (run.data if run.folder is not None else {}).get("background")
    if node is None:
        return StdlibSource()
    try:
        return instantiate(OmegaConf.create(node) if isinstance(node, dict) else node)
    except Exception as err:  # Hydra wraps the source's own error
        cause = err.__cause__ or err
        raise ConfigError(f"data.background: {str(cause).splitlines()[0]}") from None


def evaluated_model(cfg: DictConfig, run: TrainedRun) -> dict[str, Any]:
    """The checkpoint's model config with the scoring's values of its memory's evaluation settings
    (``+memory.NAME=VALUE``: :attr:`xl.model.memory_settings.MemoryConfig.evaluation_settings`)."""
    given = dict(OmegaConf.to_container(cfg.memory)) if cfg.get("memory") else {}
    decoder = sorted(set(given) & {"mem_len", "clamp_len", "same_length"})
    if decoder:
        raise ConfigError(f"memory.{decoder[0]} is the decoder's here: set {decoder[0]}=VALUE, the scorer's own key")
    try:
        return memory_settings.evaluated_model(run.checkpoint.model_config, given)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def reader_of(cfg: DictConfig, run: TrainedRun) -> tuple[Reader, str]:
    device = torch.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    seg_len = cfg.seg_len or run.checkpoint.train_tgt_len
    if seg_len is None:
        raise ConfigError(f"ckpt={cfg.ckpt} does not record its training segment length; set seg_len=N")
    tokenizer = run.tokenizer
    model = run.model(evaluated_model(cfg, run)).to(device)
    context, described = decoding_context(OmegaConf.merge(cfg, {"seg_len": seg_len}), run.checkpoint)
    try:
        model.decoder(1, context.mem_len, clamp_len=context.clamp_len, same_length=context.same_length)
    except ValueError as err:  # the decoder's context checks name mem_len, clamp_len, same_length
        raise ConfigError(str(err)) from None
    return Reader(model, tokenizer, context, seg_len, cfg.max_new_tokens), f"{described}, segments of {seg_len}"


def score_cell(reader: Reader, background: Any, task: str, length: Any, cfg: DictConfig) -> Cell:
    """Accuracy on ``cfg.samples`` test samples of ``task`` at ``length``, read ``cfg.batch_size`` at a time."""
    count = token_counter(reader.tokenizer)  # as the samples a run trained on were counted
    stream = samples(task, parse_length(length), "test", cfg.seed, Sentences(background, "test", count), count)
    cell = Cell(task, length_name(length), parse_length(length))
    start = time.perf_counter()
    batch: list[Sample] = []
    stories = []
    for _ in range(cfg.samples):
        batch.append(next(stream))
        stories.append(batch[-1].story)
        if len(batch) == cfg.batch_size or cell.samples + len(batch) == cfg.samples:
            for sample, output in zip(batch, reader.answer([s.prompt for s in batch]), strict=True):
                story = sample.story
                cell.add(follows(task, story, output), sample.tokens, len(reader.tokenizer.encode(sample.prompt)),
                         support(story), len(story.facts))
            batch = []
    if reader.model.device.type == "cuda":
        torch.cuda.synchronize()
    cell.seconds = time.perf_counter() - start
    cell.baselines = {rule: right / cell.samples for rule, right in expected(task, stories).items()}
    groups: dict[str, list[Story]] = {}
    for story in stories:
        groups.setdefault(facts_group(len(story.facts)), []).append(story)
    cell.facts_baselines = {group: {rule: right / len(those) for rule, right in expected(task, those).items()}
                            for group, those in groups.items()}
    return cell


def score(cfg: DictConfig) -> dict[str, Any]:
    """Score ``cfg.ckpt``; returns what ``results.json`` holds. A signal ends it with one sentence, the cells
    finished kept (:mod:`xl.babilong.resume`)."""
    check_settings(cfg)
    progress = Progress(**where_to_continue(cfg))
    with SignalStop(progress) as stop:
        return score_cells(cfg, progress, stop)


def where_to_continue(cfg: DictConfig) -> dict[str, str]:
    """The folder setting a rerun names to go on: the run's folder, or under ``-m`` the sweep's."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return {"setting": "hydra.sweep.dir", "folder": str(HydraConfig.get().sweep.dir)}
    return {"setting": "hydra.run.dir", "folder": str(cfg.paths.output_dir)}


def score_cells(cfg: DictConfig, progress: Progress, stop: SignalStop) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    run = TrainedRun.open(cfg.ckpt)
    reader, described = reader_of(cfg, run)
    background = background_of(cfg, run)
    setting = background.setting("test")
    path = Path(cfg.paths.output_dir) / RESULTS_FILE
    settings = identity(cfg, run.checkpoint, described, setting, reader.model.device.type)
    kept = {(c.task, c.length): c for c in kept_cells(path, settings, progress.setting)}
    plan = [(task, length_name(length), length) for task in cfg.tasks for length in cfg.lengths]
    progress.path, progress.total = path, len(plan)
    log.info("babilong: %s\n  %s; background %s", run.checkpoint.path, described, setting)
    cells: list[Cell] = []
    for task, name, length in plan:
        cell = kept.get((task, name))
        if cell is None:
            cell = score_cell(reader, background, task, length, cfg)
        log.info("  %s at %s: %d/%d (%.0f%%), %.1f s%s", task, cell.length, cell.correct, cell.samples,
                 100 * cell.accuracy, cell.seconds, "" if (task, name) not in kept else f", kept in {path}")
        cells.append(cell)
        if len(cells) < len(plan):
            with stop.held():
                values = record(cfg, run, reader.context, reader.model.config.memory, described, setting, cells,
                                settings, False)
                write_json(path, values)
                progress.kept = len(cells)
    values = record(cfg, run, reader.context, reader.model.config.memory, described, setting, cells, settings)
    with stop.held():
        written = write_results(cfg.paths.output_dir, values)
        progress.kept = len(cells)
    heatmap = written.parent / HEATMAP
    logged = log_results(cfg, values, heatmap)
    log.info("babilong accuracy (%%, %d samples per cell)\n%s\n  results: %s\n  heatmap: %s%s", cfg.samples,
             table(values), written, heatmap, f"\n  {logged}" if logged else "")
    return values


def run(cfg: DictConfig) -> None:
    """The command (:func:`xl.babilong.main`), once its command line has composed."""
    quiet_warnings()
    with errors_logged():
        score(cfg)

