"""Bits per byte with <unk> (char and word tokenizers): the real UTF-8 bytes of the text each <unk> stands for are
counted, and bits per byte charge the fallback's 8 bits for each of them, so that the figure is the length of a code
that gives the text back and compares with any other tokenizer's.

The references are written here from the raw text: each position's symbol and bytes (a character's UTF-8 length; a
word's UTF-8 length and its separator, the end of a line one byte; for text in the form "w w \\n" their sum is the
text's size), the symbols the training split lacks, and which positions are spelled: in a split that holds any symbol
the vocabulary lacks, every <unk> (a literal one too, which the model's <unk> does not tell apart); in a split whose
only <unk> are literal, none. Expected bits are then computed by hand for a model of known probabilities.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import Tensor, nn

from tests.conftest import CONF_DIR, compose_config, tiny_overrides
from tests.unit.data.test_data import write_corpus
from xl.data import SegmentDataModule, SegmentLoader
from xl.evaluation import evaluate
from xl.model.documents import target_bytes
from xl.training.build import build_run
from xl.training.eval_results import format_table

TRAIN = "the cat sat on the mat \n" * 30 + "a dog ran \n" * 10
# Characters and words the training split lacks, of 1 to 4 bytes (and, for words, of several lengths).
VAL = "the zürich cat sat 日本語 on 🙂 mat \nthe naïve dog ran x \n" * 6
TEST = "the — cat ǅ sat on 𝔘𝔫𝔦 the mat \n" * 5
LN2 = math.log(2)
EOS = "\n"  # the word tokenizer's end-of-line symbol, as the references write it


def reference_symbols(unit: str, text: str) -> list[str]:
    """Each position's symbol: a character, or a word (each line's words, then the end of the line)."""
    if unit == "char":
        return list(text)
    symbols = []
    for line in text.split("\n")[:-1]:
        symbols += line.split() + [EOS]
    return symbols


def reference_bytes(unit: str, text: str) -> list[int]:
    """Each position's UTF-8 bytes, from the raw text (a word with its separator)."""
    extra = 0 if unit == "char" else 1
    return [1 if s == EOS and unit == "word" else len(s.encode("utf-8")) + extra for s in reference_symbols(unit, text)]


def reference_vocabulary(unit: str, train: str, min_freq: int = 1) -> set[str]:
    """The symbols a vocabulary fitted on ``train`` knows (a word vocabulary also holds the end of line and
    ``<unk>``)."""
    counts = Counter(reference_symbols(unit, train))
    known = {s for s, n in counts.items() if n >= min_freq}
    return known if unit == "char" else known | {EOS, "<unk>"}


def reference_unk(text: str, unit: str, vocabulary: set[str]) -> list[bool]:
    """Which positions read as <unk>: symbols the vocabulary lacks, and a literal <unk> word."""
    return [s not in vocabulary or (unit == "word" and s == "<unk>") for s in reference_symbols(unit, text)]


def reference_spelled(text: str, unit: str, vocabulary: set[str]) -> list[bool]:
    """Which positions bits per byte spell: every <unk> of a split that holds a symbol the vocabulary lacks."""
    lacks = any(s not in vocabulary for s in reference_symbols(unit, text))
    return [lacks and unk for unk in reference_unk(text, unit, vocabulary)]


def scored_index(n: int, batch_size: int) -> list[int]:
    """The positions an ordered loader scores: rows of equal length, each row's first token unscored."""
    row = n // batch_size
    return [b * row + i for b in range(batch_size) for i in range(1, row)]


def scored(lengths: list[int], batch_size: int) -> int:
    """The bytes of the targets an ordered loader scores."""
    return sum(lengths[i] for i in scored_index(len(lengths), batch_size))


class FixedLogits(nn.Module):
    """A model head that ignores its input: the same logits at every position, so every probability is known."""

    def __init__(self, logits: Tensor) -> None:
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, states: Tensor) -> Tensor:
        return self.logits.to(states.dtype).expand(*states.shape[:-1], -1)


def unk_heavy_logits(vocab_size: int, unk_id: int) -> Tensor:
    """p(<unk>) = 0.9 and 0.1 / (V - 1) for every other id: a model that predicts <unk> well."""
    logits = torch.zeros(vocab_size, dtype=torch.float32)
    logits[unk_id] = math.log(9 * (vocab_size - 1))
    return logits


