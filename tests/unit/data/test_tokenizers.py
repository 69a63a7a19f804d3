"""Subword tokenizers (byte-level BPE and Unigram through Hugging Face tokenizers): exact round trips, byte-length
tables against a slow reference, frequency-ranked ids, the cache's key rules, tokenizer files and bad input."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.unit.data.test_data import TRICKY, write_corpus
from xl.data import DataError, SegmentDataModule, make_tokenizer, sources
from xl.data import cache as cache_module
from xl.data import subwords as subwords_module
from xl.data import tokenizers as tok_module
from xl.data.cache import build_cache, cache_folder, open_cache
from xl.data.tokenizers import default_cutoffs
from xl.data.words import vocabulary_json

SUBWORDS = ["bpe", "unigram"]


@functools.cache
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-symbol table (Radford et al., 2019, encoder.py), inverted: symbol -> byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def reference_token_bytes(tokenizer, token_id: int) -> bytes:
    """Slow and obvious: the bytes one token stands for, from its symbols (special tokens: their text)."""
    hf_id = int(tokenizer.order[token_id])
    piece = tokenizer.hf.id_to_token(hf_id)
    if hf_id in tokenizer.hf.get_added_tokens_decoder():
        return piece.encode("utf-8")
    decoder = gpt2_byte_decoder()
    return bytes(decoder[c] for c in piece)


def text_corpus(tmp_path: Path, corpus: dict[str, Path]) -> dict[str, Path]:
    """The shared corpus with tricky text (CRLF, tabs, 2-4 byte UTF-8, a special token written literally) mixed in."""
    folder = tmp_path / "text"
    folder.mkdir()
    texts = {split: path.read_text(encoding="utf-8") for split, path in corpus.items()}
    return write_corpus(folder, texts["train"] + TRICKY + "<§sep>", TRICKY + texts["val"] + " <§sep> x",
                        texts["test"] + TRICKY[::-1])


def datamodule(paths: dict[str, Path], cache_dir: Path, tokenizer: str = "bpe", file: Path | None = None,
               **kwargs) -> SegmentDataModule:
    return SegmentDataModule.from_files(**{s: str(p) for s, p in paths.items()}, tokenizer=tokenizer,
                                        tokenizer_kwargs=kwargs, tokenizer_file=file, cache_dir=cache_dir,
                                        batch_size=2, tgt_len=16)


def hf_tokenizer(model: str = "BPE", vocab_size: int = 300, special_tokens: list[str] | None = None,
                 byte_level: bool = True) -> Tokenizer:
    """A tokenizer built directly with Hugging Face tokenizers, as a user's tokenizer.json would be."""
    tok = Tokenizer(getattr(models, model)())
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = {"BPE": trainers.BpeTrainer, "Unigram": trainers.UnigramTrainer}[model](
        vocab_size=vocab_size, special_tokens=special_tokens or [], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [])
    tok.train_from_iterator(["hello world, hello tokens\n" * 20, TRICKY], trainer)
    return tok


# --- exactness ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SUBWORDS)
def test_subword_cache_decodes_every_split_byte_for_byte(tmp_path, corpus, name):
    paths = text_corpus(tmp_path, corpus)
    dm = datamodule(paths, tmp_path / "cache", name, vocab_size=400, special_tokens=["<§sep>"])
    dm.prepare_data()
    tok = dm.tokenizer
    assert dm.unit == "token" and dm.vocab_size == tok.vocab_size == 400
    for split, path in paths.items():
        ids = dm.cache.splits[split]
        assert ids.dtype == np.uint16 and ids.max() < dm.vocab_size
        assert tok.decode(ids).encode("utf-8") == path.read_bytes()
    sep = int(np.flatnonzero(tok.order == tok.hf.token_to_id("<§sep>"))[0])
    assert (dm.cache.splits["val"] == sep).sum() == 1  # the literal text of a special token is that token


