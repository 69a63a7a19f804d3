"""Truncated BPTT over k segments (memory.grad_segments; Bulatov et al., 2022)."""

from __future__ import annotations

import json
import signal
import sys
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.conftest import compose_config, tiny_overrides
from tests.helpers.reference import reference_attention
from xl.config.compose import compose
from xl.config.rules import ConfigError
from xl.device.footprint import segment_activation_bytes
from xl.model import attention
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.build import build_run
from xl.training.loop.module import XLLitModule
from xl.training.loop.optim import warmup_cosine

TINY = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, mem_len=8)


def stream_segments(rows: int, seg_len: int, count: int, vocab: int, seed: int = 0) -> list[tuple]:
    """``count`` consecutive segments (inputs, next-token targets) of ``rows`` random token streams."""
    tokens = torch.randint(0, vocab, (rows, seg_len * count + 1), generator=torch.Generator().manual_seed(seed))
    return [(tokens[:, i * seg_len:(i + 1) * seg_len], tokens[:, i * seg_len + 1:(i + 1) * seg_len + 1])
            for i in range(count)]


class LossLog(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


K1_STEPS, K1_SEGMENTS = 8, 5  # two epochs: the memory restarts with the streams at the second


def k1_module(**module_kwargs: Any) -> XLLitModule:
    L.seed_everything(0, verbose=False)
    return XLLitModule(model={**TINY, "dropout": 0.1}, optim=dict(lr=3e-3, warmup_steps=2, min_lr_ratio=0.1),
                       **module_kwargs)


def k1_loader() -> DataLoader:
    return DataLoader(stream_segments(4, 8, K1_SEGMENTS, TINY["vocab_size"]), batch_size=None)


def k1_run(**module_kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A short fit through Lightning (dropout, clipping, warm-up, an epoch boundary): its per-segment losses and
    final weights."""
    module = k1_module(**module_kwargs)
    log = LossLog()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=K1_STEPS, gradient_clip_val=0.25, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, deterministic=True, callbacks=[log])
    trainer.fit(module, k1_loader())
    return log.losses, module.state_dict()


def plain_tbptt_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same fit written out by hand, Transformer-XL's loop without the option: one segment, one backward, one
    clipped AdamW step; the memory carried detached between segments and emptied at each epoch's start."""
    module = k1_module()
    model, o = module.model.train(), module.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=o.betas, eps=o.eps,
                                  fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, o.warmup_steps, K1_STEPS, o.min_lr_ratio))
    losses: list[float] = []
    loader = k1_loader()
    while len(losses) < K1_STEPS:
        mems = None
        for x, y in loader:
            optimizer.zero_grad()
            out = model(x, mems, targets=y, return_logits=False)
            mems = out.mems
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(decay + no_decay, 0.25)  # in the optimizer's order, as Lightning
            optimizer.step()
            schedule.step()
            losses.append(out.loss.item())
            if len(losses) == K1_STEPS:
                break
    return losses, module.state_dict()


def test_one_segment_windows_train_exactly_as_the_plain_loop():
    """k = 1 (the default, and given explicitly) trains bit for bit as the hand-written loop without the option,
    both computed here: the same losses and the same final weights."""
    want_losses, want_weights = plain_tbptt_run()
    for kwargs in ({}, {"grad_segments": 1}):
        losses, weights = k1_run(**kwargs)
        assert [x.hex() for x in losses] == [x.hex() for x in want_losses]
        assert weights.keys() == want_weights.keys()
        assert all(torch.equal(weights[name], want_weights[name]) for name in weights), kwargs


# ---- gradients against the unrolled reference ----------------------------------------------------------------
SMALL = dict(vocab_size=16, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, dropout=0.0, mem_len=6)


