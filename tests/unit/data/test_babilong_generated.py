"""data.train_samples=stream: a training split made while training. Its batches are checked against the cached
split's own machinery (the token cache's encoder and :class:`SegmentLoader`) over the same samples, its samples
against the val and test splits, and its position against an unbroken read."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from xl.config.schema import STREAM as SCHEMA_STREAM
from xl.config.schema import BabilongDataSchema
from xl.data import DataError, SegmentLoader
from xl.data.babilong.data import BabilongDataModule
from xl.data.babilong.generated import STREAM, VOCABULARY_ROW, SampleStream
from xl.data.babilong.samples import split_of
from xl.data.cache import encode_documents
from xl.data.sources import StdlibSource, TextFilesSource
from xl.model.documents import Documents
from xl.settings.bounds import check_fields


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    """A small background source: a few stdlib modules, one per split."""
    import inspect
    import json
    import textwrap

    folder = tmp_path_factory.mktemp("background")
    paths = {}
    for split, module in (("train", textwrap), ("val", json.decoder), ("test", json.encoder)):
        paths[split] = folder / f"{split}.txt"
        paths[split].write_text(inspect.getsource(module))
    return TextFilesSource(paths["train"], paths["val"], paths["test"])


def data(tmp_path, background, **settings):
    values = {"tasks": ["qa1", "qa2"], "length": 0, "train_samples": STREAM, "eval_samples": 20, "seed": 0,
              "tokenizer": "word", "batch_size": 3, "tgt_len": 7, "cache_dir": str(tmp_path / "cache"), **settings}
    return BabilongDataModule(background, **values)


def batches(loader, k: int) -> list[tuple]:
    it = iter(loader)
    return [next(it) for _ in range(k)]


def as_lists(batch) -> list:
    """A batch's tensors and its Documents' fields, comparable with ==."""
    out = []
    for part in batch:
        if isinstance(part, Documents):
            out += [part.pos.tolist(), part.latest_start, part.target_pos.tolist()]
        else:
            out.append(part.tolist())
    return out


def test_the_schema_and_the_data_name_the_stream_alike():
    assert SCHEMA_STREAM == STREAM
    check_fields(BabilongDataSchema(background=None, train_samples=STREAM), "data.")
    with pytest.raises(ValueError, match=r"data.train_samples must be an integer >= 1 or stream, got 'many'"):
        check_fields(BabilongDataSchema(background=None, train_samples="many"), "data.")
    with pytest.raises(DataError, match="data.train_samples must be a whole number >= 1 or stream"):
        BabilongDataModule(StdlibSource(), train_samples="many")


def test_a_sample_is_a_function_of_seed_row_and_index_alone(background):
    count = len  # any counter: the samples depend on it only through lengths
    a = SampleStream(background, ["qa1", "qa2"], 300, 0, count, pool_tokens=5000)
    b = SampleStream(background, ["qa1", "qa2"], 300, 0, count, pool_tokens=5000)
    late = b.sample(2, 9)  # made first, with no sample before it
    assert [a.sample(2, j) for j in range(10)][9] == late
    assert a.sample(1, 0) != a.sample(0, 1)
    assert [a.sample(0, j).story.task for j in range(3)] == ["qa1", "qa2", "qa1"]
    other = SampleStream(background, ["qa1", "qa2"], 300, 1, count, pool_tokens=5000)
    assert [other.sample(0, j).prompt for j in range(5)] != [a.sample(0, j).prompt for j in range(5)]
    assert all(len(a.sample(0, j).context) <= 300 for j in range(5))  # the background is there, within the length


def test_the_same_seed_gives_the_same_batches_and_another_seed_others(tmp_path, background):
    first = batches(data(tmp_path / "a", background).train_dataloader(), 12)
    again = batches(data(tmp_path / "b", background).train_dataloader(), 12)
    assert [as_lists(b) for b in first] == [as_lists(b) for b in again]
    other = batches(data(tmp_path / "c", background, seed=1).train_dataloader(), 12)
    assert [b[0].tolist() for b in other] != [b[0].tolist() for b in first]


def test_no_story_of_the_val_or_test_split_is_trained_on(tmp_path, background):
    dm = data(tmp_path, background, eval_samples=300)
    held_out = {s.story.key() for split in ("val", "test") for s in dm.source.samples(split)}
    trained = [dm.stream.sample(row, j).story for row in (VOCABULARY_ROW, 0, 1, 2, 7) for j in range(300)]
    assert all(split_of(story) == "train" for story in trained)
    assert held_out.isdisjoint(story.key() for story in trained)
    assert len({story.key() for story in trained}) > 0.3 * len(trained)  # rows draw different stories


class Samples:
    """The samples of one training row as a source's documents: what the token cache would encode."""

    def __init__(self, stream: SampleStream, row: int, n: int) -> None:
        self.stream, self.row, self.n = stream, row, n

    def documents(self, split: str):
        for j in range(self.n):
            sample = self.stream.sample(self.row, j)
            yield True, sample.prompt
            yield False, sample.answer, True

    def setting(self, split: str) -> str:
        return "a training row"


