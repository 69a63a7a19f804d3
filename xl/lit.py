"""The LightningModule: training and evaluation steps, and who owns the memory.

Each batch is the next segment of every stream (see ``xl.data.stream``). The memory produced by
one step is the context of the next (truncated BPTT: the forward context crosses the segment
boundary, gradients do not). Each stage has its own memory so that, for example, the sanity-check
validation never touches the training memory. Memories are plain attributes, not buffers, so DDP
never broadcasts rank 0's copy over the other ranks' (each rank reads its own rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from xl.checkpoint import CheckpointError, rng_state, set_rng_state
from xl.memory import cache_footprint
from xl.metrics import UNITS, LMMetrics, quality, quality_name
from xl.model import TransformerXL, XLConfig, check_context

STAGES = ("train", "val", "test", "predict")


class NonFiniteError(RuntimeError):
    """Training produced non-finite losses or gradients too many steps in a row."""


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to ``min_lr_ratio × lr`` (the paper's schedule)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        self.betas = tuple(self.betas)


def batch_rows(batch: tuple[Tensor, Tensor]) -> int:
    """Rows (streams) in a segment batch, for Lightning's ThroughputMonitor."""
    return batch[0].size(0)


def batch_tokens(batch: tuple[Tensor, Tensor]) -> int:
    """Tokens in a segment batch, so that throughput is reported in tokens/s."""
    return batch[0].numel()


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear from 0 to 1 over ``warmup`` steps, then cosine down to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class XLLitModule(L.LightningModule):
    """Transformer-XL language model with per-stage recurrent memory."""

    def __init__(
        self,
        model: dict[str, Any],
        optim: dict[str, Any] | None = None,
        eval_mem_len: int | None = None,
        eval_same_length: bool | None = None,
        eval_clamp_len: int | None = None,
        unit: str = "byte",
        max_nonfinite_steps: int = 5,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = XLConfig.from_dict(dict(model))
        self.optim = OptimConfig(**(optim or {}))
        self.eval_context = {
            "mem_len": self.config.mem_len if eval_mem_len is None else eval_mem_len,
            "same_length": self.config.same_length if eval_same_length is None else eval_same_length,
            "clamp_len": self.config.clamp_len if eval_clamp_len is None else eval_clamp_len,
        }
        check_context(**self.eval_context)
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
        self.unit = unit
        if max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {max_nonfinite_steps}")
        self.max_nonfinite_steps = max_nonfinite_steps
        # Counted on the device every step, read on the host once per logging interval.
        self.nonfinite_in_row = 0
        self.nonfinite_total = 0
        self.register_buffer("_nonfinite_run", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("_nonfinite_worst", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("_nonfinite_total", torch.zeros((), dtype=torch.long), persistent=False)
        self.model = TransformerXL(self.config)
        self.mems: dict[str, list[Tensor] | None] = dict.fromkeys(STAGES)
        # Evaluation stages also carry their memory's projected keys/values (the weights do not change there).
        self.kv: dict[str, list[tuple[Tensor, Tensor]] | None] = dict.fromkeys(STAGES)
        # Per stage: summed NLL, tokens and their UTF-8 bytes (reduced across ranks exactly), for the loss, the
        # unit's figure and bits per byte. No NaN checks inside: they would wait for the device every step.
        self.metrics = LMMetrics(unit)

    def setup(self, stage: str) -> None:
        """Count scored bytes with the data's byte-length table (none without a data module that has one)."""
        table = getattr(self.trainer.datamodule, "token_bytes", None)
        self.metrics.set_token_bytes(table, self.config.vocab_size)

    # ---- memory -------------------------------------------------------------------------------
    def reset_memory(self, stage: str) -> None:
        self.mems[stage] = self.kv[stage] = None

    def memory_for(self, stage: str, batch_rows: int) -> list[Tensor] | None:
        """This stage's memory, or None (empty) if its rows do not match the batch's."""
        mems = self.mems[stage]
        if mems is not None and mems[0].size(0) != batch_rows:
            rank_zero_warn(
                f"{stage} memory holds {mems[0].size(0)} rows but the batch has {batch_rows}; "
                "the streams changed, so the memory restarts empty"
            )
            self.reset_memory(stage)
            mems = None
        return mems

    def step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x, y = batch
        mems = self.memory_for(stage, x.size(0))
        context = {} if stage == "train" else self.eval_context
        if stage != "train" and not torch.is_grad_enabled():  # Lightning evaluates without gradients
            context = {**context, "cache_kv": True, "kv": self.kv[stage]}
        out = self.model(x, mems, targets=y, return_logits=False, **context)
        self.mems[stage], self.kv[stage] = out.mems, out.kv
        return out.loss

    def on_validation_epoch_start(self) -> None:
        self.reset_memory("val")

    def on_test_epoch_start(self) -> None:
        self.reset_memory("test")

    def on_predict_epoch_start(self) -> None:
        self.reset_memory("predict")

    # ---- steps and metrics ----------------------------------------------------------------------
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 0:
            # The streams restart at every epoch. Keyed on the batch index, not on epoch start, so that
            # a run resumed mid-epoch keeps the memory it restored from the checkpoint.
            self.reset_memory("train")
        loss = self.step(batch, "train")
        # Nothing here waits for the device: a non-finite loss is handled where it lands, without a
        # host-side branch. Its memory would poison every later step, so non-finite entries are zeroed
        # (in place, on memory the step just allocated); its gradients are non-finite, so the optimizer
        # skips the update (on_before_optimizer_step); the epoch metric leaves it out.
        for m in self.mems["train"]:
            m.nan_to_num_(0.0, 0.0, 0.0)
        values = self.metrics.update("train", loss, batch[1])
        self.log_dict(values, on_step=True, prog_bar=True, batch_size=batch[1].size(0))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip an update whose gradients are not finite, deciding on the device (no host sync).

        The fused AdamW kernel reads ``found_inf`` (the flag torch's GradScaler uses) and leaves weights,
        moments and step count untouched when it is set. Gradients are already reduced across ranks
        here, so every rank makes the same decision.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads or getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            # 16-mixed: the GradScaler skips overflowing steps itself and lowers its scale; a few in a row at
            # the start are how it finds the scale, not a fault.
            return
        bad = ~torch.isfinite(torch.nn.utils.get_total_norm(grads))
        optimizer.found_inf = bad.float()
        self._nonfinite_run = (self._nonfinite_run + 1) * bad
        self._nonfinite_worst = torch.maximum(self._nonfinite_worst, self._nonfinite_run)
        self._nonfinite_total = self._nonfinite_total + bad

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step % self.trainer.log_every_n_steps == 0:
            self.check_nonfinite()
            if self.nonfinite_total:
                self.log("train/nonfinite_steps", float(self.nonfinite_total))

    def on_train_end(self) -> None:
        self.check_nonfinite()

    def check_nonfinite(self) -> None:
        """Read the device-side counts of skipped steps (once per logging interval): warn, or stop the run."""
        total, worst = int(self._nonfinite_total), int(self._nonfinite_worst)
        if total > self.nonfinite_total:
            rank_zero_warn(f"{total - self.nonfinite_total} step(s) with a non-finite loss or gradient were skipped "
                           f"(found by step {self.global_step})")
            self.nonfinite_total = total
        self.nonfinite_in_row = int(self._nonfinite_run)
        if worst >= self.max_nonfinite_steps:
            raise NonFiniteError(
                f"non-finite loss or gradient for {worst} steps in a row (found by step {self.global_step}); "
                "the last good checkpoint is kept; lower optim.lr or set trainer.gradient_clip_val"
            )

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.metrics.update("val", self.step(batch, "val"), batch[1])

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.metrics.update("test", self.step(batch, "test"), batch[1])

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def predict_step(self, batch: tuple[Tensor, Tensor] | Tensor, batch_idx: int) -> Tensor:
        """Next-token log-probabilities for each segment, with the memory carried between calls."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        mems = self.memory_for("predict", x.size(0))
        out = self.model(x, mems, **self.eval_context, cache_kv=not torch.is_grad_enabled(), kv=self.kv["predict"])
        self.mems["predict"], self.kv["predict"] = out.mems, out.kv
        return out.logits.log_softmax(-1)

    def _log_epoch(self, stage: str) -> None:
        """Token-weighted mean NLL over the epoch (reduced across ranks), its bits or perplexity, bits per byte."""
        values = self.metrics.compute(stage)
        if values:
            self.log_dict(values, prog_bar=stage != "train", sync_dist=False)

    @property
    def quality_name(self) -> str:
        return quality_name(self.unit)

    def quality(self, nll: Tensor) -> Tensor:
        """Bits per byte/char, or perplexity per word/token, from a mean NLL in nats."""
        return quality(self.unit, nll)

    # ---- checkpoints ---------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the model config, every rank's training memory and the RNG states (see xl.checkpoint)."""
        mems = self.mems["train"]
        gathered = None
        if mems is not None:
            stacked = torch.stack(mems)  # [n_layer, B, M, d]
            # Every rank runs this hook; all_gather returns [world, n_layer, B, M, d] (no world dim on 1 rank).
            gathered = self.all_gather(stacked) if self.trainer.world_size > 1 else stacked[None]
            gathered = gathered.cpu()
        checkpoint["xl"] = {"model_config": self.config.to_dict(), "train_memory": gathered, "rng": rng_state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Give each rank back its own rows of the training memory, and restore the RNG states."""
        state = checkpoint.get("xl")
        if state is None:
            return
        memory = state["train_memory"]
        if memory is not None:
            world, rank = self.trainer.world_size, self.trainer.global_rank
            if memory.size(0) != world:
                raise CheckpointError(
                    f"the checkpoint's memory comes from {memory.size(0)} processes, this run has {world}; "
                    "resume with the same trainer.devices and trainer.num_nodes"
                )
            memory = list(memory[rank].to(self.device).unbind(0))
        self.mems["train"] = memory
        set_rng_state(state["rng"])

    # ---- set-up ---------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        if self.logger is None:
            return
        dm = self.trainer.datamodule
        batch = getattr(dm, "batch_size", None)
        dtype = self.model.config.memory_dtype(self.model.anchor.dtype)
        info: dict[str, Any] = {"model/params": sum(p.numel() for p in self.model.parameters())}
        if batch:
            cfg = self.config
            info["memory/cache_mb"] = cache_footprint(cfg.mem_len, cfg.d_model, cfg.n_layer, batch, dtype).mb
        self.logger.log_hyperparams(info)

    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        o = self.optim
        # Fused: one kernel for all parameters (on CPU, ~6x faster than the default foreach step at config S),
        # and it honours the on-device skip of non-finite steps (on_before_optimizer_step).
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=o.betas, eps=o.eps, fused=True,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, o.warmup_steps, total, o.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