@pytest.mark.parametrize("name", SUBWORDS)
def test_token_bytes_match_a_slow_reference_and_sum_to_each_split(tmp_path, corpus, name):
    paths = text_corpus(tmp_path, corpus)
    dm = datamodule(paths, tmp_path / "cache", name, vocab_size=400, special_tokens=["<§sep>"])
    tok = dm.tokenizer
    table = tok.token_bytes()
    assert table.dtype == np.int64 and table.shape == (tok.vocab_size,)
    assert table.tolist() == [len(reference_token_bytes(tok, i)) for i in range(tok.vocab_size)]
    for split, path in paths.items():
        ids = dm.cache.splits[split]
        assert b"".join(reference_token_bytes(tok, int(i)) for i in ids) == path.read_bytes()
        info = dm.cache.meta["splits"][split]
        assert info["bytes"] == info["token_bytes"] == int(table[ids].sum()) == path.stat().st_size
    assert dm.token_bytes.tolist() == table.tolist()


@pytest.mark.parametrize("pre_tokenizer", ["gpt2", "digits"])
def test_encoding_in_pieces_equals_one_encode_of_the_whole_text(monkeypatch, pre_tokenizer):
    """The cut into parallel pieces falls where the pre-tokenizer cuts anyway, so the ids do not change."""
    text = ("def f(x):\n    return x  \n\n\t  y = 12345 + 'héllo'  \n" * 40) + " \n  \n" + TRICKY * 5
    tok = make_tokenizer("bpe", vocab_size=300, pre_tokenizer=pre_tokenizer)
    tok.fit([text])
    whole = tok.hf.encode(text, add_special_tokens=False).ids
    monkeypatch.setattr(subwords_module, "PIECE_CHARS", 7)
    assert len(subwords_module._pieces(text)) > 40
    assert tok.encode(text).tolist() == whole
    batch = tok.encode_batch([text, "", "x\ny", text])
    assert [b.tolist() for b in batch] == [whole, [], tok.hf.encode("x\ny").ids, whole]
    assert tok.decode(tok.encode(text)) == text


def test_digits_pre_tokenizer_splits_every_digit():
    tok = make_tokenizer("bpe", vocab_size=300, pre_tokenizer="digits")
    tok.fit(["12 12 12 12 123 1234\n" * 50])
    assert all(len(reference_token_bytes(tok, int(i)).strip()) <= 1 for i in tok.encode("2024 and 99"))


def test_ids_are_ranked_by_training_frequency(tmp_path, corpus):
    paths = text_corpus(tmp_path, corpus)
    dm = datamodule(paths, tmp_path / "cache", "bpe", vocab_size=400, special_tokens=["<never>"])
    counts = np.bincount(dm.cache.splits["train"], minlength=dm.vocab_size)
    assert (np.diff(counts) <= 0).all() and counts[0] > counts[-1] == 0
    never = int(np.flatnonzero(dm.tokenizer.order == dm.tokenizer.hf.token_to_id("<never>"))[0])
    assert never >= (counts > 0).sum() and dm.tokenizer.decode([never]) == "<never>"  # unseen: after all seen ids
    assert dm.tokenizer.ranked and dm.default_cutoffs == []


def test_default_cutoffs_plain_softmax_for_subword_sizes_adaptive_above():
    assert default_cutoffs(4096, True) == default_cutoffs(32768, True) == []
    assert default_cutoffs(32769, True) == default_cutoffs(50257, True) == [8192]
    assert default_cutoffs(267_735, True) == [8192, 32768, 131072]
    assert default_cutoffs(267_735, False) == []  # ids not ordered by frequency: no clusters


# --- cache key rules ----------------------------------------------------------------------------------------------


