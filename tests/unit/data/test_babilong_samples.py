"""BABILong-style samples (xl.data.babilong.samples, xl.data.babilong.data): the facts in order in the context, which
the tests' solver answers from the text alone; lengths within one sentence of the request in the model's tokens; splits
that never share a story; the same samples from the same settings; bad settings refused in one sentence."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from tests.helpers.babilong_solver import find_facts, solve
from tests.helpers.paths import ROOT
from xl.data.babilong.background import MAX_UNIT_TOKENS, PG19Source, Sentences, units
from xl.data.babilong.data import BabilongDataModule, BabilongSource, token_counter
from xl.data.babilong.samples import hide, samples, split_of, stories
from xl.data.babilong.tasks import TASKS
from xl.data.errors import DataError
from xl.data.sources import SPLITS, StdlibSource
from xl.data.tokenizers import make_tokenizer

PROSE = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith slipped quickly "
         "through the glass doors! Was it a dream? The hallway smelt of boiled cabbage and old rag mats.\n"
         "    x = compute(a, b)  # a line of code, no sentence in it\n\n"
         "At one end of it a coloured poster had been tacked to the wall.   It depicted simply an enormous face.\n")


class TextSource:
    """A tiny in-memory source: the same text in every split, a few times over."""

    def __init__(self, text: str = PROSE, repeat: int = 3) -> None:
        self.text, self.repeat = text, repeat

    def identity(self) -> str:
        return f"test:{hash(self.text)}:{self.repeat}"

    def setting(self, split: str) -> str:
        return f"the test text ({split})"

    def texts(self, split: str):
        for _ in range(self.repeat):
            yield self.text


def counter(name: str):
    return token_counter(make_tokenizer(name))


def test_units_give_the_text_back_and_cut_prose_into_sentences_and_code_into_lines():
    pieces = units(PROSE)
    assert "".join(pieces) == PROSE
    assert pieces[:3] == ["It was a bright cold day in April, and the clocks were striking thirteen. ",
                          "Winston Smith slipped quickly through the glass doors! ", "Was it a dream? "]
    assert "    x = compute(a, b)  # a line of code, no sentence in it\n" in pieces and "\n" in pieces
    assert "At one end of it a coloured poster had been tacked to the wall.   " in pieces


@pytest.mark.parametrize("tokenizer", ["byte", "char", "word"])
@pytest.mark.parametrize("length", [0, 300, 1000, 1500])
def test_facts_are_hidden_in_order_and_the_length_is_within_one_sentence(tokenizer, length):
    count = counter(tokenizer)
    newline = count("\n")
    for task in TASKS:
        background = Sentences(TextSource(), "train", count)
        for sample in itertools.islice(samples(task, length, "train", 0, background, count), 12):
            story = sample.story
            assert find_facts(sample.context) == list(story.facts)  # all of them, in order, nothing else
            assert solve(find_facts(sample.prompt), story.question) == story.answer  # from the text alone
            assert sample.context.endswith("\n") and sample.prompt.endswith(f"Question: {story.question}\n")
            assert sample.tokens == count(sample.context)
            if length == 0:
                assert sample.context == " ".join(story.facts) + "\n"
                continue
            assert sample.next_tokens == background.peek()[1] <= MAX_UNIT_TOKENS  # the sentence that did not fit
            assert sample.tokens <= length < sample.tokens + sample.next_tokens + newline


def test_a_fact_inside_a_line_ends_with_a_space_and_after_a_line_end_with_a_newline():
    count = counter("byte")
    story = next(stories("qa1", "train", 0))
    for seed in range(20):
        sample = hide(story, 600, Sentences(TextSource(), "train", count), count, random.Random(seed))
        for fact in story.facts:
            at = sample.context.index(fact)
            before, after = sample.context[at - 1: at], sample.context[at + len(fact)]
            assert after == ("\n" if before in ("\n", "") else " ")


def test_splits_never_share_a_story_and_are_the_same_on_every_draw():
    for task in TASKS:
        keys = {}
        for split in SPLITS:
            drawn = list(itertools.islice(stories(task, split, 0), 100))
            assert all(split_of(s) == split for s in drawn)
            assert drawn[:20] == list(itertools.islice(stories(task, split, 0), 20))
            keys[split] = {s.key() for s in drawn}
        assert not keys["train"] & keys["val"] and not keys["train"] & keys["test"] and not keys["val"] & keys["test"]
    # The check can fail: drawn without the split rule, the short stories of qa4 repeat across seeds.
    train, test = ({s.key() for s in itertools.islice(stories("qa4", "train", seed), 2000)} for seed in (0, 1))
    assert train & test


def test_another_seed_draws_other_stories():
    first, other = (list(itertools.islice(stories("qa2", "test", seed), 10)) for seed in (0, 1))
    assert first != other


def test_a_length_too_short_for_the_facts_is_refused_in_one_sentence():
    count = counter("byte")
    with pytest.raises(DataError, match="length 20 is too short for the facts of qa1"):
        next(samples("qa1", 20, "train", 0, Sentences(TextSource(), "train", count), count))


def test_a_background_without_usable_sentences_is_refused():
    count = counter("byte")
    with pytest.raises(DataError, match="has no sentence or line"):
        Sentences(TextSource("x" * (MAX_UNIT_TOKENS + 1), 1), "train", count).peek()


def test_pg19_offline_fails_at_once_saying_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(DataError, match=r"PG-19 is streamed from the hub, which .* forbid.*data/background=stdlib"):
        next(PG19Source().texts("test"))


def test_a_subword_vocabulary_to_be_fitted_is_refused_and_one_from_a_file_counts(tmp_path):
    with pytest.raises(DataError, match="data.tokenizer_file"):
        BabilongDataModule(TextSource(), tokenizer="bpe")
    fitted = make_tokenizer("bpe", vocab_size=300)
    fitted.fit([PROSE * 5])
    path = tmp_path / "tokenizer.json"
    path.write_text(fitted.hf.to_str())  # a user's tokenizer.json
    count = token_counter(make_tokenizer("bpe", file=path))
    assert count(PROSE) == len(fitted.encode(PROSE))


def source(**changes) -> BabilongSource:
    settings = {"background": TextSource(), "tasks": ["qa1", "qa2"], "length": 400,
                "sizes": {"train": 6, "val": 2, "test": 2}, "seed": 0, "count": counter("byte"),
                "tokenizer_key": "byte", **changes}
    return BabilongSource(**settings)


def test_the_source_gives_the_same_samples_from_the_same_settings_and_its_identity_says_which():
    assert list(source().texts("train")) == list(source().texts("train"))
    assert [s.story.task for s in source().samples("train")] == ["qa1", "qa2"] * 3
    identities = {source(**change).identity() for change in (
        {}, {"length": 500}, {"tasks": ["qa1"]}, {"seed": 1}, {"tokenizer_key": "char"},
        {"sizes": {"train": 7, "val": 2, "test": 2}}, {"background": TextSource(repeat=4)})}
    assert len(identities) == 7


def test_each_sample_is_a_document_whose_answer_is_a_marked_piece():
    pieces = list(source().documents("val"))
    assert [p[0] for p in pieces] == [True, False] * 2
    for (_, prompt), (_, answer, marked) in zip(pieces[::2], pieces[1::2], strict=True):
        assert prompt.endswith("?\n") and answer.endswith("\n") and marked


def datamodule(tmp_path, loss="answer", tokenizer="byte", **kwargs) -> BabilongDataModule:
    dm = BabilongDataModule(TextSource(), tasks=["qa1", "qa5"], length=300, train_samples=20, eval_samples=4,
                            loss=loss, tokenizer=tokenizer, batch_size=3, tgt_len=16, cache_dir=tmp_path, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("tokenizer", ["byte", "char"])
def test_the_cache_knows_where_every_answer_is_and_the_loader_scores_those_targets_only(tmp_path, tokenizer):
    dm = datamodule(tmp_path, tokenizer=tokenizer)
    ids, spans = np.asarray(dm.cache.splits["train"]), dm.cache.answers["train"]
    expected = [s.answer for s in dm.source.samples("train")]
    assert [dm.tokenizer.decode(ids[a:b]) for a, b in spans] == expected
    scored = np.zeros(len(ids), dtype=bool)  # the slow way: position by position
    for a, b in spans:
        scored[a:b] = True
    loader = dm.train_dataloader()
    row_len = loader.rows.shape[1]
    for t in range(len(loader)):
        x, y, _ = loader.segment(t)
        for b in range(y.size(0)):
            for i in range(y.size(1)):
                j = b * row_len + t * loader.tgt_len + i + 1  # the flat index of this target
                assert int(y[b, i]) == (int(ids[j]) if scored[j] else -100)
    assert dm.scored == "answer tokens only"


def test_loss_all_scores_every_target(tmp_path):
    dm = datamodule(tmp_path, loss="all")
    assert all((loader_batch[1] >= 0).all() for loader_batch in dm.train_dataloader())
    assert dm.scored == "every token"


@pytest.mark.parametrize("settings,message", [
    ({"length": "2kb"}, "data.length"), ({"tasks": ["qa9"]}, "data.tasks"), ({"loss": "some"}, "data.loss"),
    ({"train_samples": 0}, "data.train_samples"), ({"doc_sep": "---"}, "data.doc_sep"),
])
def test_bad_data_settings_are_refused_in_one_sentence(settings, message):
    kwargs = {"tasks": ["qa1"], "length": "1k", **settings}
    with pytest.raises(DataError, match=message) as err:
        BabilongDataModule(StdlibSource(), **kwargs)
    assert "\n" not in str(err.value)


def test_the_babilong_experiment_composes_and_passes_every_rule():
    from tests.conftest import compose_config
    from xl.config.rules import check_config

    cfg = compose_config("experiment=babilong_bytes")
    check_config(cfg)
    assert (cfg.data._target_, list(cfg.data.tasks), cfg.data.loss) == ("xl.data.babilong.data.BabilongDataModule",
                                                                        ["qa1"], "answer")
    assert cfg.memory.doc_boundaries == "reset"


def test_the_examples_of_the_docs_are_what_the_generator_writes():

    page = (ROOT / "docs" / "babilong.md").read_text()
    shown = page.split("<!-- BEGIN EXAMPLES -->", 1)[1].split("<!-- END EXAMPLES -->", 1)[0]
    blocks = [b.split("\n", 1)[1] for b in shown.split("```text")[1:]]
    count = counter("byte")
    made = []
    for task in ("qa1", "qa4"):
        sample = next(samples(task, 0, "test", 0, Sentences(StdlibSource(), "test", count), count))
        made.append(sample.prompt + sample.answer)
    assert [b.split("```")[0] for b in blocks] == made
