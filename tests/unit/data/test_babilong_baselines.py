"""The rules that need no memory of the asked entity (xl.babilong.baselines), each on hand-made stories of qa1–qa5
whose right answers and expected accuracies are worked out by hand in the comments."""

from __future__ import annotations

import itertools

import pytest

from tests.helpers.babilong_solver import parse
from xl.babilong.baselines import ANSWERS, RULES, candidates, entity_labels, expected, follows, last_named
from xl.babilong.report import Cell, facts_group, table
from xl.data.babilong.samples import stories
from xl.data.babilong.tasks import SUPPORTS, Story, support


def story(task: str, facts: str, question: str, answer: str) -> Story:
    return Story(task, tuple(f.strip() + "." for f in facts.split(".") if f.strip()), question, answer, ())


QA1 = [
    # last move: Mary to the office (wrong: John is in the garden); John visited hallway, garden: 1/2
    story("qa1", "John went to the hallway. John moved to the garden. Mary travelled to the office.",
          "Where is John?", "garden"),
    # last move: Sandra to the kitchen (right); Sandra visited bedroom, kitchen: 1/2
    story("qa1", "Sandra went back to the bedroom. Daniel moved to the office. Sandra journeyed to the kitchen.",
          "Where is Sandra?", "kitchen"),
    # last move: Daniel to the bathroom (right); Daniel visited bathroom only: 1/1
    story("qa1", "Mary went to the garden. Daniel went to the bathroom.", "Where is Daniel?", "bathroom"),
    # last move: Mary to the garden (wrong); Daniel visited office: 1/1
    story("qa1", "Daniel went to the office. Mary moved to the garden.", "Where is Daniel?", "office"),
]


def test_qa1_by_hand():
    assert [last_named("qa1", s) for s in QA1] == ["office", "kitchen", "bathroom", "garden"]
    assert [entity_labels("qa1", s) for s in QA1] == [["garden", "hallway"], ["bedroom", "kitchen"], ["bathroom"],
                                                      ["office"]]
    right = expected("qa1", QA1)
    assert right["last named"] == 2  # the second and third
    assert right["most frequent"] == 1  # four answers, each once
    assert right["uniform"] == pytest.approx(4 / 6)
    assert right["entity's labels"] == pytest.approx(1 / 2 + 1 / 2 + 1 + 1)


QA2 = [
    # The apple's holder Mary went to the kitchen, then John to the garden: last named garden (wrong). The apple's
    # places: where its holder Mary went (office, kitchen): 1/2.
    story("qa2", "Mary went to the office. Mary picked up the apple there. Mary went to the kitchen. "
                 "John moved to the garden.", "Where is the apple?", "kitchen"),
    # The milk's holders: Sandra (got it) and Daniel (got it after she dropped it). Sandra went to the hallway,
    # Daniel to the hallway and then the bedroom; last named bedroom (right); places: hallway, bedroom: 1/2.
    story("qa2", "Sandra went to the hallway. Sandra got the milk. Daniel went to the hallway. "
                 "Sandra dropped the milk. Daniel took the milk there. Daniel travelled to the bedroom.",
          "Where is the milk?", "bedroom"),
]


def test_qa2_by_hand():
    assert [last_named("qa2", s) for s in QA2] == ["garden", "bedroom"]
    assert [entity_labels("qa2", s) for s in QA2] == [["kitchen", "office"], ["bedroom", "hallway"]]
    right = expected("qa2", QA2)
    assert (right["last named"], right["most frequent"]) == (1, 1)
    assert right["uniform"] == pytest.approx(2 / 6)
    assert right["entity's labels"] == pytest.approx(1 / 2 + 1 / 2)


QA3 = [
    # "before the kitchen": the kitchen is never a candidate, so the last named place is the garden (the apple's
    # holder John was there before: right). The apple's places other than the kitchen: garden: 1/1.
    story("qa3", "John went to the garden. John got the apple there. John went to the kitchen.",
          "Where was the apple before the kitchen?", "garden"),
    # Candidates leave out the office; the last other place named is the bathroom (Mary's: wrong, the football was in
    # the hallway). The football's holder Sandra went to the hallway and the office: hallway alone, 1/1.
    story("qa3", "Sandra went to the hallway. Sandra grabbed the football. Sandra moved to the office. "
                 "Mary moved to the bathroom.", "Where was the football before the office?", "hallway"),
]


