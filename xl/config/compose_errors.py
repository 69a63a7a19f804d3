"""One sentence for a config that Hydra or OmegaConf could not compose (:func:`describe_error`).

Composition stops at a misspelt key, a value of the wrong type, an option that does not exist or a command line that
cannot be read; Hydra reports it over several lines. The sentence is built from the error's own fields where it has
them (OmegaConf's ``full_key``, ``object_type`` and ``value``, Hydra's ``options``), and the expected type from the
schema. Hydra's override parser, its group-option lookup and the name of the config file an error comes from are
known only from the message text, so those few are read from it with regular expressions.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, get_args, get_type_hints

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    ConfigTypeError,
    OmegaConfBaseException,
    ValidationError,
)

from xl.settings.bounds import TYPE_WORDS, describe_type


def expected_type(schema: Any, key: str) -> str | None:
    """What the schema's field for ``key`` takes, in words (None: not a schema field)."""
    name = key.rsplit(".", 1)[-1].split("[")[0]
    if not dataclasses.is_dataclass(schema) or name not in {f.name for f in dataclasses.fields(schema)}:
        return None
    return describe_type(get_type_hints(schema)[name])


def memory_options_with(name: str) -> list[str]:
    """The options of the ``memory`` group (``conf/memory/*.yaml``) whose file sets ``name``."""
    folder = Path(__file__).resolve().parents[2] / "conf" / "memory"
    return sorted(p.stem for p in folder.glob("*.yaml")
                  if re.search(rf"^{re.escape(name)}:", p.read_text(encoding="utf-8"), re.M))


def settings_of(schema: Any) -> list[str]:
    if not dataclasses.is_dataclass(schema):
        return []
    return [f.name for f in dataclasses.fields(schema) if not f.name.startswith("_")]


def describe_error(err: BaseException) -> str:
    """One sentence for a Hydra/OmegaConf composition error (the full key, and the type or the options)."""
    text = "\n".join(str(e) for e in (err, err.__cause__) if e is not None)
    # Hydra's override errors carry no fields: the override they reject is known from the message only.
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if ambiguous:
        key, value = ambiguous.groups()
        return (f"{key}={value} gives several values: add -m to run one job for each, "
                f"or write {key}=[{value}] for a list")
    if isinstance(err, OverrideParseException):
        return f"the command line cannot be read ({text.splitlines()[0]}); see Hydra's override grammar"
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:  # a group option that does not exist
        group, _, option = err.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option of the {group} group" + (
            f"; choose one of {', '.join(err.options)}" if err.options else "")
    # OmegaConf's error, with its fields: Hydra raises it as the cause, or (a config file's) as the context
    cause = next((e for e in (err.__cause__, err.__context__, err) if isinstance(e, OmegaConfBaseException)), err)
    key = getattr(cause, "full_key", None) or ""
    schema = getattr(cause, "object_type", None)
    source = re.search(r"In '([^']+)'", str(err))  # Hydra names the config file in its message only
    where = f" (in conf/{source.group(1)}.yaml)" if source else ""
    if key and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        node = getattr(cause, "parent_node", None)
        if schema is dict and key.startswith("memory.") and node is not None:  # typed by its variant after composing
            schema = None
            options = [name for name in node if not str(name).startswith("_")]
        else:
            options = settings_of(schema)
        if schema is dict:  # a plain mapping (a field typed Any, such as data.tokenizer_kwargs) takes new keys, with +
            added = re.search(r"use \+(\S+)", text)  # the override as given, from Hydra's message
            return (f"{key} is not in the config yet; add it with a + in front, "
                    f"+{added.group(1) if added else key + '=...'} (Hydra's prefix for a new key)")
        parent, _, name = key.rpartition(".")
        owners = memory_options_with(name) if parent == "memory" else []
        if owners and getattr(schema, "__name__", "") == "EvalContextSchema":  # python -m xl.evaluate
            added = re.search(r"use \+(\S+)", text)  # the override as given, from Hydra's message
            given = added.group(1) if added else key + "=..."
            return (f"{key} is a setting of the {' and '.join(owners)} memory, not of every memory; evaluation takes "
                    f"it with a + in front, +{given}, for a checkpoint of that memory")
        if owners:
            return (f"{key} is not a setting of this memory but of {' and '.join(f'memory={o}' for o in owners)}; "
                    f"add {' or '.join(f'memory={o}' for o in owners)} to the command line")
        close = difflib.get_close_matches(name, options, n=1)
        hint = (f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else
                f"; {parent or 'the top level'} has {', '.join(options)}" if options else "")
        return f"{key} is not a setting{where}{hint}"
    if key and isinstance(cause, ConfigTypeError) and "deletion" in str(cause):
        return f"{key} cannot be removed; set it to another value"
    if key and isinstance(cause, ValidationError):
        got = "null" if cause.value is None else str(cause.value)
        item = re.fullmatch(r"(.+)\[(\d+)\]", key)
        element = [a for a in get_args(getattr(cause, "ref_type", None)) for a in (get_args(a) or [a])
                   if a in TYPE_WORDS]
        if item and schema is list and element:  # one element of a typed list
            return (f"{item.group(1)} must be a list of {TYPE_WORDS[element[0]][1]}, "
                    f"got {got!r} at position {item.group(2)}{where}")
        expected = expected_type(schema, key) or "of another type"
        return f"{key} must be {expected}, got {got!r}{where}"
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return first.rstrip(".")
