"""The bAbI stories of xl.data.babilong.tasks: every answer follows from the facts, and from its supporting facts alone,
by the tests' own solver (tests/helpers/babilong_solver.py), in a world that could be; the same seed writes the same
stories."""

from __future__ import annotations

import random

import pytest

from tests.helpers.babilong_solver import Unanswerable, check_consistent, solve
from xl.data.babilong.tasks import GENERATORS, LABELS, TASKS, Story

STORIES = 400  # per task


def stories(task: str, seed: str = "tests", n: int = STORIES) -> list[Story]:
    rng = random.Random(seed)
    return [GENERATORS[task](rng) for _ in range(n)]


@pytest.mark.parametrize("task", TASKS)
def test_every_answer_follows_from_the_facts_and_from_its_supporting_facts(task):
    for story in stories(task):
        facts = list(story.facts)
        check_consistent(facts)
        assert solve(facts, story.question) == story.answer, story
        assert story.supporting and all(0 <= i < len(facts) for i in story.supporting)
        assert solve([facts[i] for i in story.supporting], story.question) == story.answer, story


@pytest.mark.parametrize("task", TASKS)
def test_answers_are_labels_that_the_question_does_not_name(task):
    """BABILong's rule ignores labels the question names, so such an answer could never be scored right."""
    for story in stories(task):
        assert story.answer in LABELS[task]
        assert story.answer.lower() not in story.question.lower()


@pytest.mark.parametrize("task", ["qa2", "qa3"])
def test_the_tasks_need_as_many_supporting_facts_as_their_names_say(task):
    counts = {len(s.supporting) for s in stories(task)}
    assert max(counts) == {"qa2": 2, "qa3": 3}[task], counts


def test_the_solver_catches_a_wrong_answer_and_a_missing_fact():
    """The check above can fail: another label is refused, and so is a qa3 story without one of its facts."""
    for task in TASKS:
        for story in stories(task, n=50):
            wrong = next(label for label in LABELS[task] if label != story.answer)
            assert solve(list(story.facts), story.question) != wrong
    for story in stories("qa3", n=50):
        for left_out in story.supporting:
            facts = [f for i, f in enumerate(story.facts) if i in story.supporting and i != left_out]
            with pytest.raises((Unanswerable, AssertionError)):
                assert solve(facts, story.question) == story.answer


def test_the_same_seed_writes_the_same_stories_and_another_seed_others():
    for task in TASKS:
        assert stories(task, "a", 30) == stories(task, "a", 30)
        assert stories(task, "a", 30) != stories(task, "b", 30)


def test_qa1_asks_where_an_actor_is_after_moves_only():
    story = stories("qa1", n=1)[0]
    assert story.question.startswith("Where is ") and len(story.facts) % 2 == 0 and len(story.supporting) == 1
