"""Samples: a story's facts hidden, in order, in background text until the context has the requested length.

A sample is one document::

    <context: background sentences with the facts between them>\\n
    Question: Where is Mary?\\n
    bathroom\\n

The context is built as BABILong's ``NoiseInjectionDataset`` builds it: background sentences are taken in order
until the facts and they reach the length, then each fact goes, in order, to a random sentence boundary (drawn with
replacement, so several facts may share one). A fact inside a line ends with a space, one after a line end with a
newline. Lengths count the model's own tokens with ``count`` (:func:`xl.data.babilong.data.token_counter`), the question
and answer excluded, as BABILong's ``sample_size`` counts its context. Where BABILong cuts the last sentence to hit
the length exactly, here the context stops before the sentence that would pass it (the context ends with a line
end): ``tokens <= length < tokens + next_tokens + count("\\n")``, ``next_tokens`` being the next sentence's (at most
``MAX_UNIT_TOKENS``). Length 0 is the facts alone, as in BABILong's ``0k``. A story whose facts do not fit the length
is passed over for the next one (BABILong drops bAbI samples with more than length / 8 facts).

Splits: a story belongs to the train, val or test split by a hash of its text (80/10/10), and each split's stories
are drawn from their own seeded stream and kept only if they are the split's, so no story (facts and question) is
in two splits and every split is the same on every machine.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from xl.data.babilong.background import Sentences
from xl.data.babilong.tasks import GENERATORS, QUESTIONS_PER_STORY, Story, kept
from xl.data.errors import DataError

SPLIT_OF_BUCKET = ("train",) * 8 + ("val", "test")
MAX_DRAWS = 1000  # stories passed over in a row before a length is declared too short


@dataclass(frozen=True)
class Sample:
    """A story in its context: ``tokens`` counts the context, ``next_tokens`` the background sentence that did not fit
    (0 for length 0)."""

    story: Story
    context: str
    tokens: int
    next_tokens: int
    earlier: tuple[tuple[str, str], ...] = ()  # (what is read before it, answer) of each earlier question, in order

    @property
    def prompt(self) -> str:
        """What the model reads before it answers."""
        return f"{self.context}Question: {self.story.question}\n"

    @property
    def answer(self) -> str:
        """What it should write: the answer, and the line end that closes it."""
        return f"{self.story.answer}\n"

    def pieces(self) -> list[tuple[str, bool]]:
        """The document in order, each piece with whether it is an answer: the earlier questions' text and answers
        (a training story that keeps them), then the prompt and the answer."""
        return [*((text, k % 2 == 1) for pair in self.earlier for k, text in enumerate(pair)),
                (self.prompt, False), (self.answer, True)]


def split_of(story: Story) -> str:
    bucket = int.from_bytes(hashlib.sha256(story.key().encode()).digest()[:4], "big") % len(SPLIT_OF_BUCKET)
    return SPLIT_OF_BUCKET[bucket]


def stories(task: str, split: str, seed: int, questions: str = "last", most: int = QUESTIONS_PER_STORY,
            supports: Mapping[str, Sequence[str]] | None = None) -> Iterator[Story]:
    """The split's stories of ``task``, in an order fixed by ``seed``; ``questions``: which questions a story keeps
    (:data:`xl.data.babilong.tasks.QUESTIONS`), ``most`` how many at most and ``supports`` what their answers
    follow from (:func:`xl.data.babilong.tasks.kept`; train split's settings)."""
    rng = random.Random(f"babilong:{seed}:{split}:{task}")
    generate = GENERATORS[task]
    while True:
        story = generate(rng, questions, most)
        if split_of(story) == split and kept(story, supports):
            yield story


def hide(story: Story, length: int, background: Sentences, count: Callable[[str], int],
         rng: random.Random) -> Sample | None:
    """``story`` in a context of at most ``length`` tokens; None if its facts alone do not fit."""
    facts = story.facts
    if length == 0:
        if story.asked:
            return _with_questions(story, count)
        context = " ".join(facts) + "\n"
        return Sample(story, context, count(context), 0)
    if any(n < len(facts) for n, _, _ in story.asked):
        raise DataError("a training story's questions between its facts (data.train_questions=all or every) are "
                        "written at data.length=0 only; set data.length=0, or data.train_questions=last or end")
    newline = count("\n")
    reserve = sum(count(f + "\n") for f in facts) + newline  # the most the facts and a closing line end can take
    if reserve > length:
        return None
    units: list[tuple[str, int]] = []
    used = 0
    while used + background.peek()[1] + reserve <= length:
        units.append(background.take())
        used += units[-1][1]
    gaps = sorted(rng.choices(range(len(units) + 1), k=len(facts)))
    pieces: list[tuple[str, int]] = []
    for k in range(len(units) + 1):
        for fact in (facts[i] for i, gap in enumerate(gaps) if gap == k):
            text = fact + ("\n" if not pieces or pieces[-1][0].endswith("\n") else " ")
            pieces.append((text, count(text)))
        if k < len(units):
            pieces.append(units[k])
    tokens = sum(n for _, n in pieces)
    while True:  # more sentences while they fit, the closing line end counted
        unit, n = background.peek()
        if tokens + n + (0 if unit.endswith("\n") else newline) > length:
            break
        pieces.append(background.take())
        tokens += n
    if not pieces[-1][0].endswith("\n"):
        pieces.append(("\n", newline))
        tokens += newline
    context = "".join(text for text, _ in pieces)
    if story.asked:  # questions after all the facts (data.train_questions=end): the context, then each in turn
        earlier = [(f"Question: {question}\n", f"{answer}\n") for _, question, answer in story.asked]
        tokens += sum(count(t) for pair in earlier for t in pair)
        earlier[0] = (context + earlier[0][0], earlier[0][1])
        return Sample(story, "", tokens, background.peek()[1], tuple(earlier))
    return Sample(story, context, tokens, background.peek()[1])


def _with_questions(story: Story, count: Callable[[str], int]) -> Sample:
    """bAbI's own format at length 0: each earlier question on its own line after the facts before it (on a line of
    their own), its answer on the next; the last question ends the sample. ``tokens`` counts all that the last
    question follows."""
    def lines(facts: tuple[str, ...]) -> str:
        return " ".join(facts) + "\n" if facts else ""  # two questions in a row: no empty line between

    earlier, done = [], 0
    for n, question, answer in story.asked:
        earlier.append((lines(story.facts[done:n]) + f"Question: {question}\n", f"{answer}\n"))
        done = n
    context = lines(story.facts[done:])
    return Sample(story, context, sum(count(t) for pair in earlier for t in pair) + count(context), 0, tuple(earlier))


def samples(task: str, length: int, split: str, seed: int, background: Sentences,
            count: Callable[[str], int], questions: str = "last", most: int = QUESTIONS_PER_STORY,
            supports: Mapping[str, Sequence[str]] | None = None) -> Iterator[Sample]:
    """The split's samples of ``task`` at ``length``, the background read from ``background`` in order."""
    rng = random.Random(f"babilong:{seed}:{split}:{task}:{length}:positions")
    passed = 0
    for story in stories(task, split, seed, questions, most, supports):
        sample = hide(story, length, background, count, rng)
        if sample is not None:
            passed = 0
            yield sample
            continue
        passed += 1
        if passed >= MAX_DRAWS:
            raise DataError(f"length {length} is too short for the facts of {task}'s stories ({MAX_DRAWS} in a row "
                            "did not fit); ask for a longer one, or 0 for the facts alone")
