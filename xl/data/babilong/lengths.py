"""Sample lengths as a user writes them: ``0``, ``1500``, ``1k``, ``64k``, ``1M``.

``k`` is 1,000 and ``M`` 1,000,000, as BABILong names its splits (its ``create_tasks.py`` makes the ``1k`` split from
``message_lengths = [0, 1000, 2000, 4000, ...]``). A length counts the tokens of a sample's context (its facts and
background); the question and the answer follow it.
"""

from __future__ import annotations

import re
from typing import Any

UNITS = {"": 1, "k": 1000, "K": 1000, "m": 1_000_000, "M": 1_000_000}
PATTERN = re.compile(r"(\d+(?:\.\d+)?)([kKmM]?)")
WORDS = "a number of tokens >= 0 such as 1500, or with k (1,000) or M (1,000,000): 1k, 64k, 1M"


def parse_length(value: Any) -> int:
    """The number of tokens ``value`` names; ValueError in one sentence for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"a length must be {WORDS}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a length must be {WORDS}, got {value!r}")
        return value
    match = PATTERN.fullmatch(str(value).strip())
    if match is None:
        raise ValueError(f"a length must be {WORDS}, got {value!r}")
    tokens = float(match.group(1)) * UNITS[match.group(2)]
    if tokens != int(tokens):
        raise ValueError(f"a length must be a whole number of tokens, got {value!r} ({tokens:g})")
    return int(tokens)


def is_length(value: Any) -> bool:
    try:
        parse_length(value)
    except ValueError:
        return False
    return True


def length_name(value: Any) -> str:
    """The label of a length for tables and plots: as the user wrote it (``1k``), a number as digits."""
    return str(value).strip()
