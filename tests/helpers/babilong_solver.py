"""A small bAbI solver for the tests, written apart from the generator: it reads a story's sentences back from text
and answers its question from them alone.

It knows nothing of the generator's state. Actors are where their last move took them; an object is wherever the
last fact about it (picked up, dropped, given) left it: with its holder, who carries it on every move, or where it
was dropped. ``solve`` raises :class:`Unanswerable` when the sentences do not fix the answer, and
:func:`check_consistent` raises AssertionError when they describe an impossible world (an object picked up while
someone holds it, dropped or given by someone who does not hold it, two actors in two places exchanging it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MOVE = re.compile(r"(\w+) (?:moved to|went to|went back to|journeyed to|travelled to) the (\w+)\.")
GET = re.compile(r"(\w+) (?:got|took|picked up|grabbed) the (\w+)(?: there)?\.")
DROP = re.compile(r"(\w+) (?:dropped|put down|discarded|left) the (\w+)(?: there)?\.")
GIVE = re.compile(r"(\w+) (?:gave|handed|passed) the (\w+) to (\w+)\.")
RELATION = re.compile(r"The (\w+) is (north|south|east|west) of the (\w+)\.")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
FACT = re.compile("|".join(f"(?:{p.pattern})" for p in (MOVE, GET, DROP, GIVE, RELATION)))


class Unanswerable(Exception):
    pass


@dataclass(frozen=True)
class Event:
    kind: str
    actor: str
    thing: str  # a place (move), an object (get, drop, give), a place (relation)
    other: str = ""  # give: the receiver; relation: the direction


def parse(sentence: str) -> Event:
    for kind, pattern in (("move", MOVE), ("get", GET), ("drop", DROP), ("give", GIVE), ("relation", RELATION)):
        m = pattern.fullmatch(sentence)
        if m is None:
            continue
        if kind == "give":
            return Event(kind, m[1], m[2], m[3])
        if kind == "relation":
            return Event(kind, m[1], m[3], m[2])
        return Event(kind, m[1], m[2])
    raise AssertionError(f"not a bAbI fact: {sentence!r}")


def find_facts(text: str) -> list[str]:
    """The fact sentences of a text, in order (the background must hold none)."""
    return [m.group(0) for m in FACT.finditer(text)]


def actor_place(events: list[Event], actor: str, t: int) -> str | None:
    """Where ``actor`` is after events[0..t] (their last move), or None."""
    for e in reversed(events[: t + 1]):
        if e.kind == "move" and e.actor == actor:
            return e.thing
    return None


def object_place(events: list[Event], obj: str, t: int) -> str | None:
    """Where ``obj`` is after events[0..t], or None."""
    for s in range(t, -1, -1):
        e = events[s]
        if e.kind not in ("get", "drop", "give") or e.thing != obj:
            continue
        if e.kind == "drop":  # left where the holder was
            return actor_place(events, e.actor, s) or object_place(events, obj, s - 1)
        holder = e.other if e.kind == "give" else e.actor
        moved = next((m.thing for m in reversed(events[s + 1: t + 1]) if m.kind == "move" and m.actor == holder), None)
        if moved is not None:
            return moved
        here = [actor_place(events, a, s) for a in (holder, e.actor)]
        return next((p for p in here if p is not None), None) or object_place(events, obj, s - 1)
    return None


def check_consistent(facts: list[str]) -> None:
    events = [parse(f) for f in facts]
    holder: dict[str, str | None] = {}
    for t, e in enumerate(events):
        if e.kind == "move":
            assert actor_place(events, e.actor, t - 1) != e.thing, f"fact {t}: {e.actor} moves where they are"
        elif e.kind == "get":
            assert holder.get(e.thing) is None, f"fact {t}: {e.thing} is picked up while {holder[e.thing]} holds it"
            known = [actor_place(events, e.actor, t), object_place(events, e.thing, t - 1)]
            assert None in known or known[0] == known[1], f"fact {t}: {e.actor} picks up {e.thing} elsewhere"
            holder[e.thing] = e.actor
        elif e.kind == "drop":
            assert holder.get(e.thing) == e.actor, f"fact {t}: {e.actor} drops {e.thing} without holding it"
            holder[e.thing] = None
        elif e.kind == "give":
            assert holder.get(e.thing) == e.actor, f"fact {t}: {e.actor} gives {e.thing} without holding it"
            places = [actor_place(events, a, t) for a in (e.actor, e.other)]
            assert None in places or places[0] == places[1], f"fact {t}: {e.actor} and {e.other} are apart"
            holder[e.thing] = e.other


def solve(facts: list[str], question: str) -> str:
    """The answer that ``facts`` give to ``question``."""
    events = [parse(f) for f in facts]
    last = len(events) - 1
    if m := re.fullmatch(r"Where is the (\w+)\?", question):
        return _known(object_place(events, m[1], last))
    if m := re.fullmatch(r"Where is (\w+)\?", question):
        return _known(actor_place(events, m[1], last))
    if m := re.fullmatch(r"Who has the (\w+)\?", question):
        holder = None  # each get, give and drop of the object passes it on
        for e in events:
            if e.kind in ("get", "give", "drop") and e.thing == m[1]:
                holder = {"get": e.actor, "give": e.other, "drop": None}[e.kind]
        return _known(holder)
    if m := re.fullmatch(r"Where was the (\w+) before the (\w+)\?", question):
        places = []
        for t in range(len(events)):
            p = object_place(events, m[1], t)
            if p is not None and (not places or places[-1] != p):
                places.append(p)
        if len(places) < 2 or places[-1] != m[2] or places.count(m[2]) != 1:
            raise Unanswerable(question)
        return places[-2]
    if m := re.fullmatch(r"What is (north|south|east|west) of the (\w+)\?", question):
        return _only({a for a, d, b in _relations(events) if d == m[1] and b == m[2]})
    if m := re.fullmatch(r"What is the (\w+) (north|south|east|west) of\?", question):
        return _only({b for a, d, b in _relations(events) if a == m[1] and d == m[2]})
    gives = [(e.actor, e.thing, e.other) for e in events if e.kind == "give"]
    forms = ((r"Who gave the (\w+) to (\w+)\?", lambda g, m: (g[1], g[2]) == (m[1], m[2]), 0),
             (r"Who did (\w+) give the (\w+) to\?", lambda g, m: (g[0], g[1]) == (m[1], m[2]), 2),
             (r"What did (\w+) give to (\w+)\?", lambda g, m: (g[0], g[2]) == (m[1], m[2]), 1),
             (r"Who received the (\w+)\?", lambda g, m: g[1] == m[1], 2),
             (r"Who gave the (\w+)\?", lambda g, m: g[1] == m[1], 0))
    for form, matches, part in forms:
        if m := re.fullmatch(form, question):
            found = [g for g in gives if matches(g, m)]
            if not found:
                raise Unanswerable(question)
            return found[-1][part]  # the latest such give
    raise AssertionError(f"not a question of qa1-qa5: {question!r}")


def _relations(events: list[Event]) -> set[tuple[str, str, str]]:
    """(a, direction, b) for every 'the a is direction of the b' the facts state or imply (its converse)."""
    out = set()
    for e in events:
        assert e.kind == "relation", f"qa4 holds relations only, not {e}"
        out |= {(e.actor, e.other, e.thing), (e.thing, OPPOSITE[e.other], e.actor)}
    return out


def _known(value: str | None) -> str:
    if value is None:
        raise Unanswerable("the facts do not fix it")
    return value


def _only(values: set[str]) -> str:
    if len(values) != 1:
        raise Unanswerable(f"{len(values)} answers: {sorted(values)}")
    return next(iter(values))
