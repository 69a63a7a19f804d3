"""Bits per byte count the real UTF-8 bytes of what each <unk> replaced (char and word tokenizers).

The reference is written here from the raw text: each position's bytes (a character's UTF-8 length; a word's UTF-8
length and its separator, the end of a line one byte). For text in the form "w w \\n" its sum is the text's size,
the per-token rule the table follows for known symbols. The byte total the metrics add up (through a real Trainer)
must equal the reference over exactly the scored targets, for any batch size and across a resume.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import CONF_DIR, compose_config, tiny_overrides
from tests.test_data import write_corpus
from xl.build import build_run
from xl.data import SegmentDataModule, SegmentLoader
from xl.documents import target_bytes
from xl.evaluate import evaluate

TRAIN = "the cat sat on the mat \n" * 30 + "a dog ran \n" * 10
# Characters and words the training split lacks, of 1 to 4 bytes (and, for words, of several lengths).
VAL = "the zürich cat sat 日本語 on 🙂 mat \nthe naïve dog ran x \n" * 6
TEST = "the — cat ǅ sat on 𝔘𝔫𝔦 the mat \n" * 5


def reference_bytes(unit: str, text: str) -> list[int]:
    """Each position's UTF-8 bytes, from the raw text."""
    if unit == "char":
        return [len(c.encode("utf-8")) for c in text]
    lengths = []
    for line in text.split("\n")[:-1]:
        lengths += [len(w.encode("utf-8")) + 1 for w in line.split()] + [1]
    return lengths


def scored(lengths: list[int], batch_size: int) -> int:
    """The bytes of the targets an ordered loader scores: rows of equal length, each row's first token unscored."""
    row = len(lengths) // batch_size
    return int(np.asarray(lengths[: batch_size * row]).reshape(batch_size, row)[:, 1:].sum())


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
    """The running byte totals of the module's metrics after each batch (its own public state)."""

    def __init__(self) -> None:
        self.val: list[int] = []
        self.train: list[int] = []

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val.append(int(module.metrics.sums["val_nll"].bytes))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train.append(int(module.metrics.sums["train_nll"].bytes))


def config(tmp_path: Path, paths: dict[str, Path], unit: str, run: str, *extra: str):
    return compose_config(*tiny_overrides(tmp_path / run, paths), f"data.tokenizer={unit}",
                          "trainer.limit_val_batches=1.0", "trainer.num_sanity_val_steps=0",
                          "callbacks.model_checkpoint.monitor=null", *extra)


@pytest.mark.parametrize("unit", ["char", "word"])
def test_bits_per_byte_count_the_texts_real_bytes_for_any_batch_size(tmp_path, paths, unit):
    lengths = reference_bytes(unit, VAL)
    for batch_size, tgt_len in ((1, 7), (3, 5)):
        run = build_run(config(tmp_path, paths, unit, f"b{batch_size}", f"data.eval_batch_size={batch_size}",
                               f"data.eval_tgt_len={tgt_len}"))
        totals = ByteTotals()
        run.trainer.callbacks.append(totals)
        (results,) = run.trainer.validate(run.module, datamodule=run.datamodule, verbose=False)
        assert totals.val[-1] == scored(lengths, batch_size)
        if batch_size == 1:  # every position but the first is a target
            assert totals.val[-1] == len(VAL.encode("utf-8")) - lengths[0]
        nats = results["val/loss"] * (len(lengths) // batch_size - 1) * batch_size
        assert results["val/bpb"] == pytest.approx(nats / np.log(2) / totals.val[-1], rel=1e-6)


def test_training_counts_the_real_bytes_and_a_resume_continues_them(tmp_path, paths):
    """Words seen once in training are <unk> there (min_freq=2): the training split carries its bytes too. A run
    stopped after step 2 and resumed scores the same targets' bytes as an unbroken run."""
    unit, extra = "word", ("+data.tokenizer_kwargs.min_freq=2", "data.batch_size=2", "data.tgt_len=6",
                           "trainer.limit_train_batches=1.0", "trainer.limit_val_batches=0",
                           "callbacks.model_checkpoint.every_n_train_steps=2")
    train = "the cat sat \nthe zürich cat sat 日本語 \na über dog ʃʃ ran \nünï the ñ \n" + TRAIN  # in steps 1 to 4
    (tmp_path / "corpus").mkdir()
    paths = write_corpus(tmp_path / "corpus", train, VAL, TEST)

    def fit(run_name: str, *more: str) -> list[int]:
        run = build_run(config(tmp_path, paths, unit, run_name, *extra, *more))
        totals = ByteTotals()
        run.trainer.callbacks.append(totals)
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
        assert "train" in run.datamodule.cache.target_bytes
        return totals.train

    lengths = reference_bytes(unit, train)
    row = len(lengths) // 2
    rows = np.asarray(lengths[: 2 * row]).reshape(2, row)
    per_step = [int(rows[:, 6 * t + 1 : 6 * t + 7].sum()) for t in range(4)]  # segments of 6 targets
    whole = fit("whole", "trainer.max_steps=4")
    assert whole == list(np.cumsum(per_step))
    data = ["data=text", *(f"data.{s}={p}" for s, p in paths.items()), "data.tokenizer=word", "data.batch_size=2",
            "data.tgt_len=6", "+data.tokenizer_kwargs.min_freq=2", f"data.cache_dir={tmp_path / 'whole' / 'cache'}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):  # xl.evaluate of that run
        cfg = compose("evaluate", overrides=[
            f"ckpt={tmp_path / 'whole' / 'run'}", "splits=[val]", *data, f"paths.output_dir={tmp_path / 'eval'}",
            "+trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false"])
    results = evaluate(cfg)["val"]
    counted = results["val/loss"] * results["val/tokens"] / np.log(2) / results["val/bpb"]
    assert round(counted) == scored(reference_bytes(unit, VAL), 2)
    assert counted == pytest.approx(round(counted), rel=1e-6)
    fit("first", "trainer.max_steps=2")
    resumed = fit("second", "trainer.max_steps=4", f"ckpt_path={tmp_path / 'first' / 'run'}")
    assert resumed == list(np.cumsum(per_step)[2:])  # the epoch's sums go on from the checkpoint's


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
