"""What only a GPU can show, as checks that the tests in this folder run: real Lightning Trainers built from the
project's Hydra config by :func:`xl.training.build.build_run`, on a small corpus written to a temporary folder.

- precision: training steps with gradient clipping under bf16-mixed, 16-mixed and 32-true; the losses are finite,
  the clipped gradient norm stays within ``trainer.gradient_clip_val`` and the weights change;
- resume: N steps straight against N/2, a stop mid-epoch and a resume from ``last.ckpt`` for N/2: identical weights
  (bitwise where two straight runs are; else within 10x their own difference);
- eval memory: validation's memory and cached keys/values are released when it ends, and the CUDA memory allocated
  falls back;
- decoding: one-token decoding (:func:`xl.generation.generate`) picks, in float32, what the forward pass over the whole
  text picks;
- compressive memory: training with the learned compressor and document masks over compressed slots, then its
  one-token decoder fills the compressed memory;
- throughput: the GPU benchmark (``python -m xl.bench.gpu``), briefly, config S and enwik8_base.

Each check returns a :class:`Result` (PASS/FAIL and the figures it measured). The ``cpu`` plan runs the same code on
the CPU at tiny sizes (16-mixed, CUDA-only, is left out): the dry run of the default suite.
"""

from __future__ import annotations

import gc
import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from xl.bench.gpu import measure, peak_tflops
from xl.config.compose import compose
from xl.generation import generate
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.build import build_run

CLIP_SLACK = 1e-3  # relative: clip_grad_norm_ scales to clip / (norm + 1e-6), a hair under the clip value
DECODE_TOLERANCE = 1e-4  # float32 logits of the cached decoder against the full forward, relative to their scale
MiB = 2**20


@dataclass(frozen=True)
class Plan:
    """The sizes of every check on one kind of device."""

    device: str
    precisions: tuple[str, ...]
    train_steps: int
    resume_steps: int  # stopped after half of them; epochs of 4 segments, so the stop falls mid-epoch
    run_precision: str  # of the resume and eval-memory checks
    # Validation reads eval_rows streams of the ~33 KB val split for val_batches segments of 16, enough to fill an
    # eval_mem_len memory: what the eval-memory check sees released.
    eval_rows: int
    eval_mem_len: int
    val_batches: int
    bench: tuple[tuple[str, tuple[str, ...], int | None], ...]  # (experiment, FIELD=VALUE overrides, batch)
    bench_precision: str
    bench_steps: int


PLANS = {
    "cuda": Plan("cuda", ("bf16-mixed", "16-mixed", "32-true"), train_steps=30, resume_steps=12,
                 run_precision="bf16-mixed", eval_rows=64, eval_mem_len=256, val_batches=24,
                 bench=(("S", (), None), ("enwik8_base", (), None)), bench_precision="bf16-mixed", bench_steps=10),
    "cpu": Plan("cpu", ("bf16-mixed", "32-true"), train_steps=4, resume_steps=6, run_precision="32-true",
                eval_rows=8, eval_mem_len=64, val_batches=8,
                bench=(("S", ("n_layer=1", "d_model=64", "d_head=16", "d_inner=128"), 2),
                       ("enwik8_base", ("n_layer=1", "d_model=64", "n_head=2", "d_head=32", "d_inner=128"), 1)),
                bench_precision="32-true", bench_steps=1),
}


@dataclass
class Result:
    status: str  # PASS, FAIL or SKIP
    detail: str


@dataclass
class Context:
    plan: Plan
    folder: Path
    corpus: dict[str, Path] = field(default_factory=dict)
    runs: int = 0

    def compose(self, *overrides: str) -> Any:
        """The project's config for a small run of its own folder on the corpus, quiet, no logger, no test."""
        self.runs += 1
        c = self.corpus
        trainer = "gpu" if self.plan.device == "cuda" else "cpu"
        return compose("config", [
            "model=tiny", "data=text", "logger=none", "test=false", f"trainer={trainer}",
            f"data.train={c['train']}", f"data.val={c['val']}", f"data.test={c['test']}",
            f"data.cache_dir={self.folder / 'cache'}", f"paths.output_dir={self.folder / f'run{self.runs}'}",
            "data.batch_size=4", "data.tgt_len=16", "memory.mem_len=16", "trainer.limit_val_batches=2",
            "trainer.log_every_n_steps=1", "trainer.num_sanity_val_steps=0", "+trainer.enable_model_summary=false",
            "~callbacks.progress_bar", "+trainer.enable_progress_bar=false", *overrides,
        ])