class StepRecorder(L.Callback):
    """Per optimizer step: the weights it starts from and the gradients it applies (before clipping)."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.accumulation: int | None = None

    def on_train_start(self, trainer, module):
        self.accumulation = trainer.accumulate_grad_batches

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.weights.append({n: p.detach().clone() for n, p in module.model.named_parameters()})
        self.grads.append({n: p.grad.clone() for n, p in module.model.named_parameters()})


def windows_of(n_segments: int, k: int, accumulate: int) -> list[list[list[int]]]:
    """Optimizer steps of one epoch, each a list of windows of segment indices."""
    groups = [list(range(i, min(i + k * accumulate, n_segments))) for i in range(0, n_segments, k * accumulate)]
    return [[g[i:i + k] for i in range(0, len(g), k)] for g in groups]


def unrolled_gradients(config: dict, weights: list[dict], segments: list[tuple], steps: list[list[list[int]]],
                       k: int, accumulate: int) -> list[dict[str, torch.Tensor]]:
    """Slow reference: each window unrolled by hand over the full history of every layer's inputs, which stays in
    the graph inside a window and is cut at each window's start; score-by-score attention (tests.helpers.reference)."""
    model = TransformerXL(XLConfig(**config)).double()
    mem_len = config["mem_len"]
    history = [torch.zeros(segments[0][0].size(0), 0, config["d_model"], dtype=torch.float64)] * config["n_layer"]
    grads = []
    for step_weights, windows in zip(weights, steps, strict=True):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(step_weights[name])
        model.zero_grad()
        total = 0.0
        for window in windows:
            history = [h.detach() for h in history]
            for t in window:
                x, y = segments[t]
                h = model.embed(x) * model.emb_scale
                for n, layer in enumerate(model.layers):
                    mem = history[n][:, max(0, history[n].size(1) - mem_len):]
                    history[n] = torch.cat([history[n], h], 1)
                    h = layer.ff(reference_attention(layer.attn, h, mem))
                logits = model.head(model.final_norm(h))
                total = total + F.cross_entropy(logits.flatten(0, 1), y.flatten())
        (total / (k * accumulate)).backward()  # Lightning divides every loss by the accumulation
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return grads


def small_fit(k: int, segments: list[tuple], *callbacks: L.Callback, accumulate: int = 1, pre_lnorm: bool = False,
              precision: str = "64-true") -> tuple[XLLitModule, L.Trainer]:
    """One epoch over ``segments`` with windows of ``k``."""
    L.seed_everything(0, verbose=False)
    module = XLLitModule(model={**SMALL, "pre_lnorm": pre_lnorm}, optim=dict(lr=1e-2), grad_segments=k)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision=precision, logger=False,
                        accumulate_grad_batches=accumulate, gradient_clip_val=0.25, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=list(callbacks))
    trainer.fit(module, DataLoader(segments, batch_size=None))
    return module, trainer


@pytest.mark.parametrize(("k", "accumulate", "pre_lnorm"), [(1, 1, False), (2, 1, False), (3, 1, False),
                                                            (2, 2, True)])
def test_window_gradients_equal_the_unrolled_reference(k, accumulate, pre_lnorm):
    """Every optimizer step applies the gradient of its windows' summed losses, back-propagated through the memory
    inside each window and not across windows (float64, through the hand-written CPU attention backward). The
    epoch's 7 segments end with a shorter window; the trainer's own accumulation setting is back after the fit."""
    segments = stream_segments(2, 4, 7, SMALL["vocab_size"], seed=1)
    recorder = StepRecorder()
    module, trainer = small_fit(k, segments, recorder, accumulate=accumulate, pre_lnorm=pre_lnorm)
    steps = windows_of(len(segments), k, accumulate)
    assert len(recorder.grads) == trainer.global_step == len(steps)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == len(steps)  # one LR step per optimizer step
    assert recorder.accumulation == k * accumulate and trainer.accumulate_grad_batches == accumulate
    expected = unrolled_gradients({**SMALL, "pre_lnorm": pre_lnorm}, recorder.weights, segments, steps, k,
                                  accumulate)
    for step, (fast, slow) in enumerate(zip(recorder.grads, expected, strict=True)):
        for name in slow:
            torch.testing.assert_close(fast[name], slow[name], rtol=1e-9, atol=1e-12, msg=f"step {step}: {name}")


def test_the_memory_carries_gradient_back_only_inside_its_window():
    """Each segment's embeddings receive their gradient exactly once, in the backward pass of the batch that
    closes their window: no graph reaches into an earlier window. Inside a window the stored memory is in the
    graph; the window's last segment stores it detached."""

    class Watch(L.Callback):
        def __init__(self) -> None:
            self.segment = -1
            self.arrivals: list[tuple[int, int]] = []  # (segment whose embeddings got a gradient, during segment)
            self.attached: list[bool] = []

        def on_train_start(self, trainer, module):
            def hook(_, args, out):
                out.register_hook(lambda grad, owner=self.segment: self.arrivals.append((owner, self.segment)))
            module.model.embed.register_forward_hook(hook)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.segment += 1

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.attached.append([m.grad_fn is not None for m in module.memory.mems["train"]] == [True, True])

    watch = Watch()
    small_fit(3, stream_segments(2, 4, 7, SMALL["vocab_size"]), watch)
    assert sorted(watch.arrivals) == [(0, 2), (1, 2), (2, 2), (3, 5), (4, 5), (5, 5), (6, 6)]
    assert watch.attached == [True, True, False, True, True, False, False]


