"""The model's settings (:class:`XLConfig`) and the checks on them; imports nothing from :mod:`xl.model`, so
config code can use them without loading the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from xl.compressive import COMPRESSION_FNS

MEM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class XLConfig:
    """Model shape and the memory/attention context used when no override is given."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_head: int = 64
    d_inner: int = 1024
    dropout: float = 0.1
    dropatt: float = 0.0
    mem_len: int = 128
    clamp_len: int = -1  # -1: no clamping; else distances beyond clamp_len share one embedding
    same_length: bool = False  # every query attends over exactly mem_len keys (itself included)
    pre_lnorm: bool = False
    tie_weights: bool = True  # output word vectors = input embedding
    # Adaptive input and softmax (word-level vocabularies): cluster boundaries in the frequency-sorted
    # vocabulary; () is one plain softmax. Cluster i is d_model // div_val**i wide.
    cutoffs: tuple[int, ...] = ()
    div_val: int = 1
    tie_projs: bool = True  # with tie_weights, the softmax also shares the embedding's projections
    # Storage precision of the memory cache. "float32" never rounds: the cache keeps the layer states' own
    # dtype, float32 under 32-true and the mixed precisions (a rounded cache feeds rounding error into every
    # later segment). "bfloat16"/"float16" round the cached states, halving the cache. (bf16-true computes bf16
    # states.)
    mem_dtype: str = "float32"
    # Compressive memory (Rae et al., 2019; :mod:`xl.compressive`): per layer, the states evicted from the memory
    # are compressed cmem_rate to 1 (cmem_fn: mean pooling, or a learned convolution) into a second memory of
    # cmem_len slots that sits before the memory. 0: no compressed memory (plain Transformer-XL).
    cmem_len: int = 0
    cmem_rate: int = 3
    cmem_fn: str = "conv"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "d_head", "d_inner"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"XLConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % 2:
            raise ValueError(f"XLConfig.d_model must be even for sinusoidal positions, got {self.d_model}")
        for name in ("dropout", "dropatt"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"XLConfig.{name} must be in [0, 1), got {value!r}")
        check_context(self.mem_len, self.clamp_len, self.same_length)
        self.cutoffs = tuple(self.cutoffs)
        if any(not isinstance(c, int) or isinstance(c, bool) for c in self.cutoffs) or list(self.cutoffs) != sorted(
            set(self.cutoffs)
        ) or (self.cutoffs and not 0 < self.cutoffs[0] <= self.cutoffs[-1] < self.vocab_size):
            raise ValueError(
                f"XLConfig.cutoffs must be strictly increasing integers between 0 and vocab_size "
                f"({self.vocab_size}), exclusive, got {list(self.cutoffs)}"
            )
        if not isinstance(self.div_val, int) or isinstance(self.div_val, bool) or self.div_val < 1:
            raise ValueError(f"XLConfig.div_val must be a positive integer, got {self.div_val!r}")
        if self.d_model // self.div_val ** len(self.cutoffs) < 1:
            raise ValueError(
                f"XLConfig.div_val={self.div_val} leaves the last of {len(self.cutoffs) + 1} clusters with width 0 "
                f"(d_model {self.d_model}); lower div_val or use fewer cutoffs"
            )
        if self.mem_dtype not in MEM_DTYPES:
            raise ValueError(f"XLConfig.mem_dtype must be one of {sorted(MEM_DTYPES)}, got {self.mem_dtype!r}")
        check_compressive(self.cmem_len, self.cmem_rate, self.cmem_fn, self.same_length)

    def memory_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype the cache is stored in when the layer states are ``compute_dtype``."""
        return compute_dtype if self.mem_dtype == "float32" else MEM_DTYPES[self.mem_dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> XLConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown XLConfig field(s) {unknown}; valid fields are {sorted(known)}")
        return cls(**values)


def check_context(mem_len: int, clamp_len: int, same_length: bool) -> None:
    """Validate the memory/attention context (also used for evaluation overrides)."""
    if not isinstance(mem_len, int) or mem_len < 0:
        raise ValueError(f"mem_len must be an integer >= 0, got {mem_len!r}")
    if not isinstance(clamp_len, int) or clamp_len < -1 or clamp_len == 0:
        raise ValueError(f"clamp_len must be -1 (off) or a positive integer, got {clamp_len!r}")
    if same_length and mem_len == 0:
        raise ValueError("same_length=True needs mem_len > 0: the attention window is mem_len keys wide")


def check_compressive(cmem_len: int, cmem_rate: int, cmem_fn: str, same_length: bool) -> None:
    """Validate the compressed memory's settings (also against an evaluation's same_length)."""
    if not isinstance(cmem_len, int) or isinstance(cmem_len, bool) or cmem_len < 0:
        raise ValueError(f"XLConfig.cmem_len must be an integer >= 0, got {cmem_len!r}")
    if not isinstance(cmem_rate, int) or isinstance(cmem_rate, bool) or cmem_rate < 1:
        raise ValueError(f"XLConfig.cmem_rate must be an integer >= 1, got {cmem_rate!r}")
    if cmem_fn not in COMPRESSION_FNS:
        raise ValueError(f"XLConfig.cmem_fn must be one of {', '.join(COMPRESSION_FNS)}, got {cmem_fn!r}")
    if cmem_len and same_length:
        raise ValueError("same_length=True hides the compressed memory (its window is mem_len keys wide); "
                         "set same_length=false with XLConfig.cmem_len > 0")
