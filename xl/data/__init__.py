"""Corpus → token cache → ordered, never-shuffled Transformer-XL segments.

``sources`` says where text comes from, ``tokenizers`` turns it into ids, ``cache`` keeps the ids on disk,
``stream`` cuts them into per-rank rows and segments, and ``datamodule`` wires it all into Lightning.

The names below are imported when first used, so that a command that only composes a config or reads a tokenizer
does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module that defines it.
EXPORTS = {"DataError": "xl.data.errors", "RecallSource": "xl.data.recall", "SegmentDataModule": "xl.data.datamodule",
           "SegmentLoader": "xl.data.stream", "make_tokenizer": "xl.data.tokenizers", "split_streams": "xl.data.stream"}

__all__ = [*EXPORTS, "sources"]


def __getattr__(name: str) -> Any:
    if name == "sources":
        return importlib.import_module("xl.data.sources")
    if name in EXPORTS:
        return getattr(importlib.import_module(EXPORTS[name]), name)
    raise AttributeError(f"module 'xl.data' has no attribute {name!r}")