def test_attached_memory_gives_the_same_forward():
    """Keeping the memory in the graph changes no value: the same losses and memory, bit for bit."""
    module = XLLitModule(model={**SMALL, "dropout": 0.0}).double()
    segments = stream_segments(2, 4, 4, SMALL["vocab_size"])
    results = []
    for detach in (True, False):
        module.memory.reset("train")
        losses = torch.stack([module.segment_loss(s, "train", detach_memory=detach) for s in segments])
        results.append((losses.detach(), [m.detach() for m in module.memory.mems["train"]]))
        assert all((m.grad_fn is None) == detach for m in module.memory.mems["train"])
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


@pytest.mark.parametrize("path", ["cpu_backward", "sdpa"])
@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_gradient_reaches_an_attached_memory_through_both_attention_paths(path, pre_lnorm, monkeypatch):
    """The memory's keys and values are projected apart from the segment's; its input gradient must still be
    autograd's through the score-by-score reference, on the hand-written CPU backward (weights trained) and on
    SDPA (what GPUs run; on a CPU it runs when the position scores need no gradient: frozen weights)."""
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(**{**SMALL, "pre_lnorm": pre_lnorm})).double().train()
    attn = model.layers[0].attn
    attn.requires_grad_(path == "cpu_backward")
    h = torch.randn(2, 4, 16, dtype=torch.float64)
    mem = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    pos_emb, mask = model._context(4, 6, -1, None)
    calls = []
    hand_written = attention.TrainingAttentionCPU.apply
    monkeypatch.setattr(attention.TrainingAttentionCPU, "apply", lambda *a: calls.append(1) or hand_written(*a))
    out_grad = torch.randn(2, 4, 16, dtype=torch.float64)
    grads = []
    for run in (lambda: attn(h, mem, pos_emb, mask)[0], lambda: reference_attention(attn, h, mem)):
        mem.grad = None
        run().backward(out_grad)
        grads.append(mem.grad)
    assert len(calls) == (path == "cpu_backward")
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


class SavedBytesPeak(L.Callback):
    """The most bytes autograd held saved for backward at any time of the fit (weights not counted)."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage -> [saved tensors using it, its bytes]
        self.total = self.peak = 0

    def on_train_start(self, trainer, module):
        self.weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()

    def on_train_end(self, trainer, module):
        self.hooks.__exit__(None, None, None)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() in self.weights:
            return t
        if storage.data_ptr() not in self.live:
            self.live[storage.data_ptr()] = [0, storage.nbytes()]
            self.total += storage.nbytes()
            self.peak = max(self.peak, self.total)
        self.live[storage.data_ptr()][0] += 1
        weakref.finalize(t, self.release, storage.data_ptr())  # when the graph that saved it is freed
        return t

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if not entry[0]:
            self.total -= self.live.pop(ptr)[1]


@pytest.mark.parametrize("k", [1, 3])
def test_a_window_holds_k_segments_activations(k):
    """What the footprint tool states: training with windows of k segments holds about k times the activations
    of one training segment, to within what they share and their token tensors."""
    per_segment = segment_activation_bytes(XLConfig(**{**SMALL, "dropout": 0.1}), 2, 4)
    peak = SavedBytesPeak()
    module = XLLitModule(model={**SMALL, "dropout": 0.1}, grad_segments=k)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[peak])
    trainer.fit(module, DataLoader(stream_segments(2, 4, 7, SMALL["vocab_size"]), batch_size=None))
    assert 0.9 * k * per_segment < peak.peak < 1.05 * k * per_segment


# ---- the training loop: resume, faults, input ---------------------------------------------------------------------
class SegmentLosses(L.Callback):
    """Every segment's loss by (epoch, batch index), and the global step after it."""

    def __init__(self) -> None:
        self.losses: dict[tuple[int, int], tuple[float, int]] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.current_epoch, batch_idx] = (outputs["loss"].item(), trainer.global_step)


def resumable(tmp_path, corpus, run: str, *extra: str):
    """tests/test_resume's setup (dropout, epochs of 5 segments, 12 steps, a checkpoint at step 7), k = 2."""
    from tests.integration.test_resume import resume_cfg

    cfg = resume_cfg(tmp_path, corpus, run, "memory.grad_segments=2", *extra)
    built = build_run(cfg)
    losses = SegmentLosses()
    built.trainer.callbacks.append(losses)
    return built, losses