def test_qa3_by_hand():
    assert "kitchen" not in candidates("qa3", QA3[0].question)
    assert [last_named("qa3", s) for s in QA3] == ["garden", "bathroom"]
    assert [entity_labels("qa3", s) for s in QA3] == [["garden"], ["hallway"]]
    right = expected("qa3", QA3)
    assert (right["last named"], right["most frequent"], right["entity's labels"]) == (1, 1, 2)


QA4 = [
    # Names in order: bathroom, hallway, hallway, bedroom; less the hallway (asked): bedroom last (right). The
    # hallway is named with the bathroom and the bedroom: 1/2.
    story("qa4", "The bathroom is east of the hallway. The hallway is east of the bedroom.",
          "What is the hallway east of?", "bedroom"),
    # Names: hallway, bedroom, bathroom, hallway; less the hallway: bathroom last (wrong: the bedroom is east of it).
    story("qa4", "The hallway is west of the bedroom. The bathroom is west of the hallway.",
          "What is east of the hallway?", "bedroom"),
]


def test_qa4_by_hand():
    assert [last_named("qa4", s) for s in QA4] == ["bedroom", "bathroom"]
    assert [entity_labels("qa4", s) for s in QA4] == [["bathroom", "bedroom"], ["bathroom", "bedroom"]]
    right = expected("qa4", QA4)
    assert (right["last named"], right["most frequent"]) == (1, 2)  # both answers are the bedroom
    assert right["entity's labels"] == pytest.approx(1)
    assert right["uniform"] == pytest.approx(2 / 6)


QA5 = [
    # "Who gave the milk to Fred?": people other than Fred, the last named is Jeff (of the move: wrong). The facts that
    # name the milk or Fred name Bill (and Fred): 1/1.
    story("qa5", "Bill got the milk there. Bill gave the milk to Fred. Jeff went to the garden.",
          "Who gave the milk to Fred?", "Bill"),
    # "What did Bill give to Fred?": objects; the last named is the apple (wrong). Facts naming Bill or Fred name the
    # milk and the football: 1/2.
    story("qa5", "Bill gave the milk to Fred. Fred took the football. Mary grabbed the apple.",
          "What did Bill give to Fred?", "milk"),
    # "Who received the apple?": people; the last named is Bill, of the move (wrong). Facts naming the apple name
    # Jeff and Mary: 1/2.
    story("qa5", "Jeff passed the apple to Mary. Bill went to the office.", "Who received the apple?", "Mary"),
]


def test_qa5_by_hand():
    assert candidates("qa5", QA5[1].question) == ["apple", "football", "milk"]
    assert candidates("qa5", QA5[0].question) == ["Bill", "Jeff", "Mary"]
    assert [last_named("qa5", s) for s in QA5] == ["Jeff", "apple", "Bill"]
    assert [entity_labels("qa5", s) for s in QA5] == [["Bill"], ["football", "milk"], ["Jeff", "Mary"]]
    right = expected("qa5", QA5)
    assert (right["last named"], right["most frequent"]) == (0, 1)
    assert right["uniform"] == pytest.approx(3 / 7)
    assert right["entity's labels"] == pytest.approx(1 + 1 / 2 + 1 / 2)


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3", "qa4", "qa5"])
def test_on_generated_stories_the_answer_is_always_among_the_entity_labels(task):
    """The rule draws among places the facts tie to the entity: the answer is always one of them, so no story falls
    back to all candidates, and the last named label is always a candidate."""
    for s in itertools.islice(stories(task, "test", 0), 200):
        assert s.answer in entity_labels(task, s), s
        assert last_named(task, s) in candidates(task, s.question)
    assert set(expected(task, [])) == set(RULES)