def test_subword_cache_is_fitted_once_and_keyed_by_every_setting(tmp_path, corpus, monkeypatch):
    paths = text_corpus(tmp_path, corpus)
    first = datamodule(paths, tmp_path / "cache", "bpe", vocab_size=300).cache
    assert first.meta["fit_seconds"] >= 0 and first.meta["encode_seconds"] >= 0
    monkeypatch.setattr(tok_module.SubwordTokenizer, "fit", lambda self, texts: pytest.fail("fitted again"))
    again = datamodule(paths, tmp_path / "cache", "bpe", vocab_size=300).cache
    assert again.folder == first.folder and np.array_equal(again.splits["val"], first.splits["val"])
    assert again.tokenizer.order.tolist() == first.tokenizer.order.tolist()
    source = sources.TextFilesSource(**paths)
    keys = {cache_folder(source, make_tokenizer(*args, **kwargs), tmp_path) for args, kwargs in [
        (("bpe",), {"vocab_size": 300}), (("bpe",), {"vocab_size": 301}), (("unigram",), {"vocab_size": 300}),
        (("bpe",), {"vocab_size": 300, "special_tokens": ["<s>"]}),
        (("bpe",), {"vocab_size": 300, "pre_tokenizer": "digits"})]}
    assert len(keys) == 5


def test_tokenizer_file_is_read_instead_of_fitted_and_keyed_by_its_content(tmp_path, corpus):
    paths = text_corpus(tmp_path, corpus)
    hf = hf_tokenizer("BPE", 320, ["<§sep>"])
    file = tmp_path / "tokenizer.json"
    hf.save(str(file))
    dm = datamodule(paths, tmp_path / "cache", "bpe", file, special_tokens=["<§sep>"])
    tok = dm.tokenizer
    assert dm.vocab_size == hf.get_vocab_size()
    text = paths["val"].read_text(encoding="utf-8")
    assert tok.encode(text).tolist() == hf.encode(text, add_special_tokens=False).ids  # the file's own ids
    for split, path in paths.items():
        assert tok.decode(dm.cache.splits[split]).encode("utf-8") == path.read_bytes()
    copy = tmp_path / "moved.json"
    copy.write_bytes(file.read_bytes())
    assert datamodule(paths, tmp_path / "cache", "bpe", copy, special_tokens=["<§sep>"]).cache.folder == dm.cache.folder
    hf_tokenizer("BPE", 330, ["<§sep>"]).save(str(copy))
    assert datamodule(paths, tmp_path / "cache", "bpe", copy, special_tokens=["<§sep>"]).cache.folder != \
        dm.cache.folder


@pytest.mark.parametrize("name", ["word", *SUBWORDS])
def test_a_tokenizer_file_gives_the_same_ids_and_fingerprint_on_any_corpus(tmp_path, corpus, name):
    """A vocabulary read from data.tokenizer_file keeps the file's ids, whatever text the cache is built from: two
    corpora whose counts rank the tokens differently give the same ids and the same fingerprint, so a model trained
    with the file reads other text as it was trained to (a fitted vocabulary is ranked by its corpus instead)."""
    if name == "word":
        file = tmp_path / "vocab.json"
        words = ["<eos>", "<unk>", "hello", "world,", "tokens", "def", "return", "self", "="]
        file.write_text(vocabulary_json(words), encoding="utf-8")
        kwargs = {}
    else:
        file = tmp_path / "tokenizer.json"
        hf_tokenizer({"bpe": "BPE", "unigram": "Unigram"}[name], 320, ["<§sep>"]).save(str(file))
        kwargs = {"special_tokens": ["<§sep>"]}
    one = text_corpus(tmp_path, corpus)
    (tmp_path / "other").mkdir()
    texts = {split: path.read_bytes().decode("utf-8") for split, path in one.items()}  # its \r\n kept
    other = write_corpus(tmp_path / "other", ("hello world, hello tokens\n" * 500) + texts["test"], texts["val"],
                         texts["test"])  # another training text, the same held-out text
    a, b = (datamodule(paths, tmp_path / f"cache{i}", name, file, **kwargs) for i, paths in enumerate((one, other)))
    counts = [np.bincount(dm.cache.splits["train"], minlength=dm.vocab_size) for dm in (a, b)]
    assert np.argsort(-counts[0], kind="stable").tolist() != np.argsort(-counts[1], kind="stable").tolist()
    assert a.cache.splits["val"].tolist() == b.cache.splits["val"].tolist()
    assert a.tokenizer_fingerprint == b.tokenizer_fingerprint
    assert tok_module.fingerprint(make_tokenizer(name, file, **kwargs)) == a.tokenizer_fingerprint  # as read
    if name != "word":
        hf = Tokenizer.from_file(str(file))
        assert a.tokenizer.encode(texts["test"]).tolist() == hf.encode(texts["test"], add_special_tokens=False).ids
        assert not a.tokenizer.ranked and a.default_cutoffs == []  # not ordered by frequency: one plain softmax


