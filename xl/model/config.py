"""The model's settings (:class:`XLConfig`) and their rules (:func:`check_model`; the memory context's are in
:mod:`xl.model.memory_settings`), checked when a config is made; imports nothing from :mod:`xl.model.transformer`,
so config code can use them without loading the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from xl.model import memory_settings
from xl.model.memory_settings import MemoryConfig, MemoryContext
from xl.settings.bounds import Bound, between, bound_of, is_int, is_number, optional, setting

if TYPE_CHECKING:
    import torch


SIZE = Bound("a positive integer", lambda v: is_int(v) and v >= 1)
UNIT = between(0, 1, words="")
STD = Bound("a positive number", lambda v: is_number(v) and v > 0)
FLAGS = Bound("true, false or a list of them, one per cluster", lambda v: isinstance(v, bool) or (
    (OmegaConf.is_list(v) or isinstance(v, (list, tuple))) and all(isinstance(t, bool) for t in v)))


@dataclass
class XLConfig:
    """Model shape and the memory/attention context used when no override is given. Each shape field is declared
    here once, with its bound and help; the ``model`` group's schema (:class:`xl.config.schema.ModelSchema`) is made
    from these fields, and :func:`check_model` checks them."""

    vocab_size: int = setting(256, bound=SIZE, help="vocabulary size (fitted to the data by the training command)")
    n_layer: int = setting(4, bound=SIZE, help="layers")
    n_head: int = setting(4, bound=SIZE, help="attention heads per layer")
    d_model: int = setting(256, bound=SIZE, help="width; even (sinusoidal positions take pairs)")
    d_head: int = setting(64, bound=SIZE, help="width of one head")
    d_inner: int = setting(1024, bound=SIZE, help="feed-forward width")
    dropout: float = setting(0.1, bound=UNIT, help="dropout of every layer's output")
    dropatt: float = setting(0.0, bound=UNIT, help="dropout of the attention probabilities")
    init_std: float = setting(0.02, bound=STD, help="standard deviation of the normal initial weights of the linear "
                                                    "layers, embeddings and position biases (Transformer-XL's 0.02); "
                                                    "narrow models learn to bind facts with wider ones, such as 0.07 "
                                                    "at width 64 (docs/babilong.md)")
    # The memory's context (declared with its bounds and help by MemoryContext, whose defaults these are).
    mem_len: int = MemoryContext.mem_len
    clamp_len: int = MemoryContext.clamp_len
    same_length: bool = MemoryContext.same_length
    pre_lnorm: bool = setting(False, help="layer norm before each sub-layer instead of after")
    tie_weights: bool = setting(True, help="the output word vectors are the input embedding")
    # Adaptive input and softmax (word-level vocabularies, xl.model.adaptive): cluster boundaries in the
    # frequency-sorted vocabulary; () is one plain softmax. Cluster i is d_embed // div_val**i wide (d_embed None:
    # d_model), projected to d_model where its width differs, or always with proj_all (the original Transformer-XL's
    # layout).
    cutoffs: tuple[int, ...] = ()
    div_val: int = setting(1, bound=SIZE, help="cluster i is d_embed // div_val**i wide")
    # With tie_weights, which projections the softmax shares with the embedding: all or none (a bool), or one flag
    # per cluster (the published Transformer-XL models: the first cluster's untied, the others tied).
    tie_projs: bool | tuple[bool, ...] = setting(True, bound=FLAGS, help="with tie_weights, the softmax shares the "
                                                                          "input projections: all, or of the clusters "
                                                                          "a list marks")
    d_embed: int | None = setting(None, bound=optional(SIZE), help="the adaptive input's first cluster's width; "
                                                                    "null: d_model")
    proj_all: bool = setting(False, help="every cluster projected to d_model, also one already that wide (the "
                                         "original Transformer-XL's layout)")
    # Storage precision of the memory cache. "float32" never rounds: the cache keeps the layer states' own
    # dtype, float32 under 32-true and the mixed precisions (a rounded cache feeds rounding error into every
    # later segment). "bfloat16"/"float16" round the cached states, halving the cache. (bf16-true computes bf16
    # states.)
    mem_dtype: str = MemoryContext.mem_dtype
    # The memory variant and its own settings (xl.model.memory_settings): the plain cache by default. A mapping (a
    # checkpoint's record, with its _target_) is read into the variant's config.
    memory: MemoryConfig = field(default_factory=lambda: memory_settings.variant(None))

    def __post_init__(self) -> None:
        self.cutoffs = tuple(self.cutoffs)
        if isinstance(self.tie_projs, (list, tuple)):
            self.tie_projs = tuple(self.tie_projs)
        if not isinstance(self.memory, MemoryConfig):
            self.memory = memory_settings.variant(self.memory)
        check_model(self)

    def memory_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype the cache is stored in when the layer states are ``compute_dtype``."""
        import torch  # (here: the config, and the config package with it, import without torch)

        return compute_dtype if self.mem_dtype == "float32" else getattr(torch, self.mem_dtype)

    def context(self, **module: Any) -> MemoryContext:
        """The model's memory context (unchecked: a config checks it when made), with the fields the training module
        holds (``doc_boundaries``, ``grad_segments``) where given."""
        return MemoryContext(**{name: getattr(self, name) for name in CONTEXT_FIELDS}, **module)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "memory": self.memory.to_dict()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> XLConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown XLConfig field(s) {unknown}; valid fields are {sorted(known)}")
        return cls(**values)


