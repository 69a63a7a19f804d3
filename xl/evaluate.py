"""Evaluate a trained checkpoint on val and test: ``python -m xl.evaluate ckpt=PATH [key=value ...]`` (Hydra).

The model's shape comes from the checkpoint; the data, the evaluation context (``memory.eval_mem_len``,
``data.eval_tgt_len``, ``memory.clamp_len``, ``memory.eval_same_length``), the device and the precision
from ``conf/evaluate.yaml`` and its groups, so a checkpoint can be read with a longer memory than it
was trained with, as in the paper. ``warmup=N`` feeds the first N segments of every stream without
scoring them, so that every scored token has a full memory. ``vanilla=true`` is the paper's baseline
(Dai et al., 2019, section 4): no cache, every token predicted by a fresh forward over the
``attn_len`` tokens before it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from xl.build import ConfigError, build_datamodule, build_trainer, check_device
from xl.checkpoint import Checkpoint, check_vocabulary
from xl.config import entry_point
from xl.lit import XLLitModule
from xl.model import TransformerXL

log = logging.getLogger("evaluate")


def vanilla_nll(model: TransformerXL, context: Tensor, x: Tensor, y: Tensor, attn_len: int, clamp_len: int) -> Tensor:
    """Summed NLL of ``y`` when each token is predicted by its own forward over the last ``attn_len`` inputs.

    ``context`` holds the inputs before ``x`` (at most ``attn_len - 1`` are used); nothing else is
    carried between forwards, so the cost is one window forward per predicted position.
    """
    tokens = torch.cat([context, x], dim=1)
    total = x.new_zeros((), dtype=torch.float32)
    for i in range(x.size(1)):
        end = context.size(1) + i + 1
        window = tokens[:, max(0, end - attn_len):end]
        logits = model(window, mem_len=0, clamp_len=clamp_len, same_length=False).logits[:, -1]
        total = total + F.cross_entropy(logits.float(), y[:, i], reduction="sum")
    return total


def default_attn_len(mem_len: int, tgt_len: int, same_length: bool) -> int:
    """The longest context a Transformer-XL query sees in the same evaluation."""
    return mem_len if same_length else mem_len + tgt_len


class Evaluator(XLLitModule):
    """XLLitModule's evaluation with warm-up segments, the vanilla mode, and scored tokens/s.

    Validation and test share one step; the memory (or, in the vanilla mode, the preceding tokens)
    restarts with every split. Time is counted over the scored segments only.
    """

    def __init__(self, model: dict[str, Any], context: dict[str, Any], unit: str, warmup: int = 0,
                 attn_len: int | None = None) -> None:
        super().__init__(model=model, eval_mem_len=context["mem_len"], eval_same_length=context["same_length"],
                         eval_clamp_len=context["clamp_len"], unit=unit)
        self.warmup, self.attn_len = warmup, attn_len
        self.history: Tensor | None = None
        self.seconds, self.tokens = 0.0, 0

    def restart(self) -> None:
        self.history, self.seconds, self.tokens = None, 0.0, 0

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self.restart()

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self.restart()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.score(batch, batch_idx, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.score(batch, batch_idx, "test")

    def score(self, batch: tuple[Tensor, Tensor], batch_idx: int, stage: str) -> None:
        x, y = batch
        scored = batch_idx >= self.warmup
        start = time.perf_counter()
        if self.attn_len is None:
            loss = self.segment_loss(batch, stage)  # warm-up segments too: they fill the memory
        else:
            history = x[:, :0] if self.history is None else self.history
            if scored:
                loss = vanilla_nll(self.model, history, x, y, self.attn_len, self.eval_context["clamp_len"]) / y.numel()
            self.history = torch.cat([history, x], dim=1)[:, max(0, history.size(1) + x.size(1) - self.attn_len + 1):]
        if not scored:
            return
        if x.is_cuda:  # kernels run asynchronously: wait before reading the clock
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        self.tokens += y.numel()
        getattr(self, f"{stage}_nll").update(loss, weight=y.numel())

    def on_validation_epoch_end(self) -> None:
        self.log_speed("val")
        super().on_validation_epoch_end()

    def on_test_epoch_end(self) -> None:
        self.log_speed("test")
        super().on_test_epoch_end()

    def log_speed(self, stage: str) -> None:
        if not self.tokens:
            raise ConfigError(f"warmup={self.warmup} leaves no {stage} segment to score; lower warmup")
        world = self.trainer.world_size  # every rank scores batches of the same shape
        self.log_dict({f"{stage}/tokens": float(self.tokens * world),
                       f"{stage}/tok_s": self.tokens * world / self.seconds}, sync_dist=False)


def eval_context(cfg: DictConfig, checkpoint: Checkpoint) -> dict[str, Any]:
    """Each of mem_len/clamp_len/same_length: memory.eval_X, else memory.X, else the checkpoint's evaluation value."""
    model = checkpoint.model_config
    saved = checkpoint.hyper_parameters
    context = {}
    for name in ("mem_len", "clamp_len", "same_length"):
        candidates = (cfg.memory.get(f"eval_{name}"), cfg.memory.get(name), saved.get(f"eval_{name}"), model[name])
        context[name] = next(v for v in candidates if v is not None)
    return context


