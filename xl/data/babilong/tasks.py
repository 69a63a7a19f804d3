"""bAbI tasks qa1–qa5 (Weston et al., 2015), written from the rules of its generator (facebookarchive/bAbI-tasks).

Each task writes one story at a time and stops at one question; as BABILong does with the released data, a story
that asks several questions gives one sample per question, with the facts before it (here: the story is cut at its
k-th question, k drawn from 1 to 5, since bAbI's stories ask five).

- qa1, single supporting fact: two moves between questions; "Where is Mary?" (her last move).
- qa2, two supporting facts: moves, objects picked up and dropped; after at least three facts since the last question,
  one time in two, "Where is the football?" about an object whose location two facts fix (who picked it up and where
  they went, or where its holder was and that they dropped it there).
- qa3, three supporting facts: the same story; "Where was the football before the kitchen?" about an object whose
  last two locations at most three facts fix, asked only when the facts show the object in its present location
  once, so that "before" has one meaning.
- qa4, two-argument relations: three locations in a row from north to south (or west to east), two facts that relate
  each neighbour to the middle one, each stated either way round; "What is north of the kitchen?" or "What is the
  kitchen north of?" about the middle one.
- qa5, three-argument relations: moves, objects picked up and given; after a give, zero to five unrelated facts (none
  about the given object, no other give between the same two actors), then "Who gave the football to Fred?", "Who did
  Jeff give the football to?", "What did Jeff give to Fred?", "Who received the football?" or "Who gave the football?".
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from xl.data.babilong.world import (
    ACTORS,
    DROPS,
    GETS,
    GIVERS,
    GIVES,
    LOCATIONS,
    MOVES,
    OBJECTS,
    OPPOSITE,
    Action,
    Known,
    World,
)

TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")
# The answers each task can have (BABILong's TASK_LABELS for qa1-qa5, babilong/metrics.py).
LABELS = {"qa1": LOCATIONS, "qa2": LOCATIONS, "qa3": LOCATIONS, "qa4": LOCATIONS, "qa5": (*GIVERS, *OBJECTS)}
QUESTIONS_PER_STORY = 5  # a story is cut at its k-th question, k from 1 to this (``most`` of a training story)
MOST_QUESTIONS = 10  # the most a training or validation story may run to: stories up to twice a test story's
# Which questions a story keeps (data.train_questions): its last (BABILong's one), all of them in bAbI's format, in
# qa1 every actor's at each question's place (other tasks: all), or once after all the facts every actor's (qa1) or
# every object's the task could ask about (qa2, qa3; qa4, qa5: last); ``end_actors``: as ``end``, and in qa2 and qa3
# every actor's who moved too (the place the objects' questions end with); ``end_holders``: as ``end_actors``, and
# who holds each object someone holds (the actor whose moves carry it): the two steps of qa2's answer asked apart.
QUESTIONS = ("last", "all", "every", "end", "end_actors", "end_holders")
ENDS = ("end", "end_actors", "end_holders")  # the values that ask after all the facts
# Words a value's training questions use that no story of BABILong's questions has: a vocabulary fitted on other
# stories than the run's (a curriculum's shared one) is given them too.
QUESTION_WORDS = {"end_holders": ("Who", "has")}
MAX_FACTS = 300  # a story of qa2 or qa3 that has not reached its question by then is begun again
FACT_KINDS = (("move", MOVES), ("give", GIVES), ("get", GETS), ("drop", DROPS))  # else a relation (qa4)
# What each task's answer can follow from (:func:`support`): the kinds of its supporting facts in the story's order.
# qa2: ``move, get`` (picked up where its holder had gone), ``get, move`` (carried by its holder's move), ``move,
# drop`` (dropped where its holder had gone).
SUPPORTS = {"qa1": ("move",), "qa2": ("move, get", "get, move", "move, drop"),
            "qa3": ("move, get, move", "get, move, move"), "qa4": ("relation",), "qa5": ("give",)}
OBJECT_ACTIONS = (("get", "drop"), ("move",))  # qa2, qa3: get or drop, or a move, each group one time in two
GIVER_ACTIONS = (("get",), ("give",), ("move",))  # qa5


@dataclass(frozen=True)
class Story:
    """Facts, one question and its answer; ``supporting``: the indices of the facts the answer follows from.
    ``asked``: the story's earlier questions, each ``(facts before it, question, answer)``, where the generator was
    asked to keep them (a training story in bAbI's format, ``data.train_questions=all``)."""

    task: str
    facts: tuple[str, ...]
    question: str
    answer: str
    supporting: tuple[int, ...]
    asked: tuple[tuple[int, str, str], ...] = ()

    def key(self) -> str:
        """The story as text (task, facts, question): what must never be in two splits."""
        return "\n".join((self.task, *self.facts, self.question))


def fact_kind(fact: str) -> str:
    """move, get, drop or give, by the fact's verb; relation for qa4's facts."""
    return next((kind for kind, verbs in FACT_KINDS if any(f" {verb} the " in fact for verb in verbs)), "relation")


def support(story: Story) -> str:
    """What the answer follows from: the kind of each supporting fact, in the story's order (``get, move``)."""
    return ", ".join(fact_kind(story.facts[i]) for i in story.supporting)


def is_train_support(value: object) -> bool:
    """Whether ``value`` is a ``data.train_support``: a mapping from tasks to lists of their :data:`SUPPORTS`."""
    return isinstance(value, Mapping) and all(
        task in SUPPORTS and isinstance(kinds, Sequence) and not isinstance(kinds, str) and len(kinds)
        and all(kind in SUPPORTS[task] for kind in kinds) for task, kinds in value.items())


def is_most_questions(value: object) -> bool:
    """Whether ``value`` is a ``data.train_most_questions`` or ``val_most_questions``: a whole number from 1 to
    :data:`MOST_QUESTIONS`."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MOST_QUESTIONS


def kept(story: Story, supports: Mapping[str, Sequence[str]] | None) -> bool:
    """Whether a training story is kept under ``data.train_support`` (``supports``): its task is not named there, or
    its answer follows from one of the kinds named for it."""
    return not supports or story.task not in supports or support(story) in supports[story.task]


def answered(task: str, world: World, question: str, known: Known) -> Story:
    return Story(task, tuple(world.facts), question, known.value, tuple(sorted(known.support)))


def with_asked(story: Story, earlier: list[Story]) -> Story:
    """``story`` that keeps ``earlier`` (stories cut at its earlier questions) as its earlier questions."""
    return replace(story, asked=tuple((len(e.facts), e.question, e.answer) for e in earlier))


def qa1(rng: random.Random, questions: str = "last",
        most: int = QUESTIONS_PER_STORY) -> Story:
    """A question after every two moves, the k-th ends the story (k from 1 to ``most``). ``questions="all"``
    keeps the earlier ones too, ``"every"`` asks at each of those points about every actor who has moved, in random
    order, the story's own question last; ``"end"`` asks about every actor once, after all the facts, as ``"every"``
    does at the last point (so the facts before the questions are all a test story has: no earlier answer tells
    where an actor was). Each draws more of ``rng``: other stories than ``"last"``."""
    world = World(rng, ACTORS)
    earlier = []

    def ask(actors: list[str]) -> None:
        earlier.extend(answered("qa1", world, f"Where is {a}?", world.actor_at[a]) for a in actors)

    for k in range(rng.randint(1, most)):
        if k and questions == "all":
            ask([rng.choice(sorted(world.actor_at))])
        elif k and questions == "every":
            ask(rng.sample(sorted(world.actor_at), len(world.actor_at)))
        world.perform(world.propose("move"))
        world.perform(world.propose("move"))
    actor = rng.choice(sorted(world.actor_at))
    if questions == "every" or questions in ENDS:
        ask(rng.sample([a for a in sorted(world.actor_at) if a != actor], len(world.actor_at) - 1))
    return with_asked(answered("qa1", world, f"Where is {actor}?", world.actor_at[actor]), earlier)


Askable = Callable[[World], dict[str, tuple[str, Known]]]  # per object the task may ask about: question, answer


def _object_story(task: str, rng: random.Random, askable: Askable, questions: str, most: int) -> Story:
    """qa2 and qa3: gets, drops and moves; a question after three facts or more, one time in two, about an object
    drawn among those ``askable`` offers, if any; the k-th question ends the story. ``questions``: ``"all"`` and
    ``"every"`` keep the earlier ones (the same draws of ``rng``), ``"end"`` asks after the last one's facts about
    each other askable object too, in random order, the story's own question last (more draws: other stories);
    ``"end_actors"`` asks there about every actor who moved as well ("Where is Mary?"), all in one random order;
    ``"end_holders"`` also who holds each object someone holds ("Who has the football?")."""
    world = World(rng, ACTORS)
    last = rng.randint(1, most)
    since = 0
    earlier: list[Story] = []
    while True:
        if len(world.facts) == MAX_FACTS:
            world, since, earlier = World(rng, ACTORS), 0, []
        world.perform(world.propose_any(OBJECT_ACTIONS))
        since += 1
        if since > 2 and rng.random() < 0.5:
            options = askable(world)
            if options:
                o = world.rng.choice(sorted(options))
                story = answered(task, world, *options[o])
                since = 0
                if len(earlier) + 1 == last:
                    if questions in ENDS:
                        others = [answered(task, world, *options[p]) for p in sorted(options) if p != o]
                        if questions != "end":
                            others += [answered(task, world, f"Where is {a}?", world.actor_at[a])
                                       for a in sorted(world.actor_at)]
                        if questions == "end_holders":
                            others += [answered(task, world, f"Who has the {h}?", world.held[h])
                                       for h in sorted(world.held)]
                        return with_asked(story, rng.sample(others, len(others)))
                    return with_asked(story, earlier if questions in ("all", "every") else [])
                earlier.append(story)


def qa2(rng: random.Random, questions: str = "last", most: int = QUESTIONS_PER_STORY) -> Story:
    def askable(world: World) -> dict[str, tuple[str, Known]]:
        return {o: (f"Where is the {o}?", world.object_at[o]) for o in sorted(world.object_at)
                if len(world.object_at[o].support) <= 2}

    return _object_story("qa2", rng, askable, questions, most)


def qa3(rng: random.Random, questions: str = "last", most: int = QUESTIONS_PER_STORY) -> Story:
    def askable(world: World) -> dict[str, tuple[str, Known]]:
        options = {o: Known(h[-2].value, h[-2].support | h[-1].support) for o in OBJECTS
                   if len(h := world.history[o]) > 1 and [k.value for k in h].count(h[-1].value) == 1}
        return {o: (f"Where was the {o} before the {world.history[o][-1].value}?", known)
                for o, known in options.items() if len(known.support) <= 3}

    return _object_story("qa3", rng, askable, questions, most)


def qa4(rng: random.Random, questions: str = "last", most: int = QUESTIONS_PER_STORY) -> Story:
    """One question, whatever ``questions``."""
    first, middle, last = rng.sample(LOCATIONS, 3)  # first is `way` of middle, middle is `way` of last
    way = rng.choice(("north", "west"))
    facts = []
    for a, b in ((first, middle), (middle, last)):  # each relation stated either way round
        facts.append(f"The {a} is {way} of the {b}." if rng.random() < 0.5 else
                     f"The {b} is {OPPOSITE[way]} of the {a}.")
    order = [0, 1] if rng.random() < 0.5 else [1, 0]
    asked = rng.choice((way, OPPOSITE[way]))
    if rng.random() < 0.5:  # what lies `asked` of the middle one
        question, answer = f"What is {asked} of the {middle}?", first if asked == way else last
    else:  # what the middle one lies `asked` of
        question, answer = f"What is the {middle} {asked} of?", last if asked == way else first
    fact = 0 if answer == first else 1
    return Story("qa4", tuple(facts[k] for k in order), question, answer, (order.index(fact),))


def qa5(rng: random.Random, questions: str = "last", most: int = QUESTIONS_PER_STORY) -> Story:
    """The k-th give's question ends the story, whatever ``questions`` (its earlier questions would need more draws
    of ``rng``)."""
    world = World(rng, GIVERS)
    last = rng.randint(1, most)
    asked = since = 0
    while True:
        action = world.propose_any(GIVER_ACTIONS)
        fact = world.perform(action)
        since += 1
        if since < 2 or action.kind != "give":
            continue
        for _ in range(rng.randint(0, 5)):
            world.perform(_unrelated(world, action))
        asked, since = asked + 1, 0
        if asked == last:
            return _who_gave(world, action, fact)


def _unrelated(world: World, given: Action) -> Action:
    """An action not about the given object and not another give between the same two actors."""
    while True:
        action = world.propose_any(GIVER_ACTIONS)
        same_pair = action.kind == "give" and (action.actor, action.receiver) == (given.actor, given.receiver)
        if action.target != given.target and not same_pair:
            return action


def _who_gave(world: World, give: Action, fact: int) -> Story:
    a, o, b = give.actor, give.target, give.receiver
    question, answer = world.rng.choice((
        (f"Who gave the {o} to {b}?", a),
        (f"Who did {a} give the {o} to?", b),
        (f"What did {a} give to {b}?", o),
        (f"Who received the {o}?", b),
        (f"Who gave the {o}?", a),
    ))
    return answered("qa5", world, question, Known(answer, frozenset({fact})))


GENERATORS: dict[str, Callable[..., Story]] = {"qa1": qa1, "qa2": qa2, "qa3": qa3, "qa4": qa4,
                                                          "qa5": qa5}