def test_a_cache_holding_another_vocabulary_is_refused(tmp_path, corpus):
    paths = text_corpus(tmp_path, corpus)
    small = datamodule(paths, tmp_path / "cache", "bpe", vocab_size=300).cache.folder
    big = datamodule(paths, tmp_path / "cache", "bpe", vocab_size=320).cache.folder
    (big / "tokenizer.json").write_bytes((small / "tokenizer.json").read_bytes())  # a hand-copied vocabulary
    with pytest.raises(DataError, match=r"other settings.*data\.cache_dir"):
        datamodule(paths, tmp_path / "cache", "bpe", vocab_size=320).prepare_data()
        open_cache(sources.TextFilesSource(**paths), make_tokenizer("bpe", vocab_size=320), tmp_path / "cache")


def test_a_build_that_loses_the_race_keeps_the_winners_cache_whole(tmp_path, corpus, monkeypatch):
    """Two processes fitting at once: the first complete folder wins; vocabulary and ids are never mixed."""
    paths = text_corpus(tmp_path, corpus)
    source = sources.TextFilesSource(**paths)
    winner = tmp_path / "winner"
    build_cache(source, make_tokenizer("bpe", vocab_size=300), winner)
    build = cache_module._build

    def slow_build(source, tokenizer, folder):
        build(source, tokenizer, folder)
        target = cache_folder(source, tokenizer, tmp_path / "cache")
        target.parent.mkdir(exist_ok=True)
        (winner / target.name).rename(target)  # another process published first

    monkeypatch.setattr(cache_module, "_build", slow_build)
    folder = build_cache(source, make_tokenizer("bpe", vocab_size=300), tmp_path / "cache")
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temporary folder left
    monkeypatch.undo()
    opened = open_cache(source, make_tokenizer("bpe", vocab_size=300), tmp_path / "cache")
    for split, path in paths.items():
        assert opened.tokenizer.decode(opened.splits[split]).encode("utf-8") == path.read_bytes()


def test_an_incomplete_folder_left_by_a_crash_is_rebuilt(tmp_path, corpus):
    paths = text_corpus(tmp_path, corpus)
    source = sources.TextFilesSource(**paths)
    folder = cache_folder(source, make_tokenizer("bpe", vocab_size=300), tmp_path / "cache")
    folder.mkdir(parents=True)
    (folder / "train.npy").write_bytes(b"half")
    opened = open_cache(source, make_tokenizer("bpe", vocab_size=300), tmp_path / "cache")
    assert opened.folder == folder and opened.tokenizer.decode(opened.splits["train"]).encode() == \
        paths["train"].read_bytes()


# --- bad input ----------------------------------------------------------------------------------------------------