def write_corpus(folder: Path) -> dict[str, Path]:
    """About 330 KB of real text (a few standard-library modules' sources), split 80/10/10 into three files."""
    import argparse as argparse_module
    import dataclasses
    import json.decoder
    import json.encoder
    import textwrap

    modules = (argparse_module, dataclasses, inspect, textwrap, json.decoder, json.encoder)
    text = "".join(inspect.getsource(m) for m in modules)
    n = len(text)
    parts = {"train": text[: int(0.8 * n)], "val": text[int(0.8 * n): int(0.9 * n)], "test": text[int(0.9 * n):]}
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in parts.items():
        paths[split] = folder / f"{split}.txt"
        paths[split].write_text(part, encoding="utf-8")
    return paths


def grad_norm(optimizer: torch.optim.Optimizer) -> Tensor:
    """Total 2-norm of the gradients the optimizer is about to apply (a device tensor: nothing waits)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).float()


class TrainingRecorder(L.Callback):
    """Losses, and the gradient norm before clipping (``on_before_optimizer_step``, where Lightning has unscaled
    16-mixed gradients and not yet clipped) and after it (a step pre-hook: what the optimizer applies)."""

    def __init__(self) -> None:
        self.losses: list[Tensor] = []
        self.raw: list[Tensor] = []
        self.clipped: list[Tensor] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.clipped.append(grad_norm(opt)))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.raw.append(grad_norm(optimizer))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach().float())


def weights(module: L.LightningModule) -> dict[str, Tensor]:
    """A CPU copy of the model's weights."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.model.state_dict().items()}


