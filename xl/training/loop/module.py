"""The LightningModule: Transformer-XL's training loop (Dai et al., 2019), one segment per batch.

Each batch is the next segment of every stream (see ``xl.data.stream``). A step reads the stage's memory, runs
the segment over ``StopGrad(memory) ∘ segment``, and writes the new memory back for the next step (truncated
BPTT: the forward context crosses the segment boundary, gradients do not). The memory itself, one per stage and
per rank, lives in :class:`xl.memory.store.MemoryStore`: plain attributes, not buffers, so DDP never broadcasts rank 0's
copy over the other ranks' rows.

With ``grad_segments`` k > 1 (``memory.grad_segments``) gradients cross segment boundaries inside windows of k
segments, as the Recurrent Memory Transformer trains its memory (Bulatov et al., 2022): TBPTT(k, k), all of it in
:mod:`xl.training.loop.window`. A non-finite loss or gradient is handled by :mod:`xl.training.loop.nonfinite`'s policy.
Both
act through Lightning's automatic optimization and its public hooks.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from xl.config.rules import eval_key
from xl.config.schema import OptimConfig
from xl.data.metrics import LMMetrics, quality, quality_name
from xl.device.footprint import memory_bytes
from xl.memory.store import MemoryStore, packed_size
from xl.model.config import XLConfig
from xl.model.documents import Documents, split_batch, target_bytes
from xl.model.transformer import TransformerXL, XLOutput
from xl.training.checkpoints.checkpoint import XL_KEY, CheckpointError, gather_rng_states, set_rng_state
from xl.training.loop.nonfinite import NonFiniteSteps
from xl.training.loop.optim import adamw, clip, warmup_cosine_schedule
from xl.training.loop.window import GradientWindow

log = logging.getLogger(__name__)


def memory_key(name: str) -> str:
    return f"memory.{name}"


def batch_rows(batch: tuple[Tensor, ...]) -> int:
    """Rows (streams) in a segment batch, for Lightning's ThroughputMonitor."""
    return batch[0].size(0)