def test_bad_tokenizer_files_and_settings_fail_at_once_naming_the_setting(tmp_path, corpus):
    paths = text_corpus(tmp_path, corpus)
    cache_dir = tmp_path / "cache"
    good = tmp_path / "good.json"
    hf_tokenizer("BPE", 300).save(str(good))
    not_json = tmp_path / "notes.txt"
    not_json.write_text("this is not a tokenizer\n")
    wrong_layout = tmp_path / "layout.json"
    wrong_layout.write_text(json.dumps({"version": "1.0", "model": {"type": "Nonsense"}}))
    word_level = tmp_path / "words.json"
    hf_tokenizer("BPE", 300, byte_level=False).save(str(word_level))
    unigram = tmp_path / "unigram.json"
    hf_tokenizer("Unigram", 300).save(str(unigram))
    cases = [
        (dict(file=tmp_path / "missing.json"), r"data\.tokenizer_file=.*missing\.json does not exist"),
        (dict(file=not_json), r"data\.tokenizer_file=.*notes\.txt is not a Hugging Face tokenizer\.json"),
        (dict(file=wrong_layout), r"data\.tokenizer_file=.*layout\.json is not a Hugging Face tokenizer\.json"),
        (dict(file=word_level), r"data\.tokenizer_file=.*words\.json is not a byte-level tokenizer"),
        (dict(file=unigram), r"holds a Unigram model but data\.tokenizer=bpe"),
        (dict(file=good, special_tokens=["<eos>"]), r"lacks the special token\(s\) \['<eos>'\].*special_tokens"),
        (dict(file=good, vocab_size=300), r"data\.tokenizer_kwargs\.vocab_size and pre_tokenizer come from"),
        (dict(vocab_size=256, special_tokens=["<eos>"]), r"vocab_size=256 cannot hold .* at least 257"),
        (dict(vocab_size="big"), r"data\.tokenizer_kwargs\.vocab_size='big'"),
        (dict(pre_tokenizer="whitespace"), r"data\.tokenizer_kwargs\.pre_tokenizer must be one of"),
        (dict(special_tokens="<eos>"), r"data\.tokenizer_kwargs\.special_tokens must be a list"),
        (dict(special_tokens=["<s>", "<s>"]), r"data\.tokenizer_kwargs\.special_tokens must be a list of distinct"),
        (dict(min_freq=2), r"data\.tokenizer_kwargs .* do not fit the bpe tokenizer"),
    ]
    for kwargs, message in cases:
        file = kwargs.pop("file", None)
        with pytest.raises(DataError, match=message):
            datamodule(paths, cache_dir, "bpe", file, **kwargs)
    with pytest.raises(DataError, match=r"tokenizer_file is read by data\.tokenizer=word, bpe or unigram, not char"):
        datamodule(paths, cache_dir, "char", good)
    with pytest.raises(DataError, match=r"data\.tokenizer_file=.* is not a word vocabulary file"):
        datamodule(paths, cache_dir, "word", good)
    assert not cache_dir.exists()  # all refused before any work


def test_a_tokenizer_file_that_is_a_folder_is_called_a_folder(tmp_path, corpus):
    """A folder given as data.tokenizer_file exists: the sentence says it is a folder, and names the file in it."""
    paths = text_corpus(tmp_path, corpus)
    folder = tmp_path / "exported"
    folder.mkdir()
    for tokenizer, name in (("bpe", "tokenizer.json"), ("word", "vocab.json")):
        with pytest.raises(DataError) as info:
            datamodule(paths, tmp_path / "cache", tokenizer, folder)
        assert str(info.value) == f"data.tokenizer_file={folder} is a folder; point it at a {name} file"
    hf_tokenizer("BPE", 300).save(str(folder / "tokenizer.json"))
    with pytest.raises(DataError) as info:
        datamodule(paths, tmp_path / "cache", "bpe", folder)
    assert str(info.value) == (f"data.tokenizer_file={folder} is a folder; point it at the tokenizer.json file in "
                               f"it, {folder / 'tokenizer.json'}")
    assert not (tmp_path / "cache").exists()


def test_a_binary_training_file_is_refused_for_subwords_and_nothing_is_kept(tmp_path):
    paths = write_corpus(tmp_path, "text\n", "more text\n", "and more\n")
    paths["train"].write_bytes(b"caf\xe9 latin-1 \xff\n")
    dm = datamodule(paths, tmp_path / "cache", "bpe", vocab_size=300)
    with pytest.raises(DataError, match=r"data\.train .* looks binary .* data\.tokenizer=byte"):
        dm.prepare_data()
    assert list((tmp_path / "cache").iterdir()) == []