def max_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def fit_recorded(ctx: Context, *overrides: str) -> tuple[Any, TrainingRecorder, dict[str, Tensor], dict[str, Tensor]]:
    """A run of ``train_steps`` steps: the run, its recorded losses and gradient norms, the weights before and after."""
    steps = ctx.plan.train_steps
    run = build_run(ctx.compose(*overrides, f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"))
    recorder = TrainingRecorder()
    run.trainer.callbacks.append(recorder)
    before = weights(run.module)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return run, recorder, before, weights(run.module)


def check_precision(ctx: Context, precision: str) -> Result:
    """Train with clipping; the losses are finite, the applied gradient is clipped, the weights change."""
    run, recorder, before, after = fit_recorded(ctx, f"precision={precision}")
    clip = float(run.trainer.gradient_clip_val)
    losses = torch.stack(recorder.losses).cpu()
    # 16-mixed: the scaler skips the steps that overflow while it finds its scale; only finite norms count.
    raw, applied = (torch.stack(norms).cpu() for norms in (recorder.raw, recorder.clipped))
    raw, applied = raw[raw.isfinite()], applied[applied.isfinite()]
    change = max_difference(before, after)
    detail = (f"{len(losses)} steps, loss {losses[0]:.3f} → {losses[-1]:.3f}, gradient norm {raw.max():.3g} at most "
              f"before clipping and {applied.max():.4f} at most after (clip {clip}), max |Δw| {change:.2g}")
    problems = []
    if not losses.isfinite().all() or len(losses) != ctx.plan.train_steps:
        problems.append("a non-finite loss or a missing step")
    if not applied.numel() or applied.max() > clip * (1 + CLIP_SLACK):
        problems.append("the applied gradient exceeds the clip value")
    if not raw.max() > clip:
        problems.append("clipping never engaged")
    if not all(v.isfinite().all() for v in after.values()) or not change > 0:
        problems.append("the weights are not finite or did not change")
    return Result("FAIL" if problems else "PASS", "; ".join(problems + [detail]))


def check_resume(ctx: Context) -> Result:
    """N steps straight (twice) against N/2 + a resume for N/2, on the same corpus and seed."""
    try:
        return resume(ctx, deterministic=True)
    except RuntimeError as err:  # an op without a deterministic kernel on this device
        if "determinis" not in str(err):
            raise
        result = resume(ctx, deterministic=False)
        result.detail += f" (deterministic algorithms refused: {str(err).splitlines()[0][:120]})"
        return result


def resume(ctx: Context, deterministic: bool) -> Result:
    n = ctx.plan.resume_steps
    common = ("model.dropout=0.1", "trainer.limit_train_batches=4", "trainer.val_check_interval=3",
              f"precision={ctx.plan.run_precision}", "callbacks.model_checkpoint.monitor=null",
              f"callbacks.model_checkpoint.every_n_train_steps={n // 2}", f"trainer.deterministic={deterministic}")

    def fit(*overrides: str) -> tuple[dict[str, Tensor], Path]:
        cfg = ctx.compose(*common, *overrides)
        run = build_run(cfg)
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
        return weights(run.module), Path(cfg.paths.output_dir)

    straight, _ = fit(f"trainer.max_steps={n}")
    again, _ = fit(f"trainer.max_steps={n}")
    _, first = fit(f"trainer.max_steps={n // 2}")
    resumed, _ = fit(f"trainer.max_steps={n}", f"ckpt_path={first}")
    diff, noise = max_difference(straight, resumed), max_difference(straight, again)
    what = f"{n} steps straight against {n // 2} + resume from last.ckpt for {n // 2}, {ctx.plan.run_precision}"
    if noise == 0:
        return Result("PASS" if diff == 0 else "FAIL", f"{what}: max |Δw| {diff:.3g} (two straight runs: equal)")
    # Two identical runs already differ (non-deterministic kernels): the resume must not differ by much more.
    ok = diff <= 10 * noise
    return Result("PASS" if ok else "FAIL", f"{what}: max |Δw| {diff:.3g}, two straight runs differ by {noise:.3g} "
                                            "(non-deterministic kernels; limit 10× that)")


class HeldBytes(L.Callback):
    """The most bytes the validation memory (and its keys/values) held after any validation batch."""

    def __init__(self) -> None:
        self.most = 0

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self.most = max(self.most, pl_module.memory.nbytes("val"))


def check_eval_memory(ctx: Context) -> Result:
    """After ``trainer.validate`` the val memory holds nothing and CUDA memory is back where it was."""
    p = ctx.plan
    cfg = ctx.compose(f"data.eval_batch_size={p.eval_rows}", f"memory.eval_mem_len={p.eval_mem_len}",
                      f"trainer.limit_val_batches={p.val_batches}", f"precision={p.run_precision}")
    run = build_run(cfg)
    held = HeldBytes()
    run.trainer.callbacks.append(held)
    cuda = p.device == "cuda"
    gc.collect()
    before = torch.cuda.memory_allocated() if cuda else 0
    run.trainer.validate(run.module, datamodule=run.datamodule, verbose=False)
    left = run.module.memory.nbytes("val")
    detail = f"validation held up to {held.most / MiB:.2f} MiB, {left} bytes after"
    problems = [] if held.most > 0 else ["validation held no memory (the check measured nothing)"]
    if left:
        problems.append("the val memory was not released")
    if cuda:
        # The module is back on the CPU after validate; what stays allocated on the GPU is what nothing freed.
        gc.collect()
        grown = torch.cuda.memory_allocated() - before
        detail += f"; CUDA memory allocated {grown / MiB:+.2f} MiB over the level before validate"
        if grown > held.most / 4:
            problems.append("CUDA memory did not fall back")
    return Result("FAIL" if problems else "PASS", "; ".join(problems + [detail]))


def check_decoding(ctx: Context) -> Result:
    """Greedy tokens of the cached decoder are the argmax (within tolerance) of a float32 forward over the text."""
    device = torch.device(ctx.plan.device)
    torch.manual_seed(0)
    cfg = XLConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, d_head=32, d_inner=512, dropout=0.0, mem_len=64)
    model = TransformerXL(cfg).to(device).float().eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
    window = cfg.mem_len
    n = window + 1 - prompt.size(1)  # prompt and samples fit the window: the full forward sees the same context
    with full_float32():
        new = generate(model, prompt, n, window, seg_len=8, temperature=0)
        with torch.no_grad():
            logits = model(torch.cat([prompt, new], 1), mem_len=0).logits[:, prompt.size(1) - 1:-1].float()
    gap = (logits.max(-1).values - logits.gather(-1, new[..., None])[..., 0]).max().item()
    limit = DECODE_TOLERANCE * max(1.0, logits.abs().max().item())
    detail = (f"{n} greedy tokens × {prompt.size(0)} rows (prompt {prompt.size(1)}, segments of 8, window {window}): "
              f"the chosen token is at most {gap:.2g} below the forward's best logit (limit {limit:.2g})")
    return Result("PASS" if gap <= limit else "FAIL", detail)


def check_compressive(ctx: Context) -> Result:
    """Train a compressive memory (the learned compressor, every line a document, so that the document masks hide
    compressed slots); the losses are finite and the compressor learns; then its decoder fills its slots."""
    run, recorder, before, after = fit_recorded(ctx, f"precision={ctx.plan.run_precision}", "memory=compressive",
                                                "memory.mem_len=16", "memory.cmem_len=16", "data.doc_sep='.*'",
                                                "data.doc_sep_regex=true")
    losses = torch.stack(recorder.losses).cpu()
    recon = float(run.trainer.callback_metrics.get("train/recon_loss", math.nan))
    learned = max_difference({k: v for k, v in before.items() if k.startswith("compressor.")},
                             {k: v for k, v in after.items() if k.startswith("compressor.")})
    model = run.module.model.eval()
    mem = model.config
    decoder = model.decoder(2)
    text = torch.randint(0, mem.vocab_size, (2, 3 * (mem.mem_len + mem.memory.cmem_rate * mem.memory.cmem_len)),
                         generator=torch.Generator().manual_seed(2)).to(model.device)
    logits = decoder.prefill(text[:, :32], seg_len=16)
    for t in range(32, text.size(1)):
        logits = decoder.feed(text[:, t])
    detail = (f"{ctx.plan.run_precision}, {len(losses)} steps, loss {losses[0]:.3f} → {losses[-1]:.3f}, "
              f"reconstruction loss {recon:.3g}, compressor max |Δw| {learned:.2g}; decoder: {decoder.slots} slots "
              f"after {text.size(1)} tokens")
    problems = []
    if not losses.isfinite().all() or len(losses) != ctx.plan.train_steps or not math.isfinite(recon):
        problems.append("a non-finite loss or reconstruction loss, or a missing step")
    if not learned > 0:
        problems.append("the compressor did not learn")
    if decoder.slots != mem.memory.cmem_len or not logits.isfinite().all():
        problems.append("the decoder's compressed memory is not full or its logits are not finite")
    return Result("FAIL" if problems else "PASS", "; ".join(problems + [detail]))


@contextmanager
def full_float32() -> Iterator[None]:
    """float32 matmuls in full precision (no TF32) for a comparison, restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def check_throughput(ctx: Context, experiment: str, overrides: tuple[str, ...], batch: int | None) -> Result:
    """A brief run of the GPU benchmark; its figures are printed, its training loss must stay finite."""
    device = torch.device(ctx.plan.device)
    _, peak = peak_tflops(device)
    cfg, batch, tgt_len, r = measure(experiment, ctx.plan.bench_precision, device, ctx.plan.bench_steps, 3,
                                     batch, overrides, peak=peak)
    detail = (f"{ctx.plan.bench_precision}, n_layer {cfg.n_layer}, d_model {cfg.d_model}, batch {batch}, "
              f"tgt_len {tgt_len}, mem_len {cfg.mem_len}: {r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms']:.1f} "
              f"ms, {r['tflops']:.1f} TFLOP/s")
    if math.isfinite(r["mfu"]):
        detail += f", MFU {r['mfu']:.1%}"
    if math.isfinite(r["peak_gib"]):
        detail += f", peak memory {r['peak_gib']:.2f} GiB"
    ok = math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
    return Result("PASS" if ok else "FAIL", detail + f", last loss {r['loss']:.3f}")
