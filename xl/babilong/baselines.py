"""Rules that answer without a memory of the asked entity: what a model's accuracy must beat before it shows memory.

The scorer (:mod:`xl.babilong.score`) scores each rule on the very samples it reads, per task and length, beside the
model. Each rule reads only a story's facts and its question (never the background, never the answer), and answers
with one of the *candidates*: the task's labels (:data:`xl.data.babilong.tasks.LABELS`) of the kind the question asks
for (qa5: a person for "Who ...?", an object for "What ...?"; qa1–qa4: a place), less those the question names (by
BABILong's rule a label in the question is never the answer).

- ``last named``: the candidate named last in the facts. qa1: the place of the last move, whoever moved; qa2: the
  place of the last move; qa3: the last place other than the one after "before"; qa4: the last fact's other place;
  qa5: the last person (or object) of the facts other than those the question names.
- ``most frequent``: the answer most of the cell's samples have, given to every sample.
- ``uniform``: a label of the task drawn uniformly (1/6 for qa1–qa4, 1/7 for qa5).
- ``entity's labels``: a candidate drawn uniformly among those the question's entity occurs with: named in one fact
  with it, in any order. The entity is the actor or object the question names (qa5: each person and object it names;
  qa4: its place); an object's places are those named with an actor of a fact that names the object (the places its
  holders went). With none, a candidate drawn uniformly.

``uniform`` and ``entity's labels`` are expected accuracies (the mean chance of a right draw), not draws.

What a model's answers follow (:func:`follows`, :data:`ANSWERS`): each answer is ``right``; or names one wrong
candidate that is among the entity's labels (``entity's other label``: in qa1 a place where the asked actor was
before); or, if not, the candidate named last (``last named``); or ``another label``; or ``no single label`` (none,
or several). A model that finds the asked entity's facts but not which is the newest answers the entity's other
labels; one that answers by recency, the last named.

What an answer needs (:func:`xl.data.babilong.tasks.support`): the kinds of its supporting facts in the story's
order, such as ``get, move`` in qa2 (an object picked up, then carried by its holder's move) or ``move, drop``
(dropped where its holder had gone); the scorer reports the model's accuracy on each.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from functools import cache

from xl.data.babilong.answers import first_sentence, is_correct
from xl.data.babilong.tasks import LABELS, Story
from xl.data.babilong.world import ACTORS, GIVERS, LOCATIONS, OBJECTS

RULES = ("last named", "most frequent", "uniform", "entity's labels")
ANSWERS = ("right", "entity's other label", "last named", "another label", "no single label")
PEOPLE = tuple(dict.fromkeys((*ACTORS, *GIVERS)))


@cache
def _word(name: str) -> re.Pattern[str]:
    return re.compile(rf"\b{re.escape(name)}\b", re.IGNORECASE)


def named(text: str, names: Sequence[str]) -> list[str]:
    """The names that ``text`` holds as words."""
    return [n for n in names if _word(n).search(text)]


def candidates(task: str, question: str) -> list[str]:
    """The labels of the kind the question asks for, less those it names."""
    kind = (OBJECTS if question.startswith("What") else GIVERS) if task == "qa5" else LABELS[task]
    in_question = {label.lower() for label in LABELS[task] if label.lower() in question.lower()}
    return [c for c in kind if c.lower() not in in_question]


def last_named(task: str, story: Story) -> str | None:
    """The candidate named last in the facts (None if the facts name none)."""
    text = " ".join(story.facts)
    ends = {c: m.end() for c in candidates(task, story.question) for m in _word(c).finditer(text)}
    return max(ends, key=ends.__getitem__) if ends else None


def entity_labels(task: str, story: Story) -> list[str]:
    """The candidates named in one fact with the question's entity (for an object's places: with an actor of a fact
    that names the object)."""
    entities = named(story.question, (*PEOPLE, *OBJECTS)) or named(story.question, LOCATIONS)
    options = candidates(task, story.question)
    linked = set(entities)
    if set(options) <= set(LOCATIONS):  # an object's places are its holders'
        objects = [e for e in entities if e in OBJECTS]
        linked |= {a for fact in story.facts if named(fact, objects) for a in named(fact, PEOPLE)}
    found = {c for fact in story.facts if named(fact, sorted(linked)) for c in named(fact, options)}
    return [c for c in options if c in found]


def expected(task: str, stories: Sequence[Story]) -> dict[str, float]:
    """Each rule's number of right answers on ``stories`` (expected numbers for the uniform rules)."""
    answers = [s.answer for s in stories]
    top = Counter(answers).most_common(1)[0][1] if answers else 0
    right = {"last named": 0.0, "most frequent": float(top), "uniform": 0.0, "entity's labels": 0.0}
    for s in stories:
        right["last named"] += last_named(task, s) == s.answer
        right["uniform"] += (s.answer in LABELS[task]) / len(LABELS[task])
        options = entity_labels(task, s) or candidates(task, s.question)
        right["entity's labels"] += (s.answer in options) / len(options)
    return right


def follows(task: str, story: Story, output: str) -> str:
    """Which of :data:`ANSWERS` the model's ``output`` to ``story`` is (read by BABILong's rule,
    :mod:`xl.data.babilong.answers`)."""
    if is_correct(story.answer, output, story.question, LABELS[task]):
        return "right"
    text, question = first_sentence(output), story.question.lower()
    found = [label for label in LABELS[task] if label.lower() in text and label.lower() not in question]
    if len(found) != 1:
        return "no single label"
    (answer,) = found
    if answer in entity_labels(task, story):
        return "entity's other label"
    return "last named" if answer == last_named(task, story) else "another label"