def test_what_an_answer_follows_by_hand():
    john, sandra, daniel, _ = QA1  # John: hallway then garden (answer), the last move Mary's to the office
    assert follows("qa1", john, "garden") == "right"
    assert follows("qa1", john, "He is in the garden.") == "right"
    assert follows("qa1", john, "hallway") == "entity's other label"  # where John was before
    assert follows("qa1", john, "office") == "last named"  # Mary's move, the last
    assert follows("qa1", john, "kitchen") == "another label"
    assert follows("qa1", john, "garden or hallway") == "no single label"
    assert follows("qa1", john, "nowhere") == "no single label"
    assert follows("qa1", sandra, "bedroom") == "entity's other label"
    # The apple's holder Mary went to the office, then the kitchen (answer); the last named is John's garden.
    apple = QA2[0]
    assert [follows("qa2", apple, a) for a in ("kitchen", "office", "garden", "bathroom")] == \
        ["right", "entity's other label", "last named", "another label"]
    assert follows("qa1", daniel, "bathroom") == "right" and ANSWERS[0] == "right"


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3", "qa4", "qa5"])
def test_what_an_answer_follows_from_is_its_supporting_facts_kinds_in_order(task):
    """support() names each supporting fact's kind as the tests' own parser reads the sentence, in story order; the
    kinds a task's stories have are those SUPPORTS declares for it."""
    kinds = set()
    for s in itertools.islice(stories(task, "test", 0), 300):
        assert support(s) == ", ".join(parse(s.facts[i]).kind for i in s.supporting)
        kinds.add(support(s))
    assert kinds == set(SUPPORTS[task]) and len(kinds) == {"qa2": 3, "qa3": 2}.get(task, 1), kinds


def test_the_table_gives_the_accuracy_on_each_kind_of_support_where_a_task_has_several():
    carried = Story("qa2", ("Mary went to the office.", "Mary got the apple.", "Mary travelled to the kitchen."),
                    "Where is the apple?", "kitchen", (1, 2))
    assert support(carried) == "get, move"
    cells = [Cell("qa2", "0", 0), Cell("qa1", "0", 0)]
    for answer, kind in (("right", "get, move"), ("entity's other label", "get, move"), ("right", "move, drop")):
        cells[0].add(answer, 10, 12, kind)
    cells[1].add("right", 10, 12, "move")
    values = {"tasks": ["qa2", "qa1"], "lengths": ["0"], "accuracy": {"qa2": {"0": 2 / 3}, "qa1": {"0": 1.0}},
              "mean": {"0": 5 / 6}, "cells": [c.to_dict() for c in cells]}
    lines = table(values).splitlines()
    assert [line.split()[-1] for line in lines if line.startswith("  qa2 from ")] == ["50", "100"]
    assert [" ".join(line.split()[:-1]) for line in lines if " from " in line and line.startswith("  q")] == [
        "qa2 from get, move", "qa2 from move, drop"]  # qa1's answers follow from moves alone: no row
    assert Cell.from_dict(cells[0].to_dict()).supports == {"get, move": [1, 2], "move, drop": [1, 1]}


def test_stories_are_grouped_by_their_number_of_facts():
    groups = [facts_group(n) for n in range(1, 30)]
    assert groups == ["1-5"] * 5 + ["6-10"] * 5 + ["11-15"] * 5 + ["16-20"] * 5 + ["21+"] * 9


def test_the_table_gives_the_accuracy_on_each_group_of_stories_by_number_of_facts_in_their_order():
    cells = [Cell("qa2", "0", 0), Cell("qa1", "0", 0)]
    for answer, facts in (("right", 4), ("right", 12), ("last named", 13), ("right", 7), ("right", 25)):
        cells[0].add(answer, 10, 12, "move, get", facts)
    cells[1].add("right", 10, 12, "move", 4)
    cells[1].add("right", 10, 12, "move", 3)
    cells[0].facts_baselines = {"1-5": {"last named": 1.0, "entity's labels": 0.5, "uniform": 1 / 6},
                                "11-15": {"last named": 0.0, "entity's labels": 0.25}}
    values = {"tasks": ["qa2", "qa1"], "lengths": ["0"], "accuracy": {"qa2": {"0": 0.8}, "qa1": {"0": 1.0}},
              "mean": {"0": 0.9}, "cells": [c.to_dict() for c in cells]}
    rows = [line.split() for line in table(values).splitlines() if " facts" in line and line.startswith("  q")]
    assert [(" ".join(row[2:-1]), row[-1]) for row in rows] == [
        ("1-5 facts", "100"), ("1-5 facts: last named", "100"), ("1-5 facts: entity's labels", "50"),
        ("6-10 facts", "100"),  # no rules recorded for it: no rows
        ("11-15 facts", "50"), ("11-15 facts: last named", "0"), ("11-15 facts: entity's labels", "25"),
        ("21+ facts", "100")]
    assert {row[0] for row in rows} == {"qa2"}  # qa1's stories are all of one group: no row
    assert Cell.from_dict(cells[0].to_dict()).facts == {"1-5": [1, 1], "11-15": [1, 2], "6-10": [1, 1], "21+": [1, 1]}
    assert Cell.from_dict({"task": "qa2", "length": "0", "tokens": 0, "correct": 1, "samples": 1}).facts == {}
