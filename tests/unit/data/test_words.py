"""Word-level training end to end: word tokenizer, adaptive input and softmax, perplexity, evaluate, generate."""

from __future__ import annotations

import math

import torch

from tests.conftest import compose_config, tiny_overrides
from xl.generation import generate
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import Checkpoint


def test_word_level_adaptive_run_trains_tests_and_generates(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "data.tokenizer=word", "model.cutoffs=[40,200]",
                         "model.div_val=2", "trainer.max_steps=12", "trainer.val_check_interval=6",
                         "trainer.limit_test_batches=1.0")
    run = build_run(cfg)
    vocab = run.datamodule.vocab_size
    assert vocab > 200 and run.datamodule.unit == "word"
    run.trainer.fit(run.module, datamodule=run.datamodule)
    losses = run.trainer.callback_metrics
    assert math.isfinite(float(losses["val/loss"])) and "val/ppl" in losses
    assert math.isclose(float(losses["val/ppl"]), math.exp(float(losses["val/loss"])), rel_tol=1e-5)
    ckpt = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    (test,) = run.trainer.test(run.module, datamodule=run.datamodule, ckpt_path=ckpt, verbose=False,
                               weights_only=True)
    assert math.isfinite(test["test/ppl"]) and test["test/ppl"] < vocab  # better than uniform after 12 steps
    model = Checkpoint.open(ckpt).load_model(vocab)
    assert model.config.cutoffs == (40, 200) and model.head.tables[0].weight is model.embed.tables[0].weight
    prompt = torch.as_tensor(run.datamodule.tokenizer.encode("def main ( self"), dtype=torch.long)[None]
    sampled = generate(model, prompt, 8, window=16, seg_len=16, temperature=1.0, seed=0)
    assert sampled.shape == (1, 8) and int(sampled.max()) < vocab


def vocabulary_file(tmp_path, words, **kw) -> str:
    from xl.data.words import vocabulary_json

    path = tmp_path / "vocab.json"
    path.write_text(vocabulary_json(words, **kw), encoding="utf-8")
    return str(path)


def original_ids(path, sym2idx: dict, lower_case: bool, unk: str = "<unk>") -> list[int]:
    """The original Transformer-XL rule, written out: the file read line by line in text mode (Python's universal
    newlines), each line stripped, lower-cased if asked, split on whitespace, closed by <eos>; an unknown word is
    <unk>'s id."""
    ids = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip().lower() if lower_case else line.strip()
            ids += [sym2idx.get(w, sym2idx[unk]) for w in line.split() + ["<eos>"]]
    return ids


def test_a_vocabulary_file_gives_its_own_ids_case_rule_and_symbols(tmp_path):
    from xl.data.words import WordTokenizer

    words = ["the", "<eos>", "zürich", "a", "<unk>", "of", "="]  # <eos> and <unk> anywhere, as the file says
    text = " = Zürich = \n\nThe naïve a OF   the\n  \nlast line without newline"
    path = tmp_path / "text.txt"
    path.write_bytes(text.encode("utf-8"))
    for lower_case in (False, True):
        tokenizer = WordTokenizer(file=vocabulary_file(tmp_path, words, lower_case=lower_case))
        sym2idx = {w: i for i, w in enumerate(words)}
        assert tokenizer.encode(text).tolist() == original_ids(path, sym2idx, lower_case)
        assert (tokenizer.eos_id, tokenizer.unk_id, tokenizer.vocab_size) == (1, 4, 7)
        tokenizer.fit(["ignored: a vocabulary file has nothing to learn"])
        assert tokenizer.itos == words
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == "= zürich =\n\nthe <unk> a of the\n\n<unk> <unk> <unk> <unk>\n"
    assert tokenizer.token_bytes().tolist() == [4, 1, 8, 2, 6, 3, 2]


def test_lines_end_where_the_original_reader_ends_them(tmp_path):
    """The original reads its text files in Python's text mode: a line ends at \\n, \\r\\n or a lone \\r, and the
    separators that str.splitlines adds (\\v, \\f, \\x1c-\\x1e, \\x85, \\u2028, \\u2029) are whitespace inside a
    line. A prompt's last line can be left open."""
    from xl.data.words import WordTokenizer

    words = ["<eos>", "<unk>", "a", "b", "c"]
    tokenizer = WordTokenizer(file=vocabulary_file(tmp_path, words))
    text = "a b\rc\r\na\r\rb\x0bc\x0ca\x1cb\x1dc\x1ea\x85b\u2028c\u2029a\nb c\r"
    path = tmp_path / "text.txt"
    path.write_bytes(text.encode("utf-8"))
    ids = tokenizer.encode(text).tolist()
    assert ids == original_ids(path, {w: i for i, w in enumerate(words)}, False)
    assert ids.count(0) == 6 and len(ids) == 21
    assert tokenizer.encode("a b\rc", close_last_line=False).tolist() == [2, 3, 0, 4]
    assert tokenizer.encode("a b\rc").tolist() == [2, 3, 0, 4, 0]


def test_vocabulary_files_are_checked_and_fingerprinted_by_content(tmp_path):
    import pytest

    from xl.data import DataError
    from xl.data.tokenizers import fingerprint, make_tokenizer, tokenizer_from_dict
    from xl.data.words import WordTokenizer

    path = vocabulary_file(tmp_path, ["<eos>", "<unk>", "a"])
    a = make_tokenizer("word", path)
    assert fingerprint(a) == fingerprint(tokenizer_from_dict(a.to_dict())) == fingerprint(WordTokenizer(file=path))
    assert a.key() != WordTokenizer().key()
    other = vocabulary_file(tmp_path / "..", ["<eos>", "<unk>", "b"])
    assert fingerprint(make_tokenizer("word", other)) != fingerprint(a)
    bad = tmp_path / "bad.json"
    for content, message in [("{", "not JSON"), ('{"format": "other"}', "not a word vocabulary file"),
                             ('{"format": "xl-word-vocabulary", "words": ["a", "a"], "eos": "a", "unk": "a", '
                              '"lower_case": false}', "distinct"),
                             ('{"format": "xl-word-vocabulary", "words": ["a"], "eos": "<eos>", "unk": "a", '
                              '"lower_case": false}', "eos symbol")]:
        bad.write_text(content)
        with pytest.raises(DataError, match=message):
            make_tokenizer("word", bad)
    with pytest.raises(DataError, match="leave them unset"):
        make_tokenizer("word", path, min_freq=3)
    with pytest.raises(DataError, match="does not exist"):
        make_tokenizer("word", tmp_path / "missing.json")


def test_a_fitted_vocabulary_keeps_its_layout_and_fingerprint_form():
    from xl.data.tokenizers import fingerprint
    from xl.data.words import WordTokenizer

    tokenizer = WordTokenizer(min_freq=1)
    tokenizer.fit(["b a b\nc b a\n"])
    assert tokenizer.itos == ["<eos>", "<unk>", "b", "a", "c"] and (tokenizer.eos_id, tokenizer.unk_id) == (0, 1)
    assert tokenizer.to_dict() == {"name": "word", "min_freq": 1, "max_size": None, "words": ["b", "a", "c"]}
    assert fingerprint(WordTokenizer.from_dict(tokenizer.to_dict())) == fingerprint(tokenizer)
