"""The recurrent memories: one interface (:class:`Memory`, :mod:`xl.memory.base`), one module per variant, the store.

- :mod:`xl.memory.cache`: the Transformer-XL memory (``cmem_len = 0``);
- :mod:`xl.memory.compressive`: the compressive memory (Rae et al., 2019; ``cmem_len > 0``);
- :mod:`xl.memory.tokens`: memory tokens over the cache (Bulatov et al., 2022; ``num_tokens > 0``);
- :mod:`xl.memory.store`: one memory per stage of a run, and its place in checkpoints.

:func:`memory_for` picks the variant a model config asks for. Adding a variant is one module with a :class:`Memory`
subclass, one entry in :data:`VARIANTS`, and the config setting that selects it (docs/memories.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xl.memory.base import KV, Context, Memory, Update
from xl.memory.cache import CacheMemory, update_memory, update_memory_attached
from xl.memory.compressive import CompressiveMemory, split_memory
from xl.memory.eviction import leaving
from xl.memory.store import STAGES, MemoryStore, nbytes, packed_size
from xl.memory.tokens import TokenMemory

if TYPE_CHECKING:
    from xl.model.config import XLConfig

VARIANTS: dict[str, type[Memory]] = {"cache": CacheMemory, "compressive": CompressiveMemory, "tokens": TokenMemory}


def variant_name(config: XLConfig) -> str:
    """The memory variant a model config selects."""
    return "tokens" if config.num_tokens else "compressive" if config.cmem_len else "cache"


def memory_for(config: XLConfig) -> Memory:
    """The memory a model of this config attends over."""
    return VARIANTS[variant_name(config)](config)


__all__ = ["KV", "STAGES", "VARIANTS", "CacheMemory", "CompressiveMemory", "Context", "Memory", "MemoryStore",
           "TokenMemory", "Update", "leaving", "memory_for", "nbytes", "packed_size", "split_memory", "update_memory",
           "update_memory_attached", "variant_name"]
