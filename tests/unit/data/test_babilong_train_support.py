"""``data.train_support``: a task's training stories kept only where the answer follows from facts of the kinds
named (qa2's ``get, move``: an object picked up, then carried by its holder's move). Each kind is read here with the
tests' own parser of bAbI's sentences, not with the code under test."""

from __future__ import annotations

from itertools import islice

import pytest

from tests.conftest import compose_config
from tests.helpers.babilong_solver import parse
from xl.config.rules import ConfigError, check_config
from xl.data import DataError
from xl.data.babilong.data import BabilongDataModule
from xl.data.babilong.generated import STREAM
from xl.data.babilong.samples import stories
from xl.data.babilong.tasks import SUPPORTS, kept
from xl.data.sources import StdlibSource

CARRIED = {"qa2": ["get, move"]}


def kinds(story) -> str:
    """The kinds of the story's supporting facts in order, as the tests' parser reads their sentences."""
    return ", ".join(parse(story.facts[i]).kind for i in story.supporting)


def data(tmp_path, **settings):
    values = {"tasks": ["qa1", "qa2"], "length": 0, "eval_samples": 20, "train_samples": 60, "seed": 0,
              "tokenizer": "word", "batch_size": 2, "tgt_len": 16, "cache_dir": str(tmp_path / "cache"),
              "train_questions": "end_holders", **settings}
    dm = BabilongDataModule(StdlibSource(), **values)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def training_stories(dm, n: int = 60):
    if dm.stream is None:
        return [s.story for s in islice(dm.source.samples("train"), n)]
    return [dm.stream.sample(row, j).story for row in range(2) for j in range(n // 2)]


@pytest.mark.parametrize("train_samples", [60, STREAM])
def test_the_named_task_s_training_stories_follow_from_those_kinds_and_nothing_else_changes(tmp_path, train_samples):
    every = data(tmp_path / "every", train_samples=train_samples)
    carried = data(tmp_path / "carried", train_samples=train_samples, train_support=CARRIED)
    before, got = training_stories(every), training_stories(carried)
    assert {kinds(s) for s in before if s.task == "qa2"} == set(SUPPORTS["qa2"])  # without it, every kind of qa2's
    assert {kinds(s) for s in got if s.task == "qa2"} == {"get, move"}
    assert [s for s in got if s.task == "qa1"] == [s for s in before if s.task == "qa1"]
    assert sum(s.task == "qa2" for s in got) == sum(s.task == "qa2" for s in before)
    for split in ("val", "test"):  # scoring reads what it read before
        assert list(every.source.samples(split)) == list(carried.source.samples(split))
        assert {kinds(s.story) for s in carried.source.samples(split) if s.story.task == "qa2"} == set(SUPPORTS["qa2"])
    assert every.cache.folder.name != carried.cache.folder.name  # another cache, not only another folder


def test_two_kinds_keep_both_and_the_stream_is_the_same_on_a_second_module(tmp_path):
    two = {"qa2": ["get, move", "move, drop"]}
    first = data(tmp_path / "a", train_samples=STREAM, train_support=two)
    again = data(tmp_path / "b", train_samples=STREAM, train_support=two)
    got = [first.stream.sample(0, j) for j in range(60)]
    assert {kinds(s.story) for s in got if s.story.task == "qa2"} == {"get, move", "move, drop"}
    assert got == [again.stream.sample(0, j) for j in range(60)]
    swapped = data(tmp_path / "c", train_samples=STREAM, train_support={"qa2": ["move, drop", "get, move"]})
    assert swapped.cache.folder.name == first.cache.folder.name  # the same kinds in another order: the same cache


def test_kept_reads_the_mapping_per_task():
    """A task the mapping does not name keeps every story; a named one keeps those of its kinds alone."""
    qa2 = list(islice(stories("qa2", "train", 0), 100))
    assert all(kept(s, None) and kept(s, {}) and kept(s, {"qa1": ["move"]}) for s in qa2)
    verdicts = [kept(s, CARRIED) for s in qa2]
    assert verdicts == [kinds(s) == "get, move" for s in qa2] and 0 < sum(verdicts) < len(qa2)


@pytest.mark.parametrize("value", [{"qa2": ["drop, move"]}, {"qa9": ["move"]}, {"qa2": "get, move"}, {"qa2": []},
                                   ["get, move"], {"qa1": ["get, move"]}])
def test_a_bad_value_is_refused_in_one_sentence(value):
    with pytest.raises(DataError, match="^data.train_support must map tasks to lists") as err:
        BabilongDataModule(StdlibSource(), tasks=["qa1", "qa2"], length=0, train_support=value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize(("value", "expected"), [
    ("{qa2:['get, move']}", CARRIED), ("{qa2:['get, move','move, drop']}", {"qa2": ["get, move", "move, drop"]}),
    ("null", None)])
def test_the_config_takes_the_setting_from_the_command_line(value, expected):
    cfg = compose_config("data=babilong", f"data.train_support={value}")
    check_config(cfg, lambda: 256)
    assert cfg.data.train_support == expected


def test_the_config_check_refuses_a_kind_the_task_has_not_in_one_sentence():
    cfg = compose_config("data=babilong", "data.train_support={qa2:['drop, move']}")
    with pytest.raises(ConfigError, match="data.train_support") as err:
        check_config(cfg, lambda: 256)
    assert "\n" not in str(err.value) and len(str(err.value)) < 200