def fit_resumable(built, losses) -> tuple:
    built.trainer.fit(built.module, datamodule=built.datamodule, ckpt_path=built.ckpt_path, weights_only=True)
    return built, losses.losses


def resumed_at_step_7(tmp_path, corpus, *extra: str):
    """The unbroken run, a run stopped at step 7 (a window boundary) and its resume, with ``extra`` overrides;
    asserts that the resume trains the last 8 segments with the unbroken run's losses and ends with its weights.
    Returns the unbroken run, its losses and the step-7 checkpoint."""
    whole, whole_losses = fit_resumable(*resumable(tmp_path, corpus, "whole", *extra))
    fit_resumable(*resumable(tmp_path, corpus, "first", *extra, "trainer.max_steps=7"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    second, second_losses = fit_resumable(*resumable(tmp_path, corpus, "second", *extra, f"ckpt_path={ckpt}"))
    assert sorted(second_losses) == sorted(whole_losses)[-len(second_losses):] and len(second_losses) == 8
    assert all(second_losses[key] == whole_losses[key] for key in second_losses)
    for (name, a), b in zip(whole.module.state_dict().items(), second.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    return whole, whole_losses, ckpt


def test_resume_at_a_window_boundary_is_exact(tmp_path, corpus):
    whole, whole_losses, ckpt = resumed_at_step_7(tmp_path, corpus)
    assert whole.trainer.global_step == 12 and len(whole_losses) == 20  # epochs of 5 segments: 3 steps each
    assert torch.load(ckpt, weights_only=True)["global_step"] == 7


def test_resume_inside_a_window_finishes_it_without_the_segments_before(tmp_path, corpus):
    """A signal stops the run after the first segment of a window; the resumed run warns, reads the rest of that
    window with the very same forward, and steps at the same place; that one step lacks the first segment's loss."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from tests.integration.test_resume import SendSignal

    whole, whole_losses = fit_resumable(*resumable(tmp_path, corpus, "whole"))
    first, _ = resumable(tmp_path, corpus, "first", "callbacks.model_checkpoint.every_n_train_steps=null")
    first.trainer.callbacks.append(SendSignal(signal.SIGTERM, at_step=7))
    with pytest.raises(SIGTERMException):  # the fit ends at the step boundary, right after writing last.ckpt
        first.trainer.fit(first.module, datamodule=first.datamodule)
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == 6 and not saved["xl"]["train_memory"].requires_grad
    with pytest.warns(UserWarning, match=r"resumed inside a window of memory.grad_segments=2 segments: its first 1"):
        second, second_losses = fit_resumable(*resumable(tmp_path, corpus, "second", f"ckpt_path={ckpt}"))
    window_rest = (2, 1)  # epoch 2, second segment of its first window
    assert min(second_losses) == window_rest and second_losses[window_rest] == whole_losses[window_rest]
    assert second.trainer.global_step == 12 and sorted(second_losses) == sorted(whole_losses)[-9:]
    assert not torch.equal(second.module.model.embed.weight, whole.module.model.embed.weight)


def test_nonfinite_window_is_skipped_and_its_memory_cleaned(tmp_path, corpus):
    from tests.integration.test_faults import PoisonMemory

    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=6",
                                   "memory.grad_segments=2"))
    poison = PoisonMemory(3)  # both segments of the fourth window read a memory holding an inf
    run.trainer.callbacks.append(poison)
    with pytest.warns(UserWarning, match=r"1 step\(s\) with a non-finite loss"):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    for name, before in poison.weights[3].items():
        assert torch.equal(before, poison.weights[4][name]), f"{name} changed in the skipped step"
    assert not torch.equal(poison.weights[4]["embed.weight"], poison.weights[5]["embed.weight"])
    assert all(torch.isfinite(torch.tensor(poison.losses[s])) for s in (4, 5))
    assert poison.memory_finite and run.module.nonfinite.total == 1 and run.trainer.global_step == 6


def test_window_steps_never_wait_for_the_device(tiny_cfg):
    from tests.unit.training.test_lit import HostSyncWatch

    tiny_cfg.trainer.max_steps = 4
    tiny_cfg.trainer.log_every_n_steps = 50
    tiny_cfg.trainer.val_check_interval = 50
    tiny_cfg.trainer.num_sanity_val_steps = 0
    tiny_cfg.test = False
    tiny_cfg.memory.grad_segments = 3
    run = build_run(tiny_cfg)
    watch = HostSyncWatch()
    run.trainer.callbacks.insert(0, watch)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 4 and watch.reads == []


class GradientDump(L.Callback):
    """Saves the gradients of every optimizer step (as applied: after DDP's all-reduce) to ``path``."""

    def __init__(self, path: str) -> None:
        self.path, self.grads = Path(path), []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in module.model.named_parameters()})
        if trainer.global_rank == 0:
            torch.save(self.grads, self.path)


@pytest.mark.slow
def test_ddp_windows_apply_the_gradient_of_one_process_reading_every_rank(tmp_path, corpus):
    """Two gloo processes with windows of 2 (the first segment of each window under no_sync, the window's backward
    synchronised) apply the gradients of one process that reads both ranks' rows (no dropout)."""
    from tests.integration.test_ddp import ddp_train

    # float32 in both: the two processes see the real CPU, where precision=auto may pick bf16-mixed
    common = ("memory.grad_segments=2", "model.dropout=0.0", "trainer.max_steps=3", "precision=32-true",
              "+callbacks.grads._target_=tests.unit.training.test_tbptt.GradientDump")
    ddp_train(tmp_path, corpus, "ddp", *common, f"+callbacks.grads.path={tmp_path / 'ddp.pt'}")
    one = build_run(compose_config(*tiny_overrides(tmp_path / "one", corpus), *common[:4], "data.batch_size=8",
                                   "test=false", "model.dropout=0.0"))
    dump = GradientDump(str(tmp_path / "one.pt"))
    one.trainer.callbacks.append(dump)
    one.trainer.fit(one.module, datamodule=one.datamodule)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert len(ddp) == len(dump.grads) == 3
    for step, (a, b) in enumerate(zip(ddp, dump.grads, strict=True)):
        for name in b:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_window_length_is_refused_naming_the_setting(tmp_path, corpus, value):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), f"memory.grad_segments={value}")
    with pytest.raises(ConfigError, match=r"memory\.grad_segments must be an integer >= 1") as info:
        build_run(cfg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["two", "2.5", "true"])
