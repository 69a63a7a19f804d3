"""The model's settings (:class:`XLConfig`), checked by :mod:`xl.config.rules` when made; imports nothing from
:mod:`xl.model.transformer`, so config code can use them without loading the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from xl.config.rules import check_model
from xl.memory import settings
from xl.memory.settings import MemoryConfig

if TYPE_CHECKING:
    import torch


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
    # Adaptive input and softmax (word-level vocabularies, xl.model.adaptive): cluster boundaries in the
    # frequency-sorted vocabulary; () is one plain softmax. Cluster i is d_embed // div_val**i wide (d_embed None:
    # d_model), projected to d_model where its width differs, or always with proj_all (the original Transformer-XL's
    # layout).
    cutoffs: tuple[int, ...] = ()
    div_val: int = 1
    # With tie_weights, which projections the softmax shares with the embedding: all or none (a bool), or one flag
    # per cluster (the published Transformer-XL models: the first cluster's untied, the others tied).
    tie_projs: bool | tuple[bool, ...] = True
    d_embed: int | None = None
    proj_all: bool = False
    # Storage precision of the memory cache. "float32" never rounds: the cache keeps the layer states' own
    # dtype, float32 under 32-true and the mixed precisions (a rounded cache feeds rounding error into every
    # later segment). "bfloat16"/"float16" round the cached states, halving the cache. (bf16-true computes bf16
    # states.)
    mem_dtype: str = "float32"
    # The memory variant and its own settings (xl.memory.settings): the plain cache by default. A mapping (a
    # checkpoint's record, with its _target_) is read into the variant's config.
    memory: MemoryConfig = field(default_factory=lambda: settings.from_dict(None))

    def __post_init__(self) -> None:
        self.cutoffs = tuple(self.cutoffs)
        if isinstance(self.tie_projs, (list, tuple)):
            self.tie_projs = tuple(self.tie_projs)
        if not isinstance(self.memory, MemoryConfig):
            self.memory = settings.from_dict(self.memory)
        check_model(self)  # the rules, with every other config rule, live in xl.config.rules

    def memory_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype the cache is stored in when the layer states are ``compute_dtype``."""
        import torch  # (here: the config, and the config package with it, import without torch)

        return compute_dtype if self.mem_dtype == "float32" else getattr(torch, self.mem_dtype)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "memory": self.memory.to_dict()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> XLConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown XLConfig field(s) {unknown}; valid fields are {sorted(known)}")
        return cls(**values)