def batch_tokens(batch: tuple[Tensor, ...]) -> int:
    """Tokens in a segment batch, so that throughput is reported in tokens/s."""
    return batch[0].numel()


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
        doc_boundaries: str = "ignore",
        grad_segments: int = 1,
    ) -> None:
        """``doc_boundaries``: ``reset`` hides other documents' tokens from every query (:mod:`xl.model.documents`);
        ``ignore`` reads each stream as one text (and is what a checkpoint without the setting was trained with)."""
        super().__init__()
        self.save_hyperparameters()
        self.config = XLConfig.from_dict(dict(model))  # the model's rules, its training context's among them
        # The training context and the evaluation's, each checked here, where it is made: refused now, not by the
        # first forward, which trusts them.
        self.context = self.config.context(doc_boundaries=doc_boundaries, grad_segments=grad_segments).check(
            self.config.memory, memory_key)
        self.eval_context = self.context.evaluated(
            {"mem_len": eval_mem_len, "clamp_len": eval_clamp_len, "same_length": eval_same_length}).check(
            self.config.memory, eval_key)
        self.window = GradientWindow(grad_segments)  # gradients through windows of segments: xl.training.loop.window
        self.optim = OptimConfig(**(optim or {}))
        self.unit = unit
        self.nonfinite = NonFiniteSteps(max_nonfinite_steps)  # the non-finite policy: xl.training.loop.nonfinite
        if doc_boundaries == "reset" and 0 in (self.config.mem_len, self.eval_context.mem_len):
            log.info("memory.doc_boundaries=reset with a memory length of 0: only earlier documents inside the same "
                     "segment are hidden")
        self.model = TransformerXL(self.config)
        self.memory = MemoryStore()
        self.tokenizer_fingerprint: str | None = None  # the data module's, from setup; saved in checkpoints
        self.data_identity: dict[str, str] | None = None  # the data module's identity, from setup; likewise
        self.train_tgt_len: int | None = None  # the training segment length, from setup; likewise
        # Per stage: summed NLL, tokens and their UTF-8 bytes (reduced across ranks exactly), for the loss, the
        # unit's figure and bits per byte (an unknown unit is refused there). No NaN checks inside: they would wait
        # for the device every step.
        self.metrics = LMMetrics(unit)

    @property
    def grad_segments(self) -> int:
        """Segments per gradient window (the training context's)."""
        return self.context.grad_segments

    @property
    def doc_boundaries(self) -> str:
        """reset or ignore (the training context's; evaluation's is the same)."""
        return self.context.doc_boundaries

    # ---- one segment ----------------------------------------------------------------------------
    def run_segment(self, x: Tensor, stage: str, targets: Tensor | None = None,
                    documents: Documents | None = None, detach_memory: bool = True) -> XLOutput:
        """Run the next segment of the stage's streams over its memory; keep the new memory for the next one.

        With ``targets`` only the loss is returned (the logits are freed), else only the logits. ``documents``:
        where the rows' documents begin, honoured with ``doc_boundaries=reset``. ``detach_memory=False`` keeps the
        new memory in the graph (inside a window of ``grad_segments``).
        """
        model = self.model  # the memory follows the model to its device and storage dtype
        mems, kv = self.memory.read(stage, x.size(0), model.device, self.config.memory_dtype(model.dtype),
                                    rank_zero_warn)
        context = {} if stage == "train" else self.eval_context.attention()
        if stage != "train" and not torch.is_grad_enabled():  # Lightning evaluates without gradients
            context = {**context, "cache_kv": True, "kv": kv}
        if self.doc_boundaries == "reset":
            context = {**context, "documents": documents}
        out = self.model(x, mems, targets=targets, return_logits=targets is None, detach_memory=detach_memory,
                         **context)
        self.memory.write(stage, out.mems, out.kv)
        return out

    def segment_loss(self, batch: tuple[Tensor, ...], stage: str, detach_memory: bool = True) -> Tensor:
        x, y, documents = split_batch(batch)
        return self.run_segment(x, stage, y, documents, detach_memory).loss

    def on_validation_epoch_start(self) -> None:
        self.memory.reset("val")

    def on_test_epoch_start(self) -> None:
        self.memory.reset("test")

    def on_predict_epoch_start(self) -> None:
        self.memory.reset("predict")

    # ---- steps and metrics ----------------------------------------------------------------------
    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        if batch_idx == 0:
            # The streams restart at every epoch. Keyed on the batch index, not on epoch start, so that
            # a run resumed mid-epoch keeps the memory and the epoch's loss sums it restored from the checkpoint.
            self.memory.reset("train")
            self.metrics.sums["train_nll"].reset()
        closes = self.window.open_segment(batch_idx, self.trainer)
        x, y, documents = split_batch(batch)
        out = self.run_segment(x, "train", y, documents, detach_memory=closes)
        loss = out.loss
        # Nothing here waits for the device: a non-finite loss is handled where it lands, without a
        # host-side branch. Its memory would poison every later step, so non-finite entries are zeroed
        # (in place, on memory the step just allocated); its gradients are non-finite, so the optimizer
        # skips the update (on_before_optimizer_step); the epoch metric leaves it out. Not recorded by
        # autograd: inside a window (grad_segments > 1) it would save a copy of the memory for the backward.
        with torch.no_grad():
            for m in self.memory.mems["train"]:
                m.nan_to_num_(0.0, 0.0, 0.0)
        self.nonfinite.loss(loss)
        values = self.metrics.update("train", loss, batch[1], target_bytes(batch))
        self.log_dict(values, on_step=True, prog_bar=True, batch_size=batch[1].size(0))
        self.step_figures = values
        if out.aux_loss is None:
            return loss
        # The memory's own loss, logged under the name its variant gives it; one backward of the sum trains both.
        name = f"train/{self.model.memory.settings.loss_name}"
        self.log(name, out.aux_loss.detach(), on_step=True, batch_size=batch[1].size(0))
        self.step_figures = {**values, name: out.aux_loss.detach()}
        return loss + out.aux_loss

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagated when its window of ``grad_segments`` closes (:class:`GradientWindow`)."""
        self.window.backward(loss, lambda total: super(XLLitModule, self).backward(total, *args, **kwargs))

    def setup(self, stage: str) -> None:
        """Count scored bytes with the data's byte-length table and ``<unk>`` id (none without a data module that
        has them). With
        ``grad_segments`` k > 1, fitting: the trainer accumulates k times its own setting for this fit, so that
        the optimizer steps once per window (once per ``accumulate_grad_batches`` windows)."""
        datamodule = self.trainer.datamodule
        self.metrics.set_token_bytes(getattr(datamodule, "token_bytes", None), self.config.vocab_size,
                                     getattr(datamodule, "unk_id", None))
        self.tokenizer_fingerprint = getattr(datamodule, "tokenizer_fingerprint", None)
        self.data_identity = getattr(datamodule, "identity", None)  # saved in checkpoints
        self.train_tgt_len = getattr(datamodule, "tgt_len", None)  # likewise (decoding reads in these segments)
        if stage == "fit":
            self.window.start_fit(self.trainer)

    def teardown(self, stage: str) -> None:
        if stage == "fit":
            self.window.end_fit()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.nonfinite.before_optimizer_step(list(self.model.parameters()), optimizer,
                                             getattr(self.trainer.precision_plugin, "scaler", None))

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip as Lightning would (``trainer.gradient_clip_val``, ``gradient_clip_algorithm``). Lightning's
        mixed-precision plugin refuses to clip for an optimizer that unscales its gradients inside its step (the fused
        AdamW), scaler or not; with no GradScaler (32-true, bf16) there is nothing to unscale, so the gradients are
        clipped here with torch's own functions. Under 16-mixed the optimizer is not fused and Lightning clips, after
        the scaler has unscaled the gradients."""
        if not gradient_clip_val:
            return
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        params = (p for group in optimizer.param_groups for p in group["params"])
        clip(params, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step % self.trainer.log_every_n_steps == 0:
            self.nonfinite.check(self.global_step)
            if self.nonfinite.total:
                self.log("train/nonfinite_steps", float(self.nonfinite.total))

    def on_train_end(self) -> None:
        mems = self.memory.mems["train"]
        if self.window.drop() and mems is not None:  # a fit stopped inside a window (a signal): free its graph
            self.memory.write("train", [m.detach() for m in mems])
        self.nonfinite.check(self.global_step)

    def on_train_epoch_end(self) -> None:
        self.log_epoch("train")

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self.metrics.update("val", self.segment_loss(batch, "val"), batch[1], target_bytes(batch))

    def on_validation_epoch_end(self) -> None:
        self.memory.reset("val")  # evaluation memories can be far longer than training's: free them now
        self.log_epoch("val")

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self.metrics.update("test", self.segment_loss(batch, "test"), batch[1], target_bytes(batch))

    def on_test_epoch_end(self) -> None:
        self.memory.reset("test")
        self.log_epoch("test")

    def on_predict_epoch_end(self) -> None:
        self.memory.reset("predict")

    def predict_step(self, batch: tuple[Tensor, ...] | Tensor, batch_idx: int) -> Tensor:
        """Next-token log-probabilities for each segment, with the memory carried between calls."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        documents = batch[-1] if isinstance(batch, (tuple, list)) and isinstance(batch[-1], Documents) else None
        return self.run_segment(x, "predict", documents=documents).logits.log_softmax(-1)

    def log_epoch(self, stage: str) -> None:
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
        """Add the model config, the tokenizer's fingerprint, and every rank's training memory, RNG states and sums
        of the epoch's training loss so far (see xl.training.checkpoints.checkpoint)."""
        world = self.trainer.world_size
        checkpoint[XL_KEY] = {
            "model_config": self.config.to_dict(),
            "tokenizer": self.tokenizer_fingerprint,
            "data": self.data_identity,
            "train_tgt_len": self.train_tgt_len,
            "train_memory": self.memory.pack(self.all_gather, world),
            "rng": gather_rng_states(world),
            "train_sums": self.gather_train_sums(world),
            "step_row": self.step_row(),
        }

    def step_row(self) -> dict[str, float] | None:
        """The metric row of the step a checkpoint ends (None when the step logs none). Lightning sends it to the
        loggers after the checkpoints of the step are written, so a kill between the two would lose it: the checkpoint
        keeps it, and a resume from it writes it when the history lacks it (xl.training.services.loggers.CSVLogger)."""
        trainer, figures = self.trainer, getattr(self, "step_figures", None)
        if figures is None or trainer.state.fn != TrainerFn.FITTING or trainer.global_step % trainer.log_every_n_steps:
            return None
        values = {k: float(v) for k, v in figures.items()}
        return {"step": trainer.global_step - 1, "epoch": trainer.current_epoch, **values}

    def gather_train_sums(self, world: int) -> dict[str, Tensor]:
        """Every rank's sums of the epoch's training loss (the epoch metric's states), [world] each."""
        states = self.metrics.sums["train_nll"].metric_state
        return {name: value[None] if world == 1 else self.all_gather(value) for name, value in states.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resuming a fit: give each rank back its own rows of the training memory, its RNG states and its sums of the
        epoch's loss so far.

        Nothing else needs them: evaluating or testing a checkpoint (on any number of devices), or
        ``load_from_checkpoint`` without a trainer, reads the weights only and leaves the global RNGs alone. The
        memory stays on the CPU here (Lightning moves the module after this hook); the first step moves it.
        """
        state = checkpoint.get(XL_KEY)
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer (load_from_checkpoint)
            return
        if state is None or trainer.state.fn != TrainerFn.FITTING:
            return
        world, rank = trainer.world_size, trainer.global_rank
        memory, rng = state["train_memory"], state["rng"]
        rng = rng if isinstance(rng, list) else [rng]  # one process's states
        processes = None if memory is None else packed_size(memory)[0]
        for what, count in (("memory", processes), ("random states", len(rng))):
            if count is not None and count != world:
                raise CheckpointError(
                    f"the checkpoint's {what} come from {count} processes, this run has {world}; "
                    "resume with the same trainer.devices and trainer.num_nodes"
                )
        self.memory.unpack(memory, rank)
        set_rng_state(rng[rank])
        sums = state.get("train_sums")
        if sums:  # the epoch so far: its epoch-level train/loss averages the whole epoch
            self.metrics.sums["train_nll"].merge_state({name: value[rank] for name, value in sums.items()})

    # ---- set-up ---------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        if self.logger is None:
            return
        dm = self.trainer.datamodule
        batch = getattr(dm, "batch_size", None)
        dtype = self.model.config.memory_dtype(self.model.dtype)
        info: dict[str, Any] = {"model/params": sum(p.numel() for p in self.model.parameters())}
        if batch:
            seg_len = getattr(dm, "tgt_len", None)
            info["memory/cache_mb"] = memory_bytes(self.config, self.config.mem_len, batch, dtype, seg_len) / 2**20
        self.logger.log_hyperparams(info)

    def configure_optimizers(self) -> dict[str, Any]:
        scaled = getattr(self.trainer.precision_plugin, "scaler", None) is not None
        optimizer = adamw(self.model, self.optim, scaled)
        scheduler = warmup_cosine_schedule(optimizer, self.optim, max(1, int(self.trainer.estimated_stepping_batches)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