#: The memory context's fields that the model holds (the others, doc_boundaries and grad_segments, are the
#: Lightning module's).
CONTEXT_FIELDS = tuple(f.name for f in fields(XLConfig) if f.name in {c.name for c in fields(MemoryContext)})


def xlconfig_key(name: str) -> str:
    return f"XLConfig.{name}"


def check_model(c: XLConfig, key: Callable[[str], str] = xlconfig_key) -> None:
    """Every rule of an :class:`XLConfig`: each field's range, the shape's rules
    between fields and the context's; ``key`` names a field in errors."""
    for f in fields(XLConfig):
        bound = bound_of(f)
        if bound is not None and not bound.allows(getattr(c, f.name)):
            raise ValueError(f"{key(f.name)} must be {bound.says}, got {getattr(c, f.name)!r}")
    check_shape(c, key)
    c.context().check(c.memory, key)


def check_shape(c: Any, key: Callable[[str], str] = xlconfig_key, fitted: bool = False) -> None:
    """The rules between the shape's fields (a composed config's schema bounds each field alone); ``fitted``: the
    cutoffs are fitted to the data later, and the rules that count clusters wait for them."""
    if c.d_model % 2:
        raise ValueError(f"{key('d_model')} must be even for sinusoidal positions, got {c.d_model}")
    cutoffs = list(c.cutoffs)
    if any(not is_int(x) for x in cutoffs) or cutoffs != sorted(set(cutoffs)) or (
            cutoffs and not 0 < cutoffs[0] <= cutoffs[-1] < c.vocab_size):
        raise ValueError(f"{key('cutoffs')} must be strictly increasing integers between 0 and vocab_size "
                         f"({c.vocab_size}), exclusive, got {cutoffs}")
    check_adaptive(c, None if fitted else cutoffs, key)


def check_adaptive(c: Any, cutoffs: list[int] | None, key: Callable[[str], str] = xlconfig_key) -> None:
    """The adaptive input/softmax's widths, projections and tying (:mod:`xl.model.adaptive`); ``cutoffs`` None: not
    known yet (fitted to the data later)."""
    d_embed = c.d_model if c.d_embed is None else c.d_embed
    if not is_int(d_embed) or d_embed < 1:
        raise ValueError(f"{key('d_embed')} must be null (d_model) or a positive integer, got {c.d_embed!r}")
    tie = c.tie_projs
    if not isinstance(tie, bool) and (not isinstance(tie, (list, tuple)) or not all(isinstance(t, bool) for t in tie)
                                      or (cutoffs is not None and len(tie) != len(cutoffs) + 1)):
        clusters = "one per cluster" if cutoffs is None else f"{len(cutoffs) + 1}, one per cluster"
        raise ValueError(f"{key('tie_projs')} must be true, false or a list of them ({clusters}), got {tie!r}")
    if cutoffs is None:
        return
    if not cutoffs and (d_embed != c.d_model or c.proj_all):
        what = f"{key('d_embed')}={d_embed}" if d_embed != c.d_model else f"{key('proj_all')}=true"
        raise ValueError(f"{what} needs an adaptive input and softmax; set {key('cutoffs')} or leave it out")
    if d_embed // c.div_val ** len(cutoffs) < 1:
        raise ValueError(f"{key('div_val')}={c.div_val} leaves the last of {len(cutoffs) + 1} clusters with width 0 "
                         f"({'d_model' if c.d_embed is None else 'd_embed'} {d_embed}); lower div_val or use fewer "
                         "cutoffs")