def hand_bits(text: str, unit: str, vocabulary: set[str], vocab_size: int, batch_size: int) -> dict[str, float]:
    """The expected figures of :func:`unk_heavy_logits` on ``text``: the model's bits for each scored target, 8 bits
    for each spelled byte, over the scored bytes."""
    lengths, unk = reference_bytes(unit, text), reference_unk(text, unit, vocabulary)
    spelled = reference_spelled(text, unit, vocabulary)
    index = scored_index(len(lengths), batch_size)
    model_bits = sum(-math.log2(0.9) if unk[i] else math.log2(10 * (vocab_size - 1)) for i in index)
    spelled_bytes = sum(lengths[i] for i in index if spelled[i])
    n_bytes = sum(lengths[i] for i in index)
    return {"bpb": (model_bits + 8 * spelled_bytes) / n_bytes, "unk_share": spelled_bytes / n_bytes,
            "loss": model_bits * LN2 / len(index), "model_bpb": model_bits / n_bytes}


@pytest.fixture
def paths(tmp_path) -> dict[str, Path]:
    return write_corpus(tmp_path, TRAIN, VAL, TEST)


@pytest.mark.parametrize("unit", ["char", "word"])
def test_the_cache_keeps_each_positions_real_bytes_where_a_split_has_unk(tmp_path, paths, unit):
    dm = SegmentDataModule.from_files(**{s: str(p) for s, p in paths.items()}, tokenizer=unit,
                                      cache_dir=tmp_path / "cache", batch_size=2, tgt_len=8)
    cache, table = dm.cache, dm.tokenizer.token_bytes()
    assert set(cache.target_bytes) == {"val", "test"}  # the training split, fitted on, has no <unk>
    for split, text in (("val", VAL), ("test", TEST)):
        kept = cache.target_bytes[split]
        assert kept.dtype == np.uint8 and kept.tolist() == reference_bytes(unit, text)
        assert sum(reference_bytes(unit, text)) == len(text.encode("utf-8"))  # the reference is the text's size
        info = cache.meta["splits"][split]
        assert info["unknown"] > 0 and info["counted_bytes"] == info["bytes"] != info["token_bytes"]
        assert info["token_bytes"] == int(table[cache.splits[split]].sum())  # what the table alone would count
    byte_cache = SegmentDataModule.from_files(**{s: str(p) for s, p in paths.items()}, tokenizer="byte",
                                              cache_dir=tmp_path / "cache").cache
    assert byte_cache.target_bytes == {}  # the table is exact: nothing kept, nothing changes
    assert not list(byte_cache.folder.glob("*.bytes.npy"))


class ByteTotals(L.Callback):
    """The running byte totals (scored, spelled) of the module's metrics after each batch (its own public state)."""

    def __init__(self) -> None:
        self.val: list[tuple[int, int]] = []
        self.train: list[tuple[int, int]] = []

    @staticmethod
    def totals(module, stage: str) -> tuple[int, int]:
        sums = module.metrics.sums[f"{stage}_nll"]
        return int(sums.bytes), int(sums.spelled)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val.append(self.totals(module, "val"))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train.append(self.totals(module, "train"))


def config(tmp_path: Path, paths: dict[str, Path], unit: str, run: str, *extra: str):
    return compose_config(*tiny_overrides(tmp_path / run, paths), f"data.tokenizer={unit}",
                          "trainer.limit_val_batches=1.0", "trainer.limit_test_batches=1.0",
                          "trainer.num_sanity_val_steps=0", "callbacks.model_checkpoint.monitor=null", *extra)


