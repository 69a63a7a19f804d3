"""Model configs with a memory variant, written as the tests' parameters are: ``xl_config(cmem_len=4, cmem_rate=2)``
is an XLConfig whose memory is the compressive one, ``xl_config(num_tokens=2, seg_len=8)`` memory tokens."""

from __future__ import annotations

from typing import Any

from xl.memory.compressive import CompressiveConfig
from xl.memory.tokens import TokensConfig
from xl.model.config import XLConfig

COMPRESSIVE = ("cmem_len", "cmem_rate", "cmem_fn")
TOKENS = {"num_tokens": "num_tokens", "tokens_seg_len": "seg_len", "seg_len": "seg_len"}


def xl_config(**values: Any) -> XLConfig:
    compressive = {k: values.pop(k) for k in COMPRESSIVE if k in values}
    tokens = {TOKENS[k]: values.pop(k) for k in list(TOKENS) if k in values}
    if compressive and tokens:
        raise ValueError("give either a compressive memory's settings or memory tokens'")
    if compressive:
        values["memory"] = CompressiveConfig(**compressive)
    elif tokens:
        values["memory"] = TokensConfig(**tokens)
    return XLConfig(**values)