def build_evaluator(cfg: DictConfig, checkpoint: Checkpoint, datamodule: Any) -> Evaluator:
    model = checkpoint.model_config
    check_vocabulary(model["vocab_size"], datamodule.vocab_size, checkpoint.path)
    if cfg.warmup < 0:
        raise ConfigError(f"warmup must be >= 0 segments, got {cfg.warmup}")
    context = eval_context(cfg, checkpoint)
    attn_len = None
    if cfg.vanilla:
        attn_len = cfg.attn_len or default_attn_len(context["mem_len"], datamodule.eval_tgt_len, context["same_length"])
        if attn_len < 1:
            raise ConfigError(f"attn_len must be >= 1 for vanilla=true, got {attn_len}")
    try:
        module = Evaluator(model, context, datamodule.unit, cfg.warmup, attn_len)
    except ValueError as err:
        raise ConfigError(f"invalid memory setting: {err}") from err
    module.load_state_dict(checkpoint.state["state_dict"])
    return module


def describe(module: Evaluator, path: str, step: int, datamodule: Any) -> str:
    c = module.eval_context
    mode = (f"vanilla (no cache), attn_len={module.attn_len}" if module.attn_len else
            f"mem_len={c['mem_len']} same_length={c['same_length']}")
    filled = min(c["mem_len"], module.warmup * datamodule.eval_tgt_len)
    return (f"checkpoint {path} (step {step}, trained with mem_len={module.config.mem_len})\n"
            f"  {mode} tgt_len={datamodule.eval_tgt_len} clamp_len={c['clamp_len']} "
            f"batch={datamodule.eval_batch_size} warmup={module.warmup} segments"
            + (f" (memory >= {filled} tokens when scoring)" if module.warmup and not module.attn_len else ""))


def format_table(results: dict[str, dict[str, float]], unit: str) -> str:
    lines = [f"  {'split':<6} {'loss':>8} {unit:>8} {'tokens':>12} {'tokens/s':>10}"]
    for split, m in results.items():
        lines.append(f"  {split:<6} {m[f'{split}/loss']:>8.4f} {m[f'{split}/{unit}']:>8.4f} "
                     f"{m[f'{split}/tokens']:>12,.0f} {m[f'{split}/tok_s']:>10,.0f}")
    return "\n".join(lines)


def evaluate(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """``{split: {"<split>/loss", "<split>/<bpb|bpc|ppl>", "<split>/tokens", "<split>/tok_s"}}`` for val and test."""
    check_device(cfg)
    L.seed_everything(cfg.seed, verbose=False)
    checkpoint = Checkpoint.open(cfg.ckpt, setting="ckpt")
    path, step = str(checkpoint.path), checkpoint.global_step
    datamodule = build_datamodule(cfg)
    module = build_evaluator(cfg, checkpoint, datamodule)
    del checkpoint  # the weights are in the module now; free the optimizer state before evaluating
    trainer = build_trainer(cfg)
    results = {}
    for split in cfg.splits:
        run = {"val": trainer.validate, "test": trainer.test}.get(split)
        if run is None:
            raise ConfigError(f"splits may hold val and test, got {split!r}")
        (results[split],) = run(module, datamodule=datamodule, verbose=False)
    log.info("evaluation\n  %s\n%s", describe(module, path, step, datamodule),
             format_table(results, module.quality_name))
    return results


@entry_point("evaluate")
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    main()
