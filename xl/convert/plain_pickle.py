"""Read a pickle that holds only plain data, without Python's unpickler.

A pickle is a program for a stack machine; ``pickle.load`` runs it, and even with its ``find_class`` restricted it
allocates what the file declares before reading it (a 9-byte file can ask for gigabytes: a byte string's length, a
memo index), hashes whatever the file makes a key (a few hundred bytes of nested tuples take exponential time) and
calls the classes it allows with arguments the file chooses. This module runs the program itself instead, one
instruction at a time as :func:`pickletools.genops` decodes them, with a short list of instructions that build
only what a Transformer-XL vocabulary holds:

- ``None``, booleans, integers, floats and strings;
- lists, tuples and dicts (``OrderedDict`` and ``Counter`` too), whose keys must be strings;
- the two classes ``collections.OrderedDict`` and ``collections.Counter``, called with no argument or (Counter) with
  one dict, which is how pickle writes them.

Anything else (another name, an object's state, stored tensors, byte strings, sets) ends the reading with one
sentence naming it, before it is built. Nothing is looked up or called outside this module, and the work and memory
are bounded by the input: every instruction builds at most one value from what it reads or what the stack already
holds (a declared length must be in the file, since the arguments are read before anything is built), a dict
copied into a Counter counts against the bytes read, every key is a string (whose hash Python computes once), and
at most :data:`MAX_CONTAINERS` lists, tuples and dicts and :data:`MAX_MEMO` memo entries are made. Measured with
``tracemalloc``, the costliest files take about 20 bytes of memory per byte (a dict of three-letter keys, a run of
``None``), plus at most about 160 MB for a full memo.
"""

from __future__ import annotations

import io
import pickletools
from collections import Counter, OrderedDict
from typing import Any

CLASSES = {"collections OrderedDict": OrderedDict, "collections Counter": Counter}
MAX_CONTAINERS = 4096  # a vocabulary holds a few dozen lists and dicts (of many words each)
MAX_MEMO = 2**21  # entries the memo may hold: pickle memoizes each string once (WikiText-103's: 267,735 words)
ATOMS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
NUMBERS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"}
STRINGS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}
IGNORED = {"PROTO", "FRAME"}  # the protocol's number, and framing (a hint for buffered reading)


class PickleError(ValueError):
    """The pickle holds something other than plain data, or is not a complete pickle; the message says which, and
    ``name`` is the refused name (``module.attribute``) where that is what it holds."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


def load(stream: io.BytesIO, at: str) -> Any:
    """The value of the pickle that starts at ``stream``'s position (which is left after its STOP). ``at`` names the
    file in messages."""
    stack: list[Any] = []
    marks: list[int] = []  # where each open MARK's items start on the stack
    memo: dict[int, Any] = {}
    built = copied = 0

    def refuse(what: str, pos: int, name: str | None = None) -> PickleError:
        return PickleError(f"{at} holds {what} (at byte {pos}); a vocabulary holds only lists, dicts, strings and "
                           "numbers, OrderedDict and Counter, so it is refused without building anything", name)

    def container(value: Any, pos: int) -> Any:
        nonlocal built
        built += 1
        if built > MAX_CONTAINERS:
            raise refuse(f"more than {MAX_CONTAINERS} lists, tuples and dicts", pos)
        return value

    def marked(pos: int) -> list[Any]:
        if not marks:
            raise PickleError(f"{at} is not a readable pickle (an instruction at byte {pos} needs a MARK)")
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    def pop(pos: int, n: int = 1) -> list[Any]:
        if len(stack) - (marks[-1] if marks else 0) < n:
            raise PickleError(f"{at} is not a readable pickle (the instruction at byte {pos} finds too few values)")
        items = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return items

    def set_items(target: Any, items: list[Any], pos: int) -> None:
        if not isinstance(target, dict) or len(items) % 2:
            raise PickleError(f"{at} is not a readable pickle (items set at byte {pos} on something not a dict)")
        for key, value in zip(items[::2], items[1::2], strict=True):
            if type(key) is not str:
                raise refuse(f"a dict key of type {type(key).__name__}", pos)
            target[key] = value

    try:
        for op, arg, pos in pickletools.genops(stream):
            name = op.name
            if name in IGNORED:
                continue
            if name == "STOP":
                if len(stack) != 1 or marks:
                    raise PickleError(f"{at} is not a readable pickle (it ends at byte {pos} with an unfinished "
                                      "value)")
                return stack[0]
            if name in ATOMS:
                stack.append(ATOMS[name])
            elif name in NUMBERS or name in STRINGS:
                stack.append(arg)
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                (top,) = pop(pos)
                memo[len(memo) if name == "MEMOIZE" else arg] = top
                if len(memo) > MAX_MEMO:
                    raise refuse(f"more than {MAX_MEMO} memo entries", pos)
                stack.append(top)
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise PickleError(f"{at} is not a readable pickle (byte {pos} fetches memo entry {arg}, never "
                                      "stored)")
                stack.append(memo[arg])
            elif name == "EMPTY_LIST":
                stack.append(container([], pos))
            elif name == "EMPTY_DICT":
                stack.append(container({}, pos))
            elif name == "EMPTY_TUPLE":
                stack.append(container((), pos))
            elif name == "LIST":
                stack.append(container(marked(pos), pos))
            elif name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
                items = marked(pos) if name == "TUPLE" else pop(pos, int(name[-1]))
                stack.append(container(tuple(items), pos))
            elif name == "DICT":
                target = container({}, pos)
                set_items(target, marked(pos), pos)
                stack.append(target)
            elif name in ("APPEND", "APPENDS"):
                items = pop(pos) if name == "APPEND" else marked(pos)
                (target,) = pop(pos)
                if type(target) is not list:
                    raise PickleError(f"{at} is not a readable pickle (byte {pos} appends to something not a list)")
                target.extend(items)
                stack.append(target)
            elif name in ("SETITEM", "SETITEMS"):
                items = pop(pos, 2) if name == "SETITEM" else marked(pos)
                (target,) = pop(pos)
                set_items(target, items, pos)
                stack.append(target)
            elif name in ("GLOBAL", "STACK_GLOBAL"):
                if name == "STACK_GLOBAL":
                    module, attr = pop(pos, 2)
                    if type(module) is not str or type(attr) is not str:
                        raise refuse("a name made of values other than strings", pos)
                    arg = f"{module} {attr}"
                if arg not in CLASSES:
                    raise refuse(f"the name {arg.replace(' ', '.')}", pos, arg.replace(" ", "."))
                stack.append(CLASSES[arg])
            elif name == "REDUCE":
                cls, args = pop(pos, 2)
                if cls not in CLASSES.values() or type(args) is not tuple:
                    raise refuse("a call of something other than OrderedDict or Counter", pos)
                if args == ():
                    stack.append(container(cls(), pos))
                elif cls is Counter and len(args) == 1 and isinstance(args[0], dict):
                    copied += len(args[0])
                    if copied > pos:  # each entry cost the file at least a byte; a dict copied again and again
                        raise refuse("Counters copied from one dict more often than the file's size allows", pos)
                    stack.append(container(Counter(args[0]), pos))
                else:
                    raise refuse(f"{cls.__name__} called with {len(args)} arguments", pos)
            else:
                raise refuse(f"the pickle instruction {name}", pos)
    except PickleError:
        raise
    except Exception as err:  # pickletools raises ValueError and others for a truncated or garbled stream
        reason = str(err) if len(str(err)) <= 200 else f"{str(err)[:200]}..."  # it may quote a long line
        raise PickleError(f"{at} is not a readable pickle ({reason})") from None