@pytest.mark.parametrize("unit", ["char", "word"])
def test_bits_per_byte_count_the_texts_real_bytes_for_any_batch_size(tmp_path, paths, unit):
    lengths = reference_bytes(unit, VAL)
    spelled = [n if s else 0 for n, s in zip(lengths, reference_spelled(VAL, unit, reference_vocabulary(unit, TRAIN)),
                                             strict=True)]
    for batch_size, tgt_len in ((1, 7), (3, 5)):
        run = build_run(config(tmp_path, paths, unit, f"b{batch_size}", f"data.eval_batch_size={batch_size}",
                               f"data.eval_tgt_len={tgt_len}"))
        totals = ByteTotals()
        run.trainer.callbacks.append(totals)
        (results,) = run.trainer.validate(run.module, datamodule=run.datamodule, verbose=False)
        assert totals.val[-1] == (scored(lengths, batch_size), scored(spelled, batch_size))
        if batch_size == 1:  # every position but the first is a target
            assert totals.val[-1][0] == len(VAL.encode("utf-8")) - lengths[0]
        n_bytes, n_spelled = totals.val[-1]
        nats = results["val/loss"] * (len(lengths) // batch_size - 1) * batch_size
        assert results["val/bpb"] == pytest.approx((nats / LN2 + 8 * n_spelled) / n_bytes, rel=1e-6)
        assert results["val/unk_share"] == pytest.approx(n_spelled / n_bytes, rel=1e-12)


@pytest.mark.parametrize("unit", ["char", "word"])
def test_a_model_that_predicts_unk_well_pays_eight_bits_for_each_byte_it_stands_for(tmp_path, paths, unit):
    """A model of known probabilities (p(<unk>) = 0.9) through a real Trainer: validation and test figures equal the
    bits computed by hand from the raw text; taking away 8 bits x unk_share leaves the model's own bits per byte."""
    run = build_run(config(tmp_path, paths, unit, "fixed", "data.eval_batch_size=2", "data.eval_tgt_len=5"))
    dm = run.datamodule
    vocabulary = reference_vocabulary(unit, TRAIN)
    assert dm.vocab_size == len(vocabulary) + (unit == "char")  # char: the characters and <unk>
    run.module.model.head = FixedLogits(unk_heavy_logits(dm.vocab_size, dm.unk_id))
    (val,) = run.trainer.validate(run.module, datamodule=dm, verbose=False)
    (test,) = run.trainer.test(run.module, datamodule=dm, verbose=False)
    for split, text, results in (("val", VAL, val), ("test", TEST, test)):
        expected = hand_bits(text, unit, vocabulary, dm.vocab_size, 2)
        assert results[f"{split}/bpb"] == pytest.approx(expected["bpb"], rel=1e-6)
        assert results[f"{split}/unk_share"] == pytest.approx(expected["unk_share"], rel=1e-12)
        assert results[f"{split}/loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert 0.2 < expected["unk_share"] < 0.8  # much of the text is unknown
        model_bpb = results[f"{split}/bpb"] - 8 * results[f"{split}/unk_share"]  # the model's own part
        assert model_bpb == pytest.approx(expected["model_bpb"], rel=1e-5)


def test_a_split_of_literal_unk_spells_nothing_a_split_that_also_lacks_words_spells_every_unk(tmp_path):
    """WikiText writes <unk> for the words it replaced: a split whose only <unk> are that text counts each as its 6
    bytes, nothing spelled (the closed-vocabulary convention). In a split that also holds a word the vocabulary
    lacks, the model's <unk> no longer says which text it is: every <unk> is spelled, the literal ones too."""
    train, val, test = "the <unk> sat on the mat \n" * 20, "the <unk> sat on the mat \n" * 6, "the cat <unk> sat \n" * 5
    paths = write_corpus(tmp_path, train, val, test)
    run = build_run(config(tmp_path, paths, "word", "literal", "data.eval_batch_size=2", "data.eval_tgt_len=4"))
    dm = run.datamodule
    assert set(dm.cache.target_bytes) == {"test"}
    vocabulary = reference_vocabulary("word", train)
    run.module.model.head = FixedLogits(unk_heavy_logits(dm.vocab_size, dm.unk_id))
    (got_val,) = run.trainer.validate(run.module, datamodule=dm, verbose=False)
    (got_test,) = run.trainer.test(run.module, datamodule=dm, verbose=False)
    assert not any(reference_spelled(val, "word", vocabulary)) and got_val["val/unk_share"] == 0.0
    assert got_val["val/bpb"] == pytest.approx(hand_bits(val, "word", vocabulary, dm.vocab_size, 2)["bpb"], rel=1e-6)
    spelled = reference_spelled(test, "word", vocabulary)
    assert sum(spelled) == 10  # "cat" and the literal <unk> of every line
    expected = hand_bits(test, "word", vocabulary, dm.vocab_size, 2)
    assert got_test["test/bpb"] == pytest.approx(expected["bpb"], rel=1e-6)
    assert got_test["test/unk_share"] == pytest.approx(expected["unk_share"], rel=1e-12)


def test_training_counts_the_real_bytes_and_a_resume_continues_them(tmp_path, paths):
    """Words seen once in training are <unk> there (min_freq=2): the training split carries its bytes too, and its
    <unk> are spelled. A run stopped after step 2 and resumed scores the same targets' bytes as an unbroken run.
    xl.evaluate of the run's weights set to zero (every id equally likely) gives the figures computed by hand."""
    unit, extra = "word", ("+data.tokenizer_kwargs.min_freq=2", "data.batch_size=2", "data.tgt_len=6",
                           "trainer.limit_train_batches=1.0", "trainer.limit_val_batches=0",
                           "callbacks.model_checkpoint.every_n_train_steps=2")
    train = "the cat sat \nthe zürich cat sat 日本語 \na über dog ʃʃ ran \nünï the ñ \n" + TRAIN  # in steps 1 to 4
    (tmp_path / "corpus").mkdir()
    paths = write_corpus(tmp_path / "corpus", train, VAL, TEST)

    def fit(run_name: str, *more: str) -> list[tuple[int, int]]:
        run = build_run(config(tmp_path, paths, unit, run_name, *extra, *more))
        totals = ByteTotals()
        run.trainer.callbacks.append(totals)
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
        assert "train" in run.datamodule.cache.target_bytes
        return totals.train

    vocabulary = reference_vocabulary(unit, train, min_freq=2)
    lengths = np.asarray(reference_bytes(unit, train))
    spelled = lengths * np.asarray(reference_spelled(train, unit, vocabulary))
    row = len(lengths) // 2

    def per_step(values: np.ndarray) -> list[int]:  # segments of 6 targets
        rows = values[: 2 * row].reshape(2, row)
        return [int(rows[:, 6 * t + 1 : 6 * t + 7].sum()) for t in range(4)]

    steps = list(zip(per_step(lengths), per_step(spelled), strict=True))
    assert all(n for _, n in steps[:2])  # the first steps hold unknown words
    whole = fit("whole", "trainer.max_steps=4")
    assert whole == [tuple(int(v) for v in t) for t in np.cumsum(steps, axis=0)]
    fit("first", "trainer.max_steps=2")
    resumed = fit("second", "trainer.max_steps=4", f"ckpt_path={tmp_path / 'first' / 'run'}")
    # the epoch's sums go on from the checkpoint's
    assert resumed == [tuple(int(v) for v in t) for t in np.cumsum(steps, axis=0)[2:]]

    checkpoint = torch.load(tmp_path / "whole" / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    for name, value in checkpoint["state_dict"].items():
        if value.is_floating_point():
            checkpoint["state_dict"][name] = torch.zeros_like(value)  # logits 0: every id equally likely
    torch.save(checkpoint, tmp_path / "uniform.ckpt")
    data = ["data=text", *(f"data.{s}={p}" for s, p in paths.items()), "data.tokenizer=word", "data.batch_size=2",
            "data.tgt_len=6", "+data.tokenizer_kwargs.min_freq=2", f"data.cache_dir={tmp_path / 'whole' / 'cache'}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=[
            f"ckpt={tmp_path / 'uniform.ckpt'}", "splits=[val]", *data, f"paths.output_dir={tmp_path / 'eval'}",
            "+trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false"])
    results = evaluate(cfg)
    val = results["val"]
    index = scored_index(len(reference_symbols(unit, VAL)), 2)
    val_bytes = np.asarray(reference_bytes(unit, VAL))[index]
    val_spelled = val_bytes * np.asarray(reference_spelled(VAL, unit, vocabulary))[index]
    assert val["val/tokens"] == len(index)
    expected = (len(index) * math.log2(len(vocabulary)) + 8 * val_spelled.sum()) / val_bytes.sum()
    assert val["val/bpb"] == pytest.approx(expected, rel=1e-6)
    assert val["val/unk_share"] == pytest.approx(val_spelled.sum() / val_bytes.sum(), rel=1e-12)
    written = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert written["val/bpb"] == val["val/bpb"] and written["val/unk_share"] == val["val/unk_share"]
    header, line = format_table(results, "ppl").splitlines()
    assert header.split() == ["split", "loss", "ppl", "bpb", "unk_share", "tokens", "tokens/s"]
    assert line.split()[3:5] == [f"{val['val/bpb']:.4f}", f"{val['val/unk_share']:.4f}"]


def test_the_loader_gives_the_targets_bytes_and_resumes_with_them():
    ids = np.arange(40) % 7
    lengths = (np.arange(40) % 5 + 1).astype(np.uint8)
    loader = SegmentLoader(ids, 2, 4, target_bytes=lengths)
    whole = list(loader)
    rows = lengths.reshape(2, 20).astype(np.int64)
    for t, batch in enumerate(whole):
        assert torch.equal(target_bytes(batch), torch.from_numpy(rows[:, 4 * t + 1 : min(4 * t + 5, 20)]))
    assert target_bytes(whole[0][:2]) is None  # a batch without them
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    again = SegmentLoader(ids, 2, 4, target_bytes=lengths)
    again.load_state_dict(state)
    assert all(torch.equal(target_bytes(a), target_bytes(b)) for a, b in zip(list(again), whole[2:], strict=True))


def test_a_literal_unk_is_counted_by_the_table_and_keeps_no_byte_counts(tmp_path):
    """WikiText writes <unk> for the words it replaced: that text is what is scored, and the table counts it exactly."""
    text = "the <unk> sat on the mat \n" * 20
    paths = write_corpus(tmp_path, text, text, "the cat <unk> \n" * 5)
    dm = SegmentDataModule.from_files(**{s: str(p) for s, p in paths.items()}, tokenizer="word",
                                      cache_dir=tmp_path / "cache", batch_size=2, tgt_len=8)
    assert set(dm.cache.target_bytes) == {"test"}  # only "cat" is unknown
    assert dm.cache.meta["splits"]["val"]["counted_bytes"] == len(text.encode("utf-8"))
    assert dm.cache.target_bytes["test"].tolist() == reference_bytes("word", "the cat <unk> \n" * 5)
