"""The rule by which states leave a memory: one function, shared by the forward pass (:mod:`xl.memory`) and the
one-token decoder (:mod:`xl.model.decoding`), so that both keep the same memory whatever the segment lengths."""

from __future__ import annotations


def leaving(held: int, mem_len: int, rate: int = 1) -> int:
    """How many of ``held`` states (oldest first) leave a memory of ``mem_len`` states: those beyond ``mem_len``, in
    whole groups of ``rate``; up to ``rate - 1`` more wait in the memory until their group is complete."""
    return max(0, held - mem_len) // rate * rate