@pytest.mark.parametrize("tokenizer,length,loss,tasks", [("word", 0, "answer", ["qa1", "qa2"]),
                                                          ("byte", 120, "answer", ["qa1", "qa4"]),
                                                          ("char", 0, "all", ["qa2", "qa5"])])
def test_the_stream_is_cut_as_the_cached_split_of_its_samples_would_be(tmp_path, background, tokenizer, length, loss,
                                                                       tasks):
    """Each row's samples, encoded by the token cache's encoder and laid in rows by the cached split's loader,
    give the stream's batches: inputs, targets, document positions, answer-only targets, bytes."""
    dm = data(tmp_path, background, tokenizer=tokenizer, length=length, loss=loss, tasks=tasks)
    k, rows, tgt_len = 40, 3, 7
    got = batches(dm.train_dataloader(), k)
    tok = dm.tokenizer
    parts = []
    for row in range(rows):
        ids, starts, _, _, position_bytes, answers = encode_documents(Samples(dm.stream, row, 60), "train", tok,
                                                                      Counter())
        assert ids.size > k * tgt_len + 1
        parts.append((ids, starts, position_bytes, answers))
    n = k * tgt_len + 1  # the tokens each row's first k segments read
    ids = np.concatenate([p[0][:n] for p in parts])
    starts = np.concatenate([p[1][p[1] < n] + r * n for r, p in enumerate(parts)])
    spans = np.concatenate([np.clip(p[3], None, n) + r * n for r, p in enumerate(parts)])
    table = tok.token_bytes()
    n_bytes = np.concatenate([(table[p[0]] if p[2] is None else p[2])[:n] for p in parts])
    reference = SegmentLoader(ids, rows, tgt_len, doc_starts=starts, scored=spans if loss == "answer" else None,
                              target_bytes=n_bytes if tokenizer != "byte" else None)
    assert len(reference) == k
    assert [as_lists(b) for b in got] == [as_lists(b) for b in reference]
    if loss == "answer":
        assert any((b[1] != -100).any() for b in got) and all((b[1] == -100).float().mean() > 0.5 for b in got)


def test_ranks_read_disjoint_rows_of_one_layout(tmp_path, background):
    """With 2 devices, rank r reads rows 3r … 3r+2 of the 6 rows one device with batch size 6 reads."""
    dm = data(tmp_path, background, batch_size=6)
    whole = batches(dm.train_dataloader(), 6)
    tok = dm.tokenizer
    from xl.data.babilong.generated import GeneratedLoader, encode_sample

    def make(row, j):
        return encode_sample(dm.stream.sample(row, j), tok)

    for rank in (0, 1):
        part = batches(GeneratedLoader(make, 3, 7, rank, 2), 6)
        for a, b in zip(part, whole, strict=True):
            assert torch.equal(a[0], b[0][3 * rank : 3 * rank + 3]) and torch.equal(a[1], b[1][3 * rank : 3 * rank + 3])


def test_a_loader_resumed_from_its_state_goes_on_as_the_unbroken_one(tmp_path, background):
    dm = data(tmp_path, background, length=150, tokenizer="byte", tasks=["qa1", "qa4"])
    whole = [as_lists(b) for b in batches(dm.train_dataloader(), 40)]
    dm._loaders.clear()
    stopped = dm.train_dataloader()
    assert len(batches(stopped, 23)) == 23
    state = stopped.state_dict()
    assert state["position"] == 23 and set(state["rows"]) == {"0", "1", "2"}
    for saved in (state, {**state, "rows": {}}):  # the rows as saved, or found again from their first sample
        dm._loaders.clear()
        resumed = dm.train_dataloader()
        resumed.load_state_dict(saved)
        assert [as_lists(b) for b in batches(resumed, 17)] == whole[23:]
    dm._loaders.clear()
    with pytest.raises(DataError, match="data.batch_size"):
        dm.train_dataloader().load_state_dict({**state, "batch_size": 4})


def test_iter_goes_on_where_the_last_epoch_stopped(tmp_path, background):
    loader = data(tmp_path, background).train_dataloader()
    first = [as_lists(b) for b in batches(loader, 4)]
    second = [as_lists(b) for b in batches(loader, 4)]
    fresh = data(tmp_path, background).train_dataloader()
    assert first + second == [as_lists(b) for b in batches(fresh, 8)]