def test_window_length_of_another_type_is_refused_at_composition(value):
    with pytest.raises(ConfigError, match=r"memory\.grad_segments must be an integer") as info:
        compose("config", [f"memory.grad_segments={value}"])
    assert "\n" not in str(info.value)


def test_windows_without_memory_are_refused(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "memory.mem_len=0", "memory.grad_segments=2")
    with pytest.raises(ConfigError, match=r"memory\.grad_segments=2 needs memory\.mem_len > 0"):
        build_run(cfg)


@pytest.mark.parametrize("memory", ["default", "long", "short", "none"])
def test_every_memory_option_defaults_to_one_segment(memory):
    assert compose_config(f"memory={memory}").memory.grad_segments == 1


class SegmentClock(L.Callback):
    """Wall time of the segments after the first ``warmup`` ones."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.seen, self.start, self.seconds = warmup, 0, 0.0, 0.0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        import time

        self.seen += 1
        if self.seen == self.warmup:
            self.start = time.perf_counter()
        self.seconds = time.perf_counter() - self.start


def bench(k: int, segments: int = 16, warmup: int = 4, threads: int = 2) -> None:
    """``python -m tests.unit.training.test_tbptt --bench K``: config S (4 layers, d_model 256, batch 8, tgt_len =
    mem_len = 128) trained with windows of K segments on random tokens: tokens/s, the peak of autograd's saved bytes,
    and the process's peak RSS (run each K in its own process)."""
    import resource

    torch.set_num_threads(threads)
    L.seed_everything(0, verbose=False)
    config = dict(vocab_size=256, n_layer=4, n_head=4, d_model=256, d_head=64, d_inner=1024, dropout=0.1, mem_len=128)
    module = XLLitModule(model=config, grad_segments=k)
    peak, clock = SavedBytesPeak(), SegmentClock(warmup)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, gradient_clip_val=0.25, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[peak, clock])
    trainer.fit(module, DataLoader(stream_segments(8, 128, warmup + segments, 256), batch_size=None))
    tokens = segments * 8 * 128
    print(json.dumps({"grad_segments": k, "tok_s": round(tokens / clock.seconds),
                      "saved_mb": round(peak.peak / 2**20, 1),
                      "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__" and sys.argv[1:2] == ["--bench"]:
    bench(int(sys.argv[2]))


def test_windows_with_a_compressed_memory_are_refused(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "memory=compressive", "memory.grad_segments=2")
    with pytest.raises(ConfigError, match=r"set memory\.grad_segments=1 with memory=compressive"):
        build_run(cfg)
