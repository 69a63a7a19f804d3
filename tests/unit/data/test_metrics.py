"""Bits per byte for every tokenizer: the metric's sums against float64 references, and end to end through the
Lightning module against a slow reference that decodes each scored target token to its bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.conftest import compose_config, tiny_overrides
from tests.unit.data.test_tokenizers import reference_token_bytes, text_corpus
from xl.data.metrics import LMMetrics, ScoredText
from xl.training.build import build_run

LN2 = math.log(2)


def bits(n: float) -> torch.Tensor:
    """A mean NLL of ``n`` bits per token, in float64 nats."""
    return torch.tensor(n * LN2, dtype=torch.float64)


def random_batches(vocab: int, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(mean NLL, targets) pairs of varying shapes, as a stage sees them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        shape = (int(torch.randint(1, 5, (), generator=g)), int(torch.randint(1, 9, (), generator=g)))
        out.append((torch.rand((), generator=g) * 6, torch.randint(0, vocab, shape, generator=g)))
    return out


@pytest.mark.parametrize("unit,name,unk_id", [("token", "ppl", None), ("word", "ppl", 1), ("char", "bpc", 49)])
def test_epoch_figures_are_the_float64_sums_of_every_batch(unit, name, unk_id):
    """Batches without their targets' own lengths (a split with nothing unknown): the table counts every target,
    <unk> included, and nothing is spelled."""
    vocab = 50
    table = torch.randint(1, 9, (vocab,), generator=torch.Generator().manual_seed(1))
    metrics = LMMetrics(unit)
    metrics.set_token_bytes(table, vocab, unk_id)
    batches = random_batches(vocab, 40)
    for nll, target in batches:
        step = metrics.update("val", nll, target)
        n_bytes = sum(int(table[t]) for t in target.flatten().tolist())
        assert float(step["val/bpb"]) == pytest.approx(float(nll) * target.numel() / (n_bytes * LN2), rel=1e-12)
    nats = sum(float(nll) * target.numel() for nll, target in batches)
    tokens = sum(target.numel() for _, target in batches)
    n_bytes = sum(int(table[t]) for _, target in batches for t in target.flatten().tolist())
    values = metrics.compute("val")
    assert set(values) == {"val/loss", f"val/{name}", "val/bpb"} | ({"val/unk_share"} if unk_id else set())
    assert unk_id is None or float(values["val/unk_share"]) == 0.0
    assert values["val/loss"].dtype == values["val/bpb"].dtype == torch.float64
    assert float(values["val/loss"]) == pytest.approx(nats / tokens, rel=1e-13)
    assert float(values["val/bpb"]) == pytest.approx(nats / (n_bytes * LN2), rel=1e-13)
    expected = math.exp(nats / tokens) if name == "ppl" else nats / tokens / LN2
    assert float(values[f"val/{name}"]) == pytest.approx(expected, rel=1e-12)
    assert metrics.compute("val") is None  # reset: nothing added since


def test_byte_unit_bits_per_byte_equal_bits_per_token_with_or_without_the_table():
    batches = random_batches(256, 10)
    with_table, without = LMMetrics("byte"), LMMetrics("byte")
    with_table.set_token_bytes(torch.ones(256, dtype=torch.int64), 256)
    for nll, target in batches:
        with_table.update("test", nll, target)
        without.update("test", nll, target)
    a, b = with_table.compute("test"), without.compute("test")
    assert set(a) == set(b) == {"test/loss", "test/bpb"}
    assert float(a["test/bpb"]) == pytest.approx(float(a["test/loss"]) / LN2, rel=1e-14)
    assert float(b["test/bpb"]) == pytest.approx(float(a["test/bpb"]), rel=1e-14)


@pytest.mark.parametrize("unit", ["word", "char"])
def test_bits_per_byte_charge_eight_bits_for_each_byte_an_unk_stands_for(unit):
    """Hand-computed: ids 0..3 with table [1, 6, 4, 4] (<eos>, <unk>, two known symbols), <unk> = 1. Mean NLLs of
    2 and 3 bits per token make the model's bits whole numbers."""
    metrics = LMMetrics(unit)
    metrics.set_token_bytes(torch.tensor([1, 6, 4, 4]), 4, unk_id=1)
    # Batch 1: known, <unk> of 9 bytes, known, <eos>: 4 tokens x 2 bits + 9 bytes x 8 bits = 80 bits over 18 bytes.
    step = metrics.update("val", bits(2), torch.tensor([[2, 1, 3, 0]]), torch.tensor([[4, 9, 4, 1]]))
    assert float(step["val/bpb"]) == pytest.approx(80 / 18, rel=1e-14)
    assert float(step["val/unk_share"]) == pytest.approx(9 / 18, rel=1e-14)
    # Batch 2, two rows: <unk> of 3 bytes, <unk> of 6: 2 x 3 bits + 9 x 8 bits = 78 bits over 9 bytes.
    step = metrics.update("val", bits(3), torch.tensor([[1], [1]]), torch.tensor([[3], [6]]))
    assert float(step["val/bpb"]) == pytest.approx(78 / 9, rel=1e-14)
    assert float(step["val/unk_share"]) == 1.0
    values = metrics.compute("val")
    assert float(values["val/bpb"]) == pytest.approx((80 + 78) / 27, rel=1e-14)
    assert float(values["val/unk_share"]) == pytest.approx(18 / 27, rel=1e-14)
    assert float(values["val/loss"]) == pytest.approx((4 * 2 + 2 * 3) * LN2 / 6, rel=1e-14)  # the model's own loss
    # What the model alone paid per byte: the model's 14 bits over the 27 bytes.
    assert float(values["val/bpb"]) - 8 * float(values["val/unk_share"]) == pytest.approx(14 / 27, rel=1e-12)