# --- the other tokenizers' byte tables -----------------------------------------------------------------------------


def test_word_bytes_count_one_separator_per_word_and_the_newline():
    tok = make_tokenizer("word")
    tok.fit(["a bb ccc é =\n"])
    table = tok.token_bytes()
    spaced = "a bb ccc \n\né a \n"  # every word followed by one space, lines ending in " \n"
    assert int(table[tok.encode(spaced)].sum()) == len(spaced.encode("utf-8"))
    plain = "a bb ccc\n\né a\n"  # the usual form: one byte more per non-empty line
    assert int(table[tok.encode(plain)].sum()) == len(plain.encode("utf-8")) + 2
    wikitext = " = a bb = \n\n"  # WikiText's leading space: one byte less per non-empty line
    assert int(table[tok.encode(wikitext)].sum()) == len(wikitext.encode("utf-8")) - 1
    assert int(table[tok.encode("zebra \n")].sum()) == len("<unk> \n")  # counted as WikiText writes it


def test_char_and_byte_tables(tmp_path):
    paths = write_corpus(tmp_path, TRICKY, TRICKY[::-1], TRICKY[:20])
    for name in ("char", "byte"):
        dm = datamodule(paths, tmp_path / "cache", name)
        for split, path in paths.items():
            info = dm.cache.meta["splits"][split]
            assert info["bytes"] == info["token_bytes"] == path.stat().st_size
    char = make_tokenizer("char")
    char.fit(["aé🙂"])
    assert char.token_bytes().tolist() == [1, 2, 4, 1]  # the last is <unk>
    assert make_tokenizer("byte").token_bytes().tolist() == [1] * 256


def test_prompts_round_trip_through_the_datamodule_tokenizer(tmp_path, corpus):
    """What generation and evaluation do: encode a prompt with datamodule.tokenizer and decode the ids."""
    paths = text_corpus(tmp_path, corpus)
    tok = datamodule(paths, tmp_path / "cache", "bpe", vocab_size=300).tokenizer
    prompt = "def main(self):\n    return 'ünïcödé 🙂'\r\n"
    ids = tok.encode(prompt)
    assert ids.dtype == np.int64 and ids.max() < tok.vocab_size and tok.decode(ids) == prompt


def test_the_softmax_fits_the_vocabulary_unless_the_model_sets_its_clusters(tmp_path, corpus):
    """model.cutoffs=null (the default): one softmax for a small or unranked vocabulary, adaptive beyond."""
    from tests.conftest import compose_config, tiny_overrides
    from xl.config.rules import model_values
    from xl.data.tokenizers import default_cutoffs
    from xl.training.build import build_run

    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "data.tokenizer=bpe",
                                   "+data.tokenizer_kwargs.vocab_size=320"))
    assert run.module.config.cutoffs == () and default_cutoffs(320, True) == []
    assert default_cutoffs(50257, True) == [8192] and default_cutoffs(267735, True) == [8192, 32768, 131072]
    assert default_cutoffs(50257, False) == []  # byte/char ids are not ordered by frequency
    cfg = compose_config(*tiny_overrides(tmp_path, corpus))
    assert model_values(cfg, 50257, [8192])["cutoffs"] == [8192]
    cfg.model.cutoffs = [100]
    assert model_values(cfg, 50257, [8192])["cutoffs"] == [100]


def test_fingerprint_tells_tokenizers_of_one_size_apart():
    a, b, again = make_tokenizer("char"), make_tokenizer("char"), make_tokenizer("char")
    a.fit(["abc"])
    b.fit(["abd"])
    again.fit(["cba"])
    assert a.vocab_size == b.vocab_size
    assert tok_module.fingerprint(a) != tok_module.fingerprint(b)
    assert tok_module.fingerprint(a) == tok_module.fingerprint(again)  # the same vocabulary, however it was read
    assert tok_module.fingerprint(make_tokenizer("byte")) == tok_module.fingerprint(make_tokenizer("byte"))


