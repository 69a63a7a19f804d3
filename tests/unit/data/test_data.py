"""The data package: exact token streams, per-rank rows, resumable order, caches, configs and errors."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import lightning
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from tqdm import tqdm

from tests.helpers.paths import ROOT
from xl.data import DataError, SegmentDataModule, SegmentLoader, make_tokenizer, sources, split_streams
from xl.data.cache import build_cache, cache_folder, open_cache, token_dtype

CONF_DIR = ROOT / "conf"
# \r\n, a lone \r, blank lines, tabs, non-ASCII (2-, 3- and 4-byte UTF-8) and a last line without newline.
TRICKY = "first line\r\n\r\nsecond\tline  with  spaces\n\n\nhéllo wörld — 日本語 🙂\rcarriage\nno newline at end"


def write_corpus(folder: Path, train: str, val: str, test: str) -> dict[str, Path]:
    paths = {}
    for split, text in (("train", train), ("val", val), ("test", test)):
        paths[split] = folder / f"{split}.txt"
        paths[split].write_bytes(text.encode("utf-8"))
    return paths


def compose_data(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(overrides=list(overrides))


def reference_rows(ids: np.ndarray, n_rows: int) -> list[list[int]]:
    """Slow, obvious version of split_streams for all ranks: row k is the k-th equal contiguous slice."""
    row_len = len(ids) // n_rows
    return [ids[k * row_len : (k + 1) * row_len].tolist() for k in range(n_rows)]


# --- stream -------------------------------------------------------------------------------------------------------


def test_segments_follow_each_row_in_order_without_skipping():
    ids = np.random.default_rng(0).integers(0, 50_000, size=1003).astype(np.uint16)
    batch_size, tgt_len = 3, 7
    rows = reference_rows(ids, batch_size)
    loader = SegmentLoader(ids, batch_size, tgt_len)
    batches = list(loader)
    assert len(batches) == len(loader) == -(-(len(rows[0]) - 1) // tgt_len)
    for t, (x, y) in enumerate(batches):
        assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
        for b, row in enumerate(rows):
            assert x[b].tolist() == row[t * tgt_len : t * tgt_len + tgt_len][: len(row) - 1 - t * tgt_len]
            assert y[b].tolist() == row[t * tgt_len + 1 : t * tgt_len + tgt_len + 1]
    x_all = torch.cat([x for x, _ in batches], 1)
    y_all = torch.cat([y for _, y in batches], 1)
    assert x_all.tolist() == [row[:-1] for row in rows]  # every token but the last is an input exactly once
    assert y_all.tolist() == [row[1:] for row in rows]
    assert batches[-1][0].shape[1] < tgt_len  # the short last segment is kept, not dropped


def test_split_streams_gives_each_rank_disjoint_contiguous_rows():
    ids = np.arange(1000)
    batch_size, world_size = 3, 2
    rank_rows = [split_streams(ids, batch_size, rank, world_size) for rank in range(world_size)]
    assert rank_rows[0].tolist() == reference_rows(ids, 6)[:3]
    assert rank_rows[1].tolist() == reference_rows(ids, 6)[3:]
    for rows in rank_rows:
        assert rows.shape == (batch_size, 1000 // 6)
        assert (np.diff(rows, axis=1) == 1).all()  # each row is one contiguous run
        assert np.shares_memory(rows, ids)  # a view, not a copy of the (memory-mapped) corpus
    everything = np.concatenate([r.ravel() for r in rank_rows])
    assert len(set(everything.tolist())) == everything.size  # disjoint
    assert sorted(everything.tolist()) == list(range(6 * (1000 // 6)))  # union = the whole prefix


def test_state_dict_resumes_at_the_next_segment_and_a_fresh_iter_restarts():
    ids = np.arange(500)
    loader = SegmentLoader(ids, 4, 10)
    expected = [x for x, _ in SegmentLoader(ids, 4, 10)]
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state == {"position": 3, "batch_size": 4, "tgt_len": 10, "world_size": 1, "rank": 0}

    resumed = SegmentLoader(ids, 4, 10)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["position"] == 3
    rest = [x for x, _ in resumed]
    assert len(rest) == len(expected) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, expected[3:], strict=True))
    # The next epoch, and an iterator abandoned after a few batches (as Lightning does), restart at 0.
    assert torch.equal(next(iter(resumed))[0], expected[0])
    assert resumed.state_dict()["position"] == 1
    assert torch.equal(next(iter(resumed))[0], expected[0])

    with pytest.raises(DataError, match="data.batch_size"):
        SegmentLoader(ids, 5, 10).load_state_dict(state)
    with pytest.raises(DataError, match="data.tgt_len"):
        SegmentLoader(ids, 4, 11).load_state_dict(state)


class _RecordSegments(lightning.LightningModule):
    """Records which segment each training step got: x[0, 0] is the segment's first token id."""

    def __init__(self, ids: np.ndarray, save_at: int | None = None, path: Path | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.ids, self.save_at, self.path, self.seen = ids, save_at, path, []
        self.loader = SegmentLoader(ids, 2, 5)

    def train_dataloader(self) -> SegmentLoader:
        return self.loader

    def training_step(self, batch, batch_idx):
        self.seen.append(int(batch[0][0, 0]) // 5)
        return (self.weight * batch[0].float()).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == self.save_at:
            self.trainer.save_checkpoint(self.path)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(max_steps: int) -> lightning.Trainer:
    # max_epochs bounds the run should a broken loader yield empty epochs forever.
    return lightning.Trainer(accelerator="cpu", max_steps=max_steps, max_epochs=3, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.mark.parametrize("save_at", [3, 5])  # mid-epoch, and the last batch of the 5-segment epoch
def test_lightning_resume_continues_the_stream(tmp_path, save_at):
    ids = np.arange(52)  # 2 rows of 26 tokens: 5 segments of 5 per epoch
    first = _RecordSegments(ids, save_at, tmp_path / "mid.ckpt")
    _trainer(save_at).fit(first)
    assert first.seen == list(range(save_at))
    resumed = _RecordSegments(ids)
    _trainer(save_at + 4).fit(resumed, ckpt_path=tmp_path / "mid.ckpt")
    assert resumed.seen == [t % 5 for t in range(save_at, save_at + 4)]


def test_too_short_corpus_names_the_setting():
    with pytest.raises(DataError, match="data.batch_size"):
        SegmentLoader(np.arange(15), 8, 4)
    with pytest.raises(DataError, match="data.tgt_len"):
        SegmentLoader(np.arange(100), 2, 0)


# --- tokenizers ---------------------------------------------------------------------------------------------------


def test_word_tokenizer_closes_lines_with_eos_and_maps_unseen_words_to_unk():
    tok = make_tokenizer("word")
    tok.fit(["the cat sat\nthe dog\n"])
    assert tok.unit == "word" and tok.vocab_size == 2 + 4
    unknown = Counter()
    ids = tok.encode("the  cow sat\r\n\nzebra cow", unknown)
    eos, unk = tok.itos.index("<eos>"), tok.itos.index("<unk>")
    the, sat = tok.itos.index("the"), tok.itos.index("sat")
    assert ids.tolist() == [the, unk, sat, eos, eos, unk, unk, eos]
    assert unknown == Counter({"cow": 2, "zebra": 1})
    assert tok.decode(ids) == "the <unk> sat\n\n<unk> <unk>\n"
    assert type(tok).from_dict(json.loads(json.dumps(tok.to_dict()))).itos == tok.itos


def test_word_tokenizer_vocabulary_settings():
    tok = make_tokenizer("word", min_freq=2, max_size=1)
    tok.fit(["a a a b b c\n"])
    assert tok.itos == ["<eos>", "<unk>", "a"]
    assert "min_freq=2" in tok.key() and "max_size=1" in tok.key()
    with pytest.raises(DataError, match="data.tokenizer"):
        make_tokenizer("sentencepiece")


def test_char_tokenizer_round_trips_and_counts_unknown_characters():
    tok = make_tokenizer("char")
    tok.fit(["abc\n", "cab ü"])
    assert tok.chars == sorted("abc\n ü") and tok.vocab_size == 7
    unknown = Counter()
    ids = tok.encode("büxx\n", unknown)
    assert ids[2] == ids[3] == tok.unk_id and unknown == Counter({"x": 2})
    assert tok.decode(tok.encode("ab ü\n")) == "ab ü\n"


def test_token_dtype_is_the_smallest_that_fits():
    assert [token_dtype(v) for v in (256, 257, 65535, 65536, 267_735)] == [np.uint8, np.uint16, np.uint16,
                                                                           np.int32, np.int32]


# --- text files through data=text ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["byte", "char"])
def test_text_files_round_trip_byte_for_byte(tmp_path, tokenizer):
    paths = write_corpus(tmp_path, TRICKY * 3, TRICKY[::-1], "tail " + TRICKY)
    overrides = [f"data.{s}={p}" for s, p in paths.items()]
    cfg = compose_data("+data=text", f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp_path / 'cache'}", *overrides)
    dm = instantiate(cfg.data)
    assert isinstance(dm, SegmentDataModule)
    dm.prepare_data()
    assert dm.unit == tokenizer
    for split, path in paths.items():
        ids = dm.cache.splits[split]
        assert isinstance(ids, np.memmap) and ids.dtype == np.uint8
        assert dm.tokenizer.decode(ids).encode("utf-8") == path.read_bytes()
    assert dm.cache.meta["splits"]["train"]["tokens"] == len(dm.cache.splits["train"])


def test_byte_tokenizer_keeps_even_binary_files_exact(tmp_path):
    garbage = bytes(range(256)) * 3 + b"\xff\xfe\x00 not utf-8 \xc3"
    paths = write_corpus(tmp_path, "x", "y", "z")
    paths["train"].write_bytes(garbage)
    cache = open_cache(sources.TextFilesSource(**paths), make_tokenizer("byte"), tmp_path / "cache")
    assert bytes(cache.splits["train"]) == garbage


def test_char_cache_reports_unknown_characters_of_val(tmp_path):
    paths = write_corpus(tmp_path, "abc abc\n", "abz éé\n", "cab\n")
    cache = open_cache(sources.TextFilesSource(**paths), make_tokenizer("char"), tmp_path / "cache")
    val = cache.meta["splits"]["val"]
    assert val["unknown"] == 3 and dict(val["unknown_top"]) == {"é": 2, "z": 1}
    assert cache.meta["splits"]["train"]["unknown"] == 0
    assert cache.meta["vocab_size"] == cache.tokenizer.vocab_size == len(set("abc \n")) + 1


@pytest.mark.parametrize(
    "content,tokenizer,setting",
    [
        (None, "byte", "data.val"),  # missing file
        (b"", "byte", "data.val"),  # empty file
        (b"text\x00\x00\x01binary", "char", "data.val"),  # NUL bytes
        (b"caf\xe9 latin-1 \xff", "word", "data.val"),  # not UTF-8
    ],
)
def test_bad_files_raise_data_error_naming_the_setting(tmp_path, content, tokenizer, setting):
    paths = write_corpus(tmp_path, "some training text\n", "x", "some test text\n")
    if content is None:
        paths["val"].unlink()
    else:
        paths["val"].write_bytes(content)
    dm = SegmentDataModule.from_files(**{s: str(p) for s, p in paths.items()}, tokenizer=tokenizer,
                                      cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=setting):
        dm.prepare_data()
    assert not any(p.name == "meta.json" for p in (tmp_path / "cache").rglob("*"))


def test_datamodule_rejects_a_split_too_short_for_one_batch(tmp_path):
    paths = write_corpus(tmp_path, "long enough training text " * 20, "tiny", "long enough test text " * 20)
    dm = SegmentDataModule.from_files(**{s: str(p) for s, p in paths.items()}, batch_size=2, eval_batch_size=3,
                                      tgt_len=8, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=r"val split.*data\.eval_batch_size"):
        dm.setup("fit")
    dm.setup("test")
    loader = dm.test_dataloader()
    assert (loader.batch_size, loader.tgt_len) == (3, 8) and dm.train_dataloader().batch_size == 2
    assert dm.train_dataloader() is dm.train_dataloader()  # the object whose position Lightning checkpoints
    copy = pickle.loads(pickle.dumps(dm))  # as ddp_spawn does: small, and it reopens the cache
    assert len(pickle.dumps(dm)) < 2000 and copy.test_dataloader().rows.tolist() == loader.rows.tolist()


# --- cache --------------------------------------------------------------------------------------------------------


class CountingSource(sources.TextFilesSource):
    calls = 0

    def texts(self, split):
        CountingSource.calls += 1
        yield from super().texts(split)

    def documents(self, split):
        CountingSource.calls += 1
        yield from super().documents(split)


def test_cache_is_built_once_and_reused(tmp_path, monkeypatch):
    paths = write_corpus(tmp_path, "train text\n" * 50, "val text\n", "test text\n")
    source = CountingSource(**paths)
    monkeypatch.setenv("XL_CACHE_DIR", str(tmp_path / "env-cache"))
    first = open_cache(source, make_tokenizer("word"), None)
    assert first.folder.parent == tmp_path / "env-cache"
    assert CountingSource.calls == 4  # fit on train, then encode train, val, test
    # val and test have a word the training split lacks (<unk>): their positions' byte counts are kept too
    assert {p.name for p in first.folder.iterdir()} == {"train.npy", "val.npy", "test.npy", "train.docs.npy",
                                                        "val.docs.npy", "test.docs.npy", "val.bytes.npy",
                                                        "test.bytes.npy", "tokenizer.json", "meta.json"}
    second = open_cache(source, make_tokenizer("word"), None)
    assert CountingSource.calls == 4 and second.folder == first.folder
    assert second.tokenizer.itos == first.tokenizer.itos
    assert np.array_equal(second.splits["train"], first.splits["train"])
    # Other tokenizer settings, or a changed file, get their own folder.
    assert cache_folder(source, make_tokenizer("word", min_freq=2)) != first.folder
    paths["val"].write_text("changed val text\n")
    assert cache_folder(source, make_tokenizer("word"), None) != first.folder


class Terminal(io.StringIO):
    """A stderr that says it is a terminal (tqdm draws its bars only there)."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tokenizer", ["word", "bpe"])
def test_a_cache_build_shows_its_progress_on_a_terminal_and_nothing_elsewhere(tmp_path, monkeypatch, tokenizer):
    """Fitting the vocabulary and encoding each split draw a bar on stderr with the split's size as total, where
    stderr is a terminal; elsewhere (a pipe, a log, this test suite) the build writes nothing."""
    paths = write_corpus(tmp_path, "train text with some words\n" * 4000, "val text\n" * 50, "test text\n" * 50)
    kwargs = {"vocab_size": 300} if tokenizer == "bpe" else {}
    terminal, pipe = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    open_cache(sources.TextFilesSource(**paths), make_tokenizer(tokenizer, **kwargs), tmp_path / "piped")
    assert pipe.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", terminal)
    open_cache(sources.TextFilesSource(**paths), make_tokenizer(tokenizer, **kwargs), tmp_path / "shown")
    drawn = terminal.getvalue()
    assert f"fitting the {tokenizer} vocabulary on train" in drawn
    for split in ("train", "val", "test"):  # each bar's first draw shows its total
        total = tqdm.format_sizeof(paths[split].stat().st_size, divisor=1024)
        assert re.search(rf"encoding {split}: +0%.*0\.00/{re.escape(total)}B? ", drawn), drawn


def test_word_vocabulary_scales_to_wikitext103_size(tmp_path, monkeypatch):
    """267,733 distinct training words (+ <eos>, <unk>: WikiText-103's 267,735), built once, ids as int32."""
    n = 267_733
    words = np.array([f"w{i}" for i in range(n)])
    rng = np.random.default_rng(0)
    frequent = (rng.zipf(1.5, 300_000) - 1) % 1000  # a Zipf head on top of one occurrence of every word
    train_ids = np.concatenate([rng.permutation(n), frequent])
    lines = lambda ids: "\n".join(" ".join(words[ids[i:i + 25]]) for i in range(0, len(ids), 25)) + "\n"  # noqa: E731
    val_ids = rng.integers(0, n, 5000)
    paths = write_corpus(tmp_path, lines(train_ids), lines(val_ids) + "never_seen\n", lines(val_ids[:100]))
    kwargs = dict(tokenizer="word", cache_dir=str(tmp_path / "cache"), batch_size=2, tgt_len=8)
    start = time.perf_counter()
    cache = SegmentDataModule.from_files(**{k: str(v) for k, v in paths.items()}, **kwargs).cache
    seconds = time.perf_counter() - start
    tok = cache.tokenizer
    assert tok.vocab_size == n + 2 and cache.splits["train"].dtype == np.int32
    assert tok.itos[2] == "w0"  # the most frequent word gets the first id after the two specials
    assert tok.decode(cache.splits["val"]) == lines(val_ids) + "<unk>\n"
    assert cache.meta["splits"]["val"]["unknown"] == 1
    # Built once: a second data module reads the cache and never refits the 267k-word vocabulary.
    monkeypatch.setattr(type(tok), "fit", lambda self, texts: pytest.fail("the vocabulary was fitted again"))
    again = SegmentDataModule.from_files(**{k: str(v) for k, v in paths.items()}, **kwargs).cache
    assert again.tokenizer.itos == tok.itos and np.array_equal(again.splits["train"], cache.splits["train"])
    assert seconds < 60, f"building a 267k-word vocabulary took {seconds:.1f} s"


def test_a_failed_build_leaves_nothing_that_is_trusted_later(tmp_path, monkeypatch):
    paths = write_corpus(tmp_path, "train text\n", "val text\n", "test text\n")
    source = sources.TextFilesSource(**paths)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(np, "save", full_disk)
        with pytest.raises(DataError, match=r"^the disk of data.cache_dir=\S+ is full \(No space left on device\); "):
            build_cache(source, make_tokenizer("byte"), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # no cache folder, no half-written or temporary file
    assert bytes(open_cache(source, make_tokenizer("byte"), tmp_path / "cache").splits["val"]) == b"val text\n"


# --- sources ------------------------------------------------------------------------------------------------------


def test_stdlib_source_is_deterministic_and_skips_tests_and_site_packages(tmp_path, monkeypatch):
    files = ["a.py", "zz.py", "pkg/b.py", "pkg/sub/c.py", "test/t.py", "pkg/tests/t.py", "idlelib/idle_test/t.py",
             "site-packages/s.py", "notes.txt"] + [f"m{i}.py" for i in range(40)]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(sources, "stdlib_dir", lambda: tmp_path)
    source = sources.StdlibSource()
    kept = [relative for relative, _ in source.files()]
    assert kept == sorted(n for n in files if n.endswith(".py") and "test" not in n and "site-packages" not in n)
    by_split = {split: list(source.texts(split)) for split in sources.SPLITS}
    assert by_split == {split: list(sources.StdlibSource().texts(split)) for split in sources.SPLITS}
    assert all(by_split.values())  # 45 files: every split gets some
    assert sorted(sum(by_split.values(), [])) == sorted(f"# {n}\n\n" for n in kept)
    assert str(tmp_path) in source.identity()


def test_real_stdlib_corpus_is_big_enough():
    source = sources.StdlibSource()
    size = sum(len(text.encode("utf-8")) for split in sources.SPLITS for text in source.texts(split))
    assert size > 5_000_000
    assert not any("/test/" in f"/{relative}" or "site-packages" in relative for relative, _ in source.files())


def fake_datasets(monkeypatch, load_dataset) -> list[tuple]:
    """``datasets`` replaced by one whose ``load_dataset`` is given (skips a 2 s import); returns its calls."""
    calls = []

    def load(*args, **kwargs):
        calls.append(args)
        return load_dataset(*args, **kwargs)

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=load))
    return calls


class Rows:
    """What ``datasets.load_dataset`` returns, as far as HubSource reads it."""

    def __init__(self, rows: list[str]) -> None:
        self.rows = rows

    def iter(self, batch_size: int):
        yield {"text": self.rows}


def test_hub_source_offline_reads_the_datasets_cache(monkeypatch):
    """HF_DATASETS_OFFLINE=1 (or HF_HUB_OFFLINE=1) lets datasets read a copy already in its cache."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    calls = fake_datasets(monkeypatch, lambda *args, split: Rows([" = Title = ", " words of the article "]))
    assert "".join(sources.HubSource("wikitext-2").texts("val")) == " = Title = \n words of the article \n"
    assert calls == [("Salesforce/wikitext", "wikitext-2-v1")]


def test_hub_source_offline_without_a_cached_copy_says_what_to_do(monkeypatch):
    def not_cached(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    fake_datasets(monkeypatch, not_cached)
    with pytest.raises(DataError) as info:
        list(sources.HubSource("wikitext-2").texts("val"))
    assert str(info.value) == ("wikitext-2 is not in the datasets cache (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set); "
                               "fetch Salesforce/wikitext (wikitext-2-v1) elsewhere and use data=text "
                               "data.train=PATH data.val=PATH data.test=PATH")


HUB_SENTENCES = {  # the source, what to fetch and where to pass it
    "wikitext-2": ("Salesforce/wikitext (wikitext-2-v1) elsewhere and use data=text data.train=PATH data.val=PATH "
                   "data.test=PATH"),
    "PG-19": "deepmind/pg19 elsewhere and use data/background=text, or data/background=stdlib (no download)",
}


@pytest.mark.parametrize("name,flag", [("wikitext-2", None), ("PG-19", None), ("PG-19", "HF_HUB_OFFLINE"),
                                       ("PG-19", "HF_DATASETS_OFFLINE")])
def test_a_hub_dataset_out_of_reach_fails_at_once_in_one_short_sentence(name, flag, monkeypatch, capfd, caplog):
    """A benchmark and BABILong's PG-19 background take one path to the hub (xl.data.sources.from_hub): with no
    hub, one check and one sentence naming what to fetch and where to pass it, and datasets (whose retries print a
    warning each, for about 30 s) is never called; with an offline flag, the same at once for a stream, which has
    no cache (a benchmark reads the datasets cache: the test above). The flags are set and cleared here, whatever
    the environment holds."""
    from xl.data.babilong.background import PG19Source

    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    if flag:
        monkeypatch.setenv(flag, "1")
    monkeypatch.setattr(sources, "hub_unreachable", lambda: "[Errno 111] Connection refused")
    calls = fake_datasets(monkeypatch, lambda *args, **kwargs: pytest.fail("datasets was asked"))
    source = sources.HubSource("wikitext-2") if name == "wikitext-2" else PG19Source()
    with pytest.raises(DataError) as info:
        next(iter(source.texts("val")))
    head = (f"{name}: the hub cannot be reached ([Errno 111] Connection refused)" if flag is None else
            f"{name} is streamed from the hub, which HF_DATASETS_OFFLINE/HF_HUB_OFFLINE forbid")
    assert str(info.value) == f"{head}; fetch {HUB_SENTENCES[name]}"
    assert len(str(info.value)) < 200 and calls == []
    assert capfd.readouterr() == ("", "") and caplog.records == []


def test_hub_source_unreachable_fails_at_once_without_retries(tmp_path):
    """No offline flag and no network: one quick check of the hub, then the sentence (datasets itself retries for
    about 23 s over 25 lines). The path users run: a fresh process, datasets' real import."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(ROOT))
    code = ("import time\nfrom xl.data import sources\nstart = time.perf_counter()\n"
            "try:\n    list(sources.HubSource('wikitext-2').texts('val'))\n"
            "finally:\n    print(time.perf_counter() - start)")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    seconds = float(result.stdout)  # from the call on: the imports before it take seconds on a busy machine
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("xl.data.errors.DataError: wikitext-2: the hub cannot be reached (")
    assert message.endswith("); fetch Salesforce/wikitext (wikitext-2-v1) elsewhere and use data=text "
                            "data.train=PATH data.val=PATH data.test=PATH")
    assert "Retrying" not in result.stderr and seconds < 5


def test_hub_source_connection_error_gives_the_same_hint(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'LTCB/enwik8' on the Hub")

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_unreachable", lambda: None)  # the hub answers, the dataset fails
    fake_datasets(monkeypatch, unreachable)
    with pytest.raises(DataError, match="use data=text data.train=PATH"):
        list(sources.HubSource("enwik8").texts("train"))
    with pytest.raises(DataError, match="data.source.name"):
        sources.HubSource("ptb")


# --- configs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stdlib", "text", "wikitext103", "wikitext2", "enwik8", "text8"])
def test_data_configs_compose_and_instantiate(name, tmp_path):
    paths = [f"data.{s}={tmp_path / s}.txt" for s in sources.SPLITS] if name == "text" else []
    cfg = compose_data(f"+data={name}", *paths)
    assert (cfg.data.batch_size, cfg.data.tgt_len, cfg.data.eval_batch_size, cfg.data.eval_tgt_len) == (8, 128,
                                                                                                      None, None)
    dm = instantiate(cfg.data)  # lazy: nothing is read or downloaded yet
    assert isinstance(dm, SegmentDataModule)
    assert (dm.eval_batch_size, dm.eval_tgt_len) == (8, 128)
    expected = {"stdlib": "byte", "text": "byte", "wikitext103": "word", "wikitext2": "word", "enwik8": "byte",
                "text8": "char"}[name]
    assert dm.tokenizer_name == expected


def test_default_cache_dir_is_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("XL_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = cache_folder(sources.StdlibSource(), make_tokenizer("byte"))
    assert folder.parent == tmp_path / ".cache" / "xl"
    assert os.fspath(folder).startswith(os.fspath(tmp_path))