def test_training_leaves_a_non_finite_steps_spelled_bytes_out_too():
    metrics = LMMetrics("word")
    metrics.set_token_bytes(torch.tensor([1, 6, 4]), 3, unk_id=1)
    target, lengths = torch.tensor([[2, 1]]), torch.tensor([[4, 5]])
    metrics.update("train", torch.tensor(float("nan")), target, lengths)
    metrics.update("train", bits(1), torch.tensor([[2, 1, 1]]), torch.tensor([[4, 2, 3]]))
    train = metrics.compute("train")  # the second step only: 3 bits + 5 bytes x 8 bits over 9 bytes
    assert float(train["train/bpb"]) == pytest.approx(43 / 9)
    assert float(train["train/unk_share"]) == pytest.approx(5 / 9)


def test_lengths_without_an_unk_id_or_an_unk_id_outside_the_vocabulary_are_refused():
    metrics = LMMetrics("word")
    metrics.set_token_bytes(torch.tensor([1, 6, 4]), 3)
    with pytest.raises(ValueError, match="no <unk> id"):
        metrics.update("val", torch.tensor(1.0), torch.tensor([[2, 1]]), torch.tensor([[4, 5]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        metrics.set_token_bytes(torch.tensor([1, 6, 4]), 3, unk_id=3)


def test_no_table_no_bits_per_byte_for_other_units_and_a_wrong_table_is_refused():
    metrics = LMMetrics("token")
    nll, target = random_batches(10, 1)[0]
    assert set(metrics.update("val", nll, target)) == {"val/loss", "val/ppl"}
    assert set(metrics.compute("val")) == {"val/loss", "val/ppl"}
    with pytest.raises(ValueError, match="different tokenizers"):
        metrics.set_token_bytes(torch.ones(9, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match="unit must be one of"):
        LMMetrics("bit")


def test_training_leaves_out_non_finite_steps_evaluation_shows_them():
    metrics = LMMetrics("token")
    metrics.set_token_bytes(torch.full((4,), 3), 4)
    target = torch.tensor([[0, 1, 2, 3]])
    for stage in ("train", "val"):
        metrics.update(stage, torch.tensor(2.0), target)
        step = metrics.update(stage, torch.tensor(float("nan")), target)
        assert math.isnan(float(step[f"{stage}/loss"]))  # the step's own figure shows the NaN
    train, val = metrics.compute("train"), metrics.compute("val")
    assert float(train["train/loss"]) == 2.0 and float(train["train/bpb"]) == pytest.approx(2.0 * 4 / (12 * LN2))
    assert math.isnan(float(val["val/loss"])) and math.isnan(float(val["val/bpb"]))


def test_sums_stay_float64_when_the_module_is_cast_to_bfloat16():
    metrics = LMMetrics("token")
    metrics.set_token_bytes(torch.arange(1, 11), 10)
    metrics.to(torch.bfloat16)  # what precision=bf16-true does to the LightningModule
    assert metrics.sums["val_nll"].nats.dtype == torch.float64 and metrics.token_bytes.dtype == torch.int64
    reference = LMMetrics("token")
    reference.set_token_bytes(torch.arange(1, 11), 10)
    for nll, target in random_batches(10, 30):
        metrics.update("val", nll, target)
        reference.update("val", nll, target)
    assert metrics.compute("val")["val/bpb"].item() == reference.compute("val")["val/bpb"].item()


def test_rank_sums_merge_into_the_sums_of_one_process():
    """What the cross-rank reduction does (every state is summed): two halves give the whole."""
    batches = [(nll * target.numel(), target.numel(), 3 * target.numel(), int((target == 0).sum()))
               for nll, target in random_batches(7, 20)]
    whole, first, second = ScoredText(), ScoredText(), ScoredText()
    for i, (nats, tokens, n_bytes, spelled) in enumerate(batches):
        whole.update(nats.double(), tokens, n_bytes, spelled)
        (first if i % 2 else second).update(nats.double(), tokens, n_bytes, spelled)
    first.merge_state(second)
    assert [t.item() for t in first.compute()] == pytest.approx([t.item() for t in whole.compute()], rel=1e-15)
    # some bytes were spelled (two real ranks: tests/integration/test_distributed.py)
    assert 0 < whole.compute()[2].item() < 1


# --- end to end through the Lightning module -----------------------------------------------------------------------


def scored_batches(module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Record the (mean NLL, targets) of every evaluation step the module takes."""
    record, step = [], module.segment_loss

    def recording_step(batch, stage):
        loss = step(batch, stage)
        record.append((loss.detach().double(), batch[1].clone()))
        return loss

    module.segment_loss = recording_step
    return record


@pytest.mark.parametrize("tokenizer", ["bpe", "byte"])
def test_logged_bits_per_byte_equal_a_slow_reference_decoding_each_target(tmp_path, corpus, tokenizer):
    paths = text_corpus(tmp_path, corpus)
    extra = ["data.tokenizer=bpe", "+data.tokenizer_kwargs.vocab_size=320"] if tokenizer == "bpe" else []
    cfg = compose_config(*tiny_overrides(tmp_path, paths), *extra, "trainer.max_steps=4",
                         "trainer.val_check_interval=4", "trainer.limit_val_batches=1.0")
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert {"train/bpb", "val/bpb"} <= set(run.trainer.progress_bar_metrics)
    record = scored_batches(run.module)
    (logged,) = run.trainer.validate(run.module, datamodule=run.datamodule, verbose=False)
    tok = run.datamodule.tokenizer
    nats = sum(float(loss) * target.numel() for loss, target in record)
    targets = np.concatenate([target.flatten().numpy() for _, target in record])
    if tokenizer == "bpe":
        n_bytes = sum(len(reference_token_bytes(tok, int(t))) for t in targets)
    else:
        n_bytes = len(targets)
    # The scored text is every stream's text after its first token, each target once.
    rows = torch.from_numpy(np.asarray(run.datamodule.val_dataloader().rows, dtype=np.int64))
    assert torch.equal(torch.cat([target for _, target in record], 1), rows[:, 1:])
    assert logged["val/bpb"] == pytest.approx(nats / (n_bytes * LN2), rel=1e-12)
    if tokenizer == "bpe":
        assert logged["val/ppl"] == pytest.approx(math.exp(nats / len(targets)), rel=1e-6)
        assert n_bytes > 1.5 * len(targets)  # subwords: more than one byte per token
    else:
        assert logged["val/bpb"] == pytest.approx(logged["val/loss"] / LN2, rel=1e-6)
