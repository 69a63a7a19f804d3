"""bAbI's basic world (Weston et al., 2015): six locations, actors who move between them, three objects they carry.

Names and sentences are those of the released bAbI data (v1.2), which BABILong hides in its background text:
John, Mary, Sandra and Daniel (the generator's ``world_basic``) for qa1–qa3, Bill, Fred, Jeff and Mary for qa5
(BABILong's qa5 labels), and the data's verbs ("went back to", "picked up ... there", "put down", "handed ... to").

:class:`World` keeps two states. The true one (every actor and object starts somewhere at random) decides which
actions are possible, as bAbI's generator does: an actor picks up an object only where it lies, gives it only to an
actor in the same place. The reader's one holds only what the facts told so far, each value with the facts it
follows from (its support): the locations of actors who moved, the holder of each object, and an object's location
once a fact fixes it. Questions are asked only about what the reader knows, so each has one answer that follows from
the facts; the true state only ever confirms it (every fact is true of it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

LOCATIONS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
OBJECTS = ("apple", "football", "milk")
ACTORS = ("Daniel", "John", "Mary", "Sandra")  # qa1-qa3
GIVERS = ("Bill", "Fred", "Jeff", "Mary")  # qa5
MOVES = ("moved to", "went to", "went back to", "journeyed to", "travelled to")
GETS = ("got", "took", "picked up", "grabbed")
DROPS = ("dropped", "put down", "discarded", "left")
GIVES = ("gave", "handed", "passed")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}

Support = frozenset[int]  # indices of the facts a value follows from


@dataclass(frozen=True)
class Action:
    kind: str  # move, get, drop, give
    actor: str
    target: str  # move: a location; get, drop, give: an object
    receiver: str = ""  # give: who receives the object


@dataclass(frozen=True)
class Known:
    value: str
    support: Support


@dataclass
class World:
    """The true state and the reader's knowledge of one story; :meth:`perform` adds a fact (its sentence)."""

    rng: random.Random
    actors: tuple[str, ...]
    facts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.at = {a: self.rng.choice(LOCATIONS) for a in self.actors}  # true locations of the actors
        self.holder: dict[str, str | None] = dict.fromkeys(OBJECTS)  # true (and known: every change is a fact)
        self.lying = {o: self.rng.choice(LOCATIONS) for o in OBJECTS}  # true location of an object nobody holds
        self.actor_at: dict[str, Known] = {}  # what the reader knows: where an actor is (from moves)
        self.held: dict[str, Known] = {}  # who holds an object (the fact that gave it to them)
        self.object_at: dict[str, Known] = {}  # where an object is
        self.history: dict[str, list[Known]] = {o: [] for o in OBJECTS}  # the known locations of an object in order

    def location(self, o: str) -> str:
        """The object's true location."""
        holder = self.holder[o]
        return self.lying[o] if holder is None else self.at[holder]

    # ---- possible actions ----------------------------------------------------------------------------------------
    def propose(self, kind: str) -> Action | None:
        """A random action of ``kind`` that is possible in the true state (None when there is none)."""
        rng = self.rng
        if kind == "move":
            actor = rng.choice(self.actors)
            return Action("move", actor, rng.choice([p for p in LOCATIONS if p != self.at[actor]]))
        if kind == "get":
            options = [(a, o) for a in self.actors for o in OBJECTS
                       if self.holder[o] is None and self.lying[o] == self.at[a]]
        elif kind == "drop":
            options = [(a, o) for o in OBJECTS if (a := self.holder[o]) is not None]
        elif kind == "give":
            options = [(a, o, b) for o in OBJECTS if (a := self.holder[o]) is not None
                       for b in self.actors if b != a and self.at[b] == self.at[a]]
        else:
            raise ValueError(f"unknown action {kind!r}")
        return Action(kind, *rng.choice(options)) if options else None

    def propose_any(self, kinds: tuple[tuple[str, ...], ...]) -> Action:
        """bAbI's sampling: a random group of kinds (retried while none of its actions is possible), then a random
        possible action of that group."""
        while True:
            group = self.rng.choice(kinds)
            options = [a for a in (self.propose(k) for k in group) if a is not None]
            if options:
                return self.rng.choice(options)

    # ---- facts ---------------------------------------------------------------------------------------------------
    def perform(self, action: Action) -> int:
        """Apply ``action`` to both states and write its sentence; returns the fact's index."""
        i = len(self.facts)
        self.facts.append(self.sentence(action))
        a, target = action.actor, action.target
        if action.kind == "move":
            self.at[a] = target
            self.actor_at[a] = Known(target, frozenset({i}))
            for o in OBJECTS:
                if self.holder[o] == a:  # what an actor carries goes with them
                    self._object_now(o, Known(target, self.held[o].support | {i}))
        elif action.kind == "get":
            self.holder[target] = a
            self.held[target] = Known(a, frozenset({i}))
            here = self.actor_at.get(a)
            if here is not None:
                self._object_now(target, Known(here.value, here.support | {i}))
            elif target in self.object_at:  # picked up where it was: it has not moved
                self.object_at[target] = Known(self.object_at[target].value, self.object_at[target].support | {i})
        elif action.kind == "drop":
            self.lying[target] = self.at[a]
            self.holder[target] = None
            del self.held[target]
            here = self.actor_at.get(a)
            if here is not None:  # left where its holder is
                self._object_now(target, Known(here.value, here.support | {i}))
            elif target in self.object_at:
                self.object_at[target] = Known(self.object_at[target].value, self.object_at[target].support | {i})
        else:  # give: the object changes hands in one place
            self.holder[target] = action.receiver
            self.held[target] = Known(action.receiver, frozenset({i}))
        return i

    def _object_now(self, o: str, known: Known) -> None:
        """The reader now knows that ``o`` is at ``known.value``: a new location extends its known history, the same
        one is now known from these facts (the latest, which a question about it cites)."""
        self.object_at[o] = known
        if self.history[o] and self.history[o][-1].value == known.value:
            self.history[o][-1] = known
        else:
            self.history[o].append(known)

    def sentence(self, action: Action) -> str:
        rng = self.rng
        if action.kind == "move":
            return f"{action.actor} {rng.choice(MOVES)} the {action.target}."
        if action.kind == "give":
            return f"{action.actor} {rng.choice(GIVES)} the {action.target} to {action.receiver}."
        verbs = GETS if action.kind == "get" else DROPS
        there = " there" if rng.random() < 0.5 else ""
        return f"{action.actor} {rng.choice(verbs)} the {action.target}{there}."