def test_a_checkpoint_refuses_another_tokenizer_of_the_same_size(tmp_path, corpus, monkeypatch):
    """Trained with a character vocabulary; the same corpus with one character swapped for an unseen one gives a
    vocabulary of the same size whose ids mean other characters: resuming, evaluating and generating refuse it."""
    import torch

    import xl.generate
    from tests.conftest import compose_config, run_hydra_main, tiny_overrides
    from tests.integration.test_evaluate import compose_eval
    from xl.evaluation import evaluate
    from xl.training.build import build_run
    from xl.training.checkpoints.checkpoint import CheckpointError

    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "data.tokenizer=char", "trainer.max_steps=2"))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    text = {split: path.read_text(encoding="utf-8") for split, path in corpus.items()}
    assert "q" in text["train"] and "\u2603" not in "".join(text.values())
    (tmp_path / "other").mkdir()
    other = write_corpus(tmp_path / "other", *(text[s].replace("q", "\u2603") for s in ("train", "val", "test")))
    data = ["data=text", *(f"data.{s}={other[s]}" for s in ("train", "val", "test")), "data.tokenizer=char",
            f"data.cache_dir={tmp_path / 'other_cache'}"]
    said = "was trained with another tokenizer than this data gives"
    with pytest.raises(CheckpointError, match=f"ckpt_path=.*{said}"):  # testing it
        build_run(compose_config(*tiny_overrides(tmp_path, corpus), *data, f"ckpt_path={ckpt}", "train=false",
                                 f"paths.output_dir={tmp_path / 'tested'}"))
    with pytest.raises(CheckpointError, match="ckpt_path=.* was trained on data.train .* but this run reads"):
        build_run(compose_config(*tiny_overrides(tmp_path, corpus), *data, f"ckpt_path={ckpt}",  # resuming it:
                                 f"paths.output_dir={tmp_path / 'resumed'}"))  # refused before the data is read
    with pytest.raises(CheckpointError, match=f"ckpt=.*{said}.*set data and data.tokenizer"):
        evaluate(compose_eval(f"ckpt={ckpt}", *data, f"paths.output_dir={tmp_path / 'eval'}"))
    with pytest.raises(SystemExit, match=said):
        run_hydra_main(xl.generate.main, ["xl.generate", f"ckpt={ckpt}", "prompt=x", *data,
                                          f"hydra.run.dir={tmp_path / 'gen'}"], monkeypatch)
    # The training data itself is accepted: the checkpoint recorded its tokenizer's fingerprint.
    assert torch.load(ckpt, weights_only=True)["xl"]["tokenizer"] == run.datamodule.tokenizer_fingerprint
    evaluate(compose_eval(f"ckpt={ckpt}", "data=text", *(f"data.{s}={corpus[s]}" for s in ("train", "val", "test")),
                          "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}", "trainer.limit_val_batches=1",
                          "trainer.limit_test_batches=1", f"paths.output_dir={tmp_path / 'eval_ok'}"))



@pytest.mark.parametrize("name", SUBWORDS)
def test_a_fitted_tokenizer_encodes_as_its_own_file_reads_it_back(name):
    """A subword model fresh from its trainer can split a text otherwise than the same model read back from its
    JSON (Unigram: a tie between two orders of the same pieces, a few tokens in a few fits out of a hundred); the
    token cache, a shared model and a tokenizer_file read the JSON, so the fitted tokenizer must be that model. Each
    fit draws the trainer's hash seeds anew, so sixty fits meet the case."""
    import inspect
    import textwrap

    text = inspect.getsource(textwrap) + TRICKY
    for _ in range(60):
        tokenizer = make_tokenizer(name, vocab_size=400)
        tokenizer.fit([text])
        reread = Tokenizer.from_str(tokenizer.hf.to_str())
        assert tokenizer.hf.encode(text).ids == reread.encode(text).ids
