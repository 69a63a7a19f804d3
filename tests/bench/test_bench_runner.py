"""The segment runner: training is the Lightning module's step, and reading segment by segment with the memory
carried is the forward pass over the whole text."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import compose_config, tiny_overrides
from xl.bench.runner import SegmentRunner
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.build import build_run

STEPS = 8


class Batches(L.Callback):
    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append((batch[0].clone(), batch[1].clone()))


@pytest.mark.parametrize("memory", [(), ("memory=compressive", "memory.cmem_len=8")])
def test_training_is_the_lightning_step(tmp_path, corpus, memory):
    """The same weights, segments and settings: after STEPS steps the runner's weights are Lightning's (with a
    compressive memory, the compressor's too: both add its reconstruction loss)."""
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), f"trainer.max_steps={STEPS}", "model.dropout=0.1",
                         "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", *memory)  # a constant learning rate
    run = build_run(cfg)
    model = copy.deepcopy(run.module.model)
    initial = copy.deepcopy(model.state_dict())
    batches = Batches()
    run.trainer.callbacks.append(batches)
    torch.manual_seed(7)
    run.trainer.fit(run.module, datamodule=run.datamodule)

    xs, ys = zip(*batches.batches, strict=True)
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in zip(xs, ys, strict=True))  # one contiguous stream
    stream = torch.cat([*xs, ys[-1][:, -1:]], dim=1)
    torch.manual_seed(7)  # dropout draws the same masks in the same order
    runner = SegmentRunner(model, stream, cfg.data.tgt_len, train=True, lr=cfg.optim.lr,
                           clip=cfg.trainer.gradient_clip_val)
    runner.run(STEPS)
    assert run.trainer.global_step == STEPS
    for (name, ours), theirs in zip(model.state_dict().items(), run.module.model.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)
    assert max((initial[k] - v).abs().max() for k, v in model.state_dict().items()) > 1e-3  # they did train


def reference(model: TransformerXL, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of one forward over the whole text (no memory needed: every position sees all before it)."""
    with torch.no_grad():
        return model(tokens, mem_len=0).logits


@pytest.fixture
def model64() -> TransformerXL:
    torch.manual_seed(0)
    cfg = XLConfig(vocab_size=50, n_layer=3, n_head=2, d_model=16, d_head=8, d_inner=32, dropout=0.3, mem_len=8)
    return TransformerXL(cfg).double()


@pytest.mark.parametrize("targets", [True, False])
def test_evaluation_reads_segments_as_one_forward(model64, targets):
    tokens = torch.randint(0, 50, (3, 30), generator=torch.Generator().manual_seed(2))
    # A memory as long as the text: reading 8 at a time (8, 8, 8, 5 or 8, 8, 8, 6) sees exactly what one forward sees.
    runner = SegmentRunner(model64, tokens, 8, targets=targets, mem_len=32, return_logits=True)
    assert not model64.training  # evaluation: dropout off
    assert runner.n_segments == 4
    outs = [runner.step() for _ in range(runner.n_segments)]
    inputs = tokens[:, :-1] if targets else tokens
    full = reference(model64, inputs)
    torch.testing.assert_close(torch.cat([o.logits for o in outs], dim=1), full, rtol=0, atol=1e-10)
    assert runner.kv is not None and runner.kv[0][0].size(2) == inputs.size(1)  # keys/values carried
    if targets:
        nll = F.cross_entropy(full.transpose(1, 2), tokens[:, 1:], reduction="none")
        expected = torch.stack([nll[:, s:s + 8].mean() for s in range(0, 29, 8)])
        torch.testing.assert_close(torch.stack([o.loss for o in outs]), expected, rtol=0, atol=1e-12)
    else:
        assert all(o.loss is None for o in outs)


def test_wraps_round_with_the_memory_kept(model64):
    tokens = torch.randint(0, 50, (2, 17))
    runner = SegmentRunner(model64, tokens, 8, mem_len=8)
    first = runner.next_segment()
    runner.run(1)  # the second segment
    assert runner.mems[0].shape == (2, 8, 16)
    x, y = runner.next_segment()
    assert torch.equal(x, first[0]) and torch.equal(y, first[1]) and runner.mems is not None


def test_float16_training_scales_the_loss_and_steps_foreach():
    """As the Lightning module under 16-mixed: a GradScaler, and the foreach AdamW (it must unscale before clipping)."""
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(vocab_size=20, n_layer=1, n_head=2, d_model=16, d_head=8, d_inner=32, mem_len=4))
    runner = SegmentRunner(model, torch.randint(0, 20, (2, 9)), 4, train=True, clip=0.25, autocast=torch.float16)
    assert runner.scaler is not None and not runner.optimizer.defaults["fused"]
    assert runner.optimizer.defaults["foreach"]
    plain = SegmentRunner(copy.deepcopy(model), torch.randint(0, 20, (2, 9)), 4, train=True)
    assert plain.scaler is None and plain.optimizer.defaults["fused"]


@pytest.mark.parametrize(("shape", "tgt_len", "kwargs", "match"), [
    ((2, 1), 4, {}, "no segment"), ((2, 9), 0, {}, "tgt_len >= 1"), ((9,), 4, {}, r"tokens \[B, T\]"),
    ((2, 9), 4, {"train": True, "targets": False}, "training needs targets"),
])
def test_bad_input_is_one_sentence(model64, shape, tgt_len, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SegmentRunner(model64, torch.zeros(shape, dtype=torch.long), tgt_len, **kwargs)
