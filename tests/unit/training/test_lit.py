"""The LightningModule end to end on a tiny config: memory ownership, data order, metrics."""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import pytest
import torch

from xl.training.build import build_run
from xl.training.loop.module import XLLitModule
from xl.training.loop.optim import warmup_cosine


class Recorder(L.Callback):
    """Records what the module holds around every step, without changing it."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.val_bytes: list[int] = []
        self.val_bytes_after: list[int] = []

    def on_fit_start(self, trainer, module):
        # The memory the model is actually called with, whatever the module does before the call.
        def record(model, args):
            if model.training:
                self.events.append(("forward", None, args[1]))
        module.model.register_forward_pre_hook(record)

    def on_train_epoch_start(self, trainer, module):
        self.events.append(("epoch_start", trainer.current_epoch, module.memory.mems["train"]))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.events.append(("before", batch_idx, module.memory.mems["train"]))
        self.batches.append((batch[0].clone(), batch[1].clone()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.events.append(("after", batch_idx, module.memory.mems["train"]))

    def on_validation_start(self, trainer, module):
        self.events.append(("val_start", None, clone(module.memory.mems["train"])))

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_bytes.append(module.memory.nbytes("val"))

    def on_validation_end(self, trainer, module):
        self.events.append(("val_end", None, clone(module.memory.mems["train"])))
        self.val_bytes_after.append(module.memory.nbytes("val"))


def clone(mems: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    return None if mems is None else [m.clone() for m in mems]


def fit_with_recorder(cfg) -> tuple:
    run = build_run(cfg)
    recorder = Recorder()
    run.trainer.callbacks.append(recorder)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return run, recorder


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_memory_persists_is_detached_and_resets_each_epoch(tiny_cfg, accumulate):
    tiny_cfg.trainer.limit_train_batches = 6  # epochs of 6 segments: 24 segments span 4 epochs
    tiny_cfg.trainer.accumulate_grad_batches = accumulate  # memory stays continuous across accumulated segments
    tiny_cfg.trainer.max_steps = 24 // accumulate
    run, rec = fit_with_recorder(tiny_cfg)
    last_after, batch_idx = None, None
    epochs_started = 0
    for kind, idx, mems in rec.events:
        if kind == "epoch_start":
            epochs_started += 1
        elif kind == "before":
            batch_idx = idx
        elif kind == "forward":
            if batch_idx == 0:
                assert mems is None, "a new epoch restarts every stream, so the memory must be empty"
            else:
                assert mems is last_after, "each step must read the memory the previous step wrote"
        elif kind == "after":
            assert len(mems) == 2 and all(not m.requires_grad and m.grad_fn is None for m in mems)
            assert mems[0].shape == (4, 16, 32)
            last_after = mems
    assert epochs_started == 4
    # Validation (sanity check included) never touches the training memory's values.
    pairs = [(e, n) for e, n in zip(rec.events, rec.events[1:], strict=False) if e[0] == "val_start"]
    assert len(pairs) == 3 and all(n[0] == "val_end" for _, n in pairs)
    for start, end in pairs:
        assert (start[2] is None) == (end[2] is None)
        assert start[2] is None or all(torch.equal(a, b) for a, b in zip(start[2], end[2], strict=True))
    # Validation holds its memory and keys/values while it runs, and frees them when it ends.
    assert min(rec.val_bytes) > 0 and rec.val_bytes_after == [0, 0, 0]


def test_batches_arrive_in_stream_order(tiny_cfg):
    tiny_cfg.trainer.limit_train_batches = 6
    run, rec = fit_with_recorder(tiny_cfg)
    ids = torch.from_numpy(np.asarray(run.datamodule.cache.splits["train"], dtype=np.int64))
    rows = 4
    row_len = len(ids) // rows
    # Slow reference: row b is the b-th contiguous slice of the token stream, read 16 tokens at a time.
    streams = ids[: rows * row_len].view(rows, row_len)
    for t, (x, y) in enumerate(rec.batches[:6]):
        torch.testing.assert_close(x, streams[:, 16 * t:16 * t + 16], rtol=0, atol=0)
        torch.testing.assert_close(y, streams[:, 16 * t + 1:16 * t + 17], rtol=0, atol=0)
    # The next epoch starts every stream again from its beginning.
    torch.testing.assert_close(rec.batches[6][0], rec.batches[0][0], rtol=0, atol=0)


def test_short_run_lowers_the_loss(tmp_path, corpus):
    from tests.conftest import compose_config, tiny_overrides

    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=60", "optim.lr=3e-3",
                         "optim.warmup_steps=5", "trainer.val_check_interval=30")
    untrained = build_run(cfg)  # same seed, so the same initial weights as the run below
    before = untrained.trainer.validate(untrained.module, datamodule=untrained.datamodule, verbose=False)[0]["val/loss"]
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    after = float(run.trainer.callback_metrics["val/loss"])
    assert after < before - 0.5, (before, after)
    assert math.isclose(float(run.trainer.callback_metrics["val/bpb"]), after / math.log(2), rel_tol=1e-5)


def test_batch_size_change_restarts_memory_instead_of_broadcasting():
    module = XLLitModule(model=dict(vocab_size=16, n_layer=1, n_head=1, d_model=8, d_head=8, d_inner=8,
                                    dropout=0.0, mem_len=4))
    x = torch.randint(0, 16, (3, 4))
    module.segment_loss((x, x), "val")
    assert module.memory.mems["val"][0].size(0) == 3
    with pytest.warns(UserWarning, match="restarts empty"):
        module.segment_loss((x[:2], x[:2]), "val")
    assert module.memory.mems["val"][0].shape == (2, 4, 8)


def test_eval_uses_its_own_memory_length():
    module = XLLitModule(model=dict(vocab_size=16, n_layer=1, n_head=1, d_model=8, d_head=8, d_inner=8,
                                    dropout=0.0, mem_len=4), eval_mem_len=12)
    x = torch.randint(0, 16, (2, 8))
    for _ in range(3):
        module.segment_loss((x, x), "val")
        module.segment_loss((x, x), "train")
    assert module.memory.mems["val"][0].size(1) == 12 and module.memory.mems["train"][0].size(1) == 4


def test_warmup_then_cosine():
    values = [warmup_cosine(s, 10, 110, 0.1) for s in range(111)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0) and values[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:], strict=False))


class HostSyncWatch(L.Callback):
    """Records every read of a tensor's value on the host between a batch's start and its optimizer step."""

    READS = ("item", "__bool__", "__float__", "__int__", "tolist", "numpy")

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.saved = {name: getattr(torch.Tensor, name) for name in self.READS}

    def _patch(self, on: bool) -> None:
        for name, original in self.saved.items():
            def spy(t, *a, _name=name, _original=original, **k):
                self.reads.append(_name)
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, spy if on else original)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._patch(True)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._patch(False)

    def teardown(self, trainer, module, stage):
        self._patch(False)


@pytest.mark.parametrize("sync_in_step", [False, True])
def test_training_step_never_waits_for_the_device(tiny_cfg, monkeypatch, sync_in_step):
    """Forward, loss, metric, non-finite handling, backward, clipping and the fused AdamW step: no host reads."""
    tiny_cfg.trainer.max_steps = 4
    tiny_cfg.trainer.log_every_n_steps = 50
    tiny_cfg.trainer.val_check_interval = 50
    tiny_cfg.trainer.num_sanity_val_steps = 0
    tiny_cfg.test = False
    run = build_run(tiny_cfg)
    if sync_in_step:  # the watch must see a host read when there is one
        step = run.module.training_step

        def syncing_step(batch, batch_idx):
            loss = step(batch, batch_idx)
            loss.item()
            return loss
        monkeypatch.setattr(run.module, "training_step", syncing_step)
    watch = HostSyncWatch()
    run.trainer.callbacks.insert(0, watch)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 4
    if sync_in_step:
        assert watch.reads.count("item") == 4
    else:
        assert watch.reads == [], f"host reads of device values during training steps: {watch.reads}"


def fit_weights(cfg) -> dict[str, torch.Tensor]:
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return run.module.state_dict()


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_model_trains_like_the_plain_one_under_the_same_names(tiny_cfg, backend):
    tiny_cfg.trainer.max_steps = 3
    tiny_cfg.trainer.num_sanity_val_steps = 0
    tiny_cfg.test = False
    plain = fit_weights(tiny_cfg)
    tiny_cfg.compile.enabled = True
    tiny_cfg.compile.backend = backend
    compiled = fit_weights(tiny_cfg)
    assert compiled.keys() == plain.keys()  # checkpoints of compiled runs load into plain models
    for name, value in plain.items():
        torch.testing.assert_close(compiled[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_evaluation_carries_keys_and_values_with_its_memory():
    cfg = dict(vocab_size=16, n_layer=2, n_head=2, d_model=8, d_head=4, d_inner=8, dropout=0.0, mem_len=4)
    module = XLLitModule(model=cfg, eval_mem_len=12).double()
    x = torch.randint(0, 16, (2, 5, 6))
    plain = [module.segment_loss((x[:, i], x[:, i]), "val") for i in range(5)]  # gradients on: no cache
    module.memory.reset("val")
    with torch.no_grad():
        cached = [module.segment_loss((x[:, i], x[:, i]), "val") for i in range(5)]
        kv, mems = module.memory.kv["val"], module.memory.mems["val"]
        assert [k.size(2) for k, _ in kv] == [12, 12] == [m.size(1) for m in mems]
    torch.testing.assert_close(torch.stack(cached), torch.stack(plain).detach(), rtol=1e-12, atol=1e-12)
    module.memory.reset("val")
    assert module.memory.kv["val"] is None


def test_validation_before_fit_leaves_nothing_training_cannot_use(tiny_cfg):
    """Evaluation runs under inference mode; the position tables it builds are reused by training steps."""
    tiny_cfg.trainer.max_steps = 3
    run = build_run(tiny_cfg)
    run.trainer.validate(run.module, datamodule=run.datamodule, verbose=False)
    assert run.module.memory.nbytes("val") == 0
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 3


@pytest.mark.parametrize("mem_dtype", ["float32", "bfloat16", "float16"])
def test_cached_evaluation_equals_uncached_for_every_memory_dtype(mem_dtype):
    cfg = dict(vocab_size=16, n_layer=2, n_head=2, d_model=8, d_head=4, d_inner=8, dropout=0.0, mem_len=4,
               mem_dtype=mem_dtype)
    module = XLLitModule(model=cfg, eval_mem_len=6)
    x = torch.randint(0, 16, (2, 5, 3), generator=torch.Generator().manual_seed(0))
    plain = [module.segment_loss((x[:, i], x[:, i]), "val").detach() for i in range(5)]  # gradients on: no cache
    module.memory.reset("val")
    with torch.no_grad():
        cached = [module.segment_loss((x[:, i], x[:, i]), "val") for i in range(5)]
        assert module.memory.kv["val"] is not None
    torch.testing.assert_close(torch.stack(cached), torch.stack(plain), rtol=1e-6, atol=1e-6)
