"""The words a schema field carries beside its type: the values it allows and what it means.

A schema (:mod:`xl.config.schema`) declares each setting with :func:`setting`: its default, a :class:`Bound` (the range
or the choices a type cannot say) and one line of help. :mod:`xl.config.rules` checks every bound of a composed config,
and ``docs/configuration.md`` is generated from the same fields (:mod:`xl.config.reference`), so the rule, its error
sentence and its documentation are one declaration.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

from omegaconf import OmegaConf


@dataclass(frozen=True)
class Bound:
    """What a value must be, in words that complete "KEY must be ...", and the test of it."""

    says: str
    test: Callable[[Any], bool]
    choices: tuple[Any, ...] | None = None  # the values it allows, where it lists them (one_of)

    def allows(self, value: Any) -> bool:
        try:
            return bool(self.test(value))
        except TypeError:  # a value of a type the test cannot compare (the schema's type check comes first)
            return False

    def __or__(self, other: Bound) -> Bound:
        return Bound(f"{self.says} or {other.says}", lambda v: self.allows(v) or other.allows(v))


def setting(default: Any = dataclasses.MISSING, *, bound: Bound | None = None, help: str = "",
            factory: Callable[[], Any] | None = None) -> Any:
    """A schema field: ``default`` (or ``factory``), its ``bound`` and its ``help`` line."""
    metadata = {"bound": bound, "help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def copied(f: dataclasses.Field) -> dataclasses.Field:
    """A new field with ``f``'s default (or factory) and metadata (bound, help): a setting declared once, reused in
    a dataclass made from it."""
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def bound_of(field: dataclasses.Field) -> Bound | None:
    return field.metadata.get("bound")


def help_of(field: dataclasses.Field) -> str:
    return field.metadata.get("help", "")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a finite float (Hydra reads ``inf`` and ``nan`` as floats)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def at_least(low: int | float, words: str = "an integer") -> Bound:
    """``value >= low``: an integer, or (other ``words``, such as "a finite number") any finite number."""
    test = is_int if words == "an integer" else is_number
    return Bound(f"{words} >= {low}", lambda v: test(v) and v >= low)


def above(low: int | float, words: str = "a finite number") -> Bound:
    return Bound(f"{words} > {low}", lambda v: is_number(v) and v > low)


def between(low: float, high: float, words: str = "a number", high_open: bool = True) -> Bound:
    """``low <= value < high`` (``<= high`` with ``high_open=False``)."""
    close = ")" if high_open else "]"
    return Bound(f"{words} in [{low}, {high}{close}".lstrip(),
                 lambda v: is_number(v) and low <= v and (v < high if high_open else v <= high))


def one_of(*choices: Any, words: str | None = None) -> Bound:
    shown = ", ".join("null" if c is None else str(c) for c in choices)
    return Bound(words or f"one of {shown}", lambda v: v in choices, choices)


def exactly(value: Any, words: str) -> Bound:
    return Bound(words, lambda v: v == value and type(v) is type(value))


NULL = Bound("null", lambda v: v is None)


def optional(bound: Bound) -> Bound:
    """``bound``, or null."""
    return NULL | bound


def nullable(bound: Bound) -> Bound:
    """``bound``, or null, in words: a list of choices ends with null ("reset, ignore or null"), a description
    begins with it ("null or an integer >= 0", "null, -1 (no clamping) or a positive integer")."""
    if bound.choices is not None:
        says = f"{', '.join(str(c) for c in bound.choices)} or null"
    else:
        says = f"null, {bound.says}" if " or " in bound.says else f"null or {bound.says}"
    return Bound(says, lambda v: v is None or bound.allows(v))


# ---- a type in words -------------------------------------------------------------------------------------------
TYPE_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
              str: ("a string", "strings")}


def describe_type(hint: Any) -> str:
    """``bool | None`` -> "true, false or null": what a user may write for a key of this type."""
    origin, args = get_origin(hint), get_args(hint)
    if origin not in (Union, types.UnionType):
        if hint in TYPE_WORDS:
            return TYPE_WORDS[hint][0]
        if origin is list:
            return f"a list of {TYPE_WORDS[args[0]][1]}" if args and args[0] in TYPE_WORDS else "a list"
        return "a mapping" if origin is dict else "a value"
    present = [a for a in args if a is not type(None)]
    choices = ["a number"] if set(present) == {int, float} else [
        word for a in present for word in (["true", "false"] if a is bool else [describe_type(a)])]
    choices += ["null"] if len(present) < len(args) else []
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def check_fields(obj: Any, prefix: str) -> None:
    """Raise ValueError, in one sentence naming ``prefix + field``, for the first field of the dataclass instance
    ``obj`` whose value breaks the bound declared beside it (:func:`setting`)."""
    for f in dataclasses.fields(obj):
        bound, value = bound_of(f), getattr(obj, f.name)
        if bound is not None and not bound.allows(value):
            raise ValueError(f"{prefix}{f.name} must be {bound.says}, got {shown(value)!r}")


def shown(value: Any) -> Any:
    """A config value as the user wrote it (a list node as a list)."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def schema_bounds(node: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(full key, value, bound) of every leaf under ``node`` whose schema field declares a bound."""
    found = []
    if not OmegaConf.is_dict(node):
        return found
    schema = OmegaConf.get_type(node)
    declared = {f.name: bound_of(f) for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    for name, child in node.items_ex(resolve=False):  # a leaf is read (resolved) only if it has a bound
        if declared.get(name) is not None:  # a mapping whose field declares a bound is checked whole
            found.append((f"{prefix}{name}", node[name], declared[name]))
        elif OmegaConf.is_dict(child):
            found += schema_bounds(child, f"{prefix}{name}.")
    return found
