"""A memory's settings: the context every memory shares (:class:`MemoryContext`) and each variant's own
(:class:`MemoryConfig`, subclassed beside the variant's code).

Each field of the context is declared once, in :class:`MemoryContext`, with its bound and help. The settings that set
or override it are made from those fields: the ``memory`` group's schema (:data:`MemorySettings`, with an ``eval_X``
for each field evaluation may change, :data:`EVALUATED`), the ``memory`` node of the ``xl.evaluate`` command and the
decoder's context of the ``xl.generate`` and ``xl.babilong`` commands (:func:`overrides`). The model's
:class:`~xl.model.config.XLConfig` takes the context's defaults. An instance is one resolved context, training's or
evaluation's (:meth:`MemoryContext.evaluated`), and :meth:`MemoryContext.check` holds the context's rules.

The ``memory`` group of ``conf/`` is one flat node: the shared context (``mem_len``, ``eval_mem_len``, ...,
``grad_segments``), ``_target_`` naming the variant's config class, and that class's own fields::

    _target_: mypackage.mymemory.MyMemoryConfig
    mem_len: 64
    my_setting: 4

:func:`typed` types such a node by a dataclass of the shared fields and the variant's, whose bounds
(:func:`xl.settings.bounds.setting`) :mod:`xl.config.rules` checks like any schema's. :func:`variant` makes the
variant's config from the node, or from a checkpoint's record of it: the model keeps it as ``XLConfig.memory``, and a
checkpoint records it with its ``_target_`` (:meth:`MemoryConfig.to_dict`), so a run is read back with the variant it
was trained with.

A variant outside this package is used the same way: a dataclass subclassing :class:`MemoryConfig` whose
:meth:`~MemoryConfig.memory` returns its :class:`xl.model.memory.Memory`, and a YAML file naming it in a folder on
Hydra's search path (docs/memories.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from xl.settings.bounds import Bound, at_least, bound_of, check_fields, copied, is_int, nullable, one_of, setting

if TYPE_CHECKING:
    from xl.model.config import XLConfig
    from xl.model.memory import Memory

MEM_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the memory's storage precisions (XLConfig.mem_dtype)
DOC_BOUNDARIES = ("reset", "ignore")
DEFAULT_TARGET = "xl.memory.cache.CacheConfig"
COUNT = at_least(0)
CLAMP = Bound("-1 (no clamping) or a positive integer", lambda v: v == -1 or (is_int(v) and v > 0))


@dataclass(frozen=True)
class MemoryContext:
    """The context every memory shares: what a segment attends over, how the memory is stored, where documents and
    gradients stop. Each field is declared here once, with its bound and help; the ``memory`` group's schema
    (:data:`MemorySettings`) and the overrides of the ``xl.evaluate`` and ``xl.generate`` commands are made from
    these fields (:func:`override`).

    An instance is one resolved context: training's (:meth:`xl.model.config.XLConfig.context`, or :meth:`of` a
    composed ``memory`` node) and evaluation's, a second instance made from it with the evaluation's overrides
    (:meth:`evaluated`). :meth:`check` holds the context's rules; each context is checked where it is made."""

    mem_len: int = setting(128, bound=COUNT, help="positions of memory per layer; 0: none")
    clamp_len: int = setting(-1, bound=CLAMP, help="-1: off; else distances beyond it share one embedding")
    same_length: bool = setting(False, help="every query attends over exactly mem_len keys")
    mem_dtype: str = setting("float32", bound=one_of(*sorted(MEM_DTYPE_NAMES)),
                             help="the memory's storage: float32 (never rounded), bfloat16 or float16 (half the bytes)")
    doc_boundaries: str = setting("reset", bound=one_of(*DOC_BOUNDARIES, words="reset or ignore"),
                                  help="reset: a token sees only its own document; ignore: one endless text per row")
    grad_segments: int = setting(1, bound=at_least(1), help="k: gradients cross segments inside windows of k "
                                                             "(1: Transformer-XL's stop-gradient)")

    @classmethod
    def of(cls, *layers: Any) -> MemoryContext:
        """The context whose each field comes from the first of ``layers`` that sets it (not None), else its default.
        A layer is a mapping or a config (a ``memory`` node, an :class:`~xl.model.config.XLConfig`, a context)."""
        values = {}
        for name in CONTEXT_NAMES:
            for layer in layers:
                value = _get(layer, name)
                if value is not None:
                    values[name] = value
                    break
        return cls(**values)

    def evaluated(self, overrides: Any) -> MemoryContext:
        """The context an evaluation uses: each field of :data:`EVALUATED` from ``overrides`` where it sets it (a
        mapping or config; :func:`eval_overrides` reads a training config's ``memory.eval_X``), the others this
        context's; evaluation keeps no gradient across segments (``grad_segments`` 1)."""
        return MemoryContext.of({name: _get(overrides, name) for name in EVALUATED}, {"grad_segments": 1}, self)

    def attention(self) -> dict[str, Any]:
        """What the forward pass and the decoder take of it: ``mem_len``, ``clamp_len``, ``same_length``."""
        return {name: getattr(self, name) for name in EVALUATED}

    def check(self, memory: MemoryConfig | None = None, key: Callable[[str], str] = str) -> MemoryContext:
        """The context's rules, returning it: each field within the bound declared beside it; same_length needs a
        memory (the attention window is mem_len keys wide); with the ``memory`` variant, its rules against the
        context (:meth:`MemoryConfig.check_context`, :meth:`MemoryConfig.check_window`). ValueError in one sentence
        naming ``key(field)``."""
        for f in dataclasses.fields(self):
            bound, value = bound_of(f), getattr(self, f.name)
            if bound is not None and not bound.allows(value):
                raise ValueError(f"{key(f.name)} must be {bound.says}, got {value!r}")
        if self.same_length and self.mem_len == 0:
            raise ValueError(f"{key('same_length')}=True needs mem_len > 0 (the window is {key('mem_len')} keys "
                             f"wide); set {key('mem_len')} or {key('same_length')}=false")
        if memory is not None:
            memory.check_context(self.same_length)
            memory.check_window(self.grad_segments, self.mem_len)
        return self


#: The fields of the context an evaluation may give other values than training's (``memory.eval_X``).
EVALUATED = ("mem_len", "clamp_len", "same_length")
CONTEXT_NAMES = tuple(f.name for f in dataclasses.fields(MemoryContext))


def evaluation(memory: Any) -> MemoryContext:
    """The evaluation context of a training config's ``memory`` node: its context with its ``eval_X``."""
    return MemoryContext.of(memory).evaluated(eval_overrides(memory))


def override(name: str, help: str) -> tuple[Any, dataclasses.Field]:
    """The type and field of a setting that overrides the context's field ``name``: its type or null, null by default
    (the value it overrides stays), its bound or null, and ``help``."""
    f = next(f for f in dataclasses.fields(MemoryContext) if f.name == name)
    bound = bound_of(f)
    return (typing.get_type_hints(MemoryContext)[name] | None,
            setting(None, bound=None if bound is None else nullable(bound), help=help))


def overrides(cls_name: str, doc: str, helps: dict[str, tuple[str, str]]) -> type:
    """A dataclass of overrides (``doc`` its docstring), one field per ``{field name: (context field it overrides,
    help)}``."""
    cls = dataclasses.make_dataclass(cls_name, [(name, *override(of, help)) for name, (of, help) in helps.items()])
    cls.__doc__, cls.__module__ = doc, __name__
    return cls


def _train_node() -> type:
    """``memory``: the variant, and the context of training and of evaluation (``eval_*``: null takes the training
    value) that every memory shares."""
    hints = typing.get_type_hints(MemoryContext)
    specs: list[tuple] = [("_target_", str, setting(DEFAULT_TARGET, help="the variant's config class (its own "
                                                                          "settings follow)"))]
    for f in dataclasses.fields(MemoryContext):
        specs.append((f.name, hints[f.name], copied(f)))
        if f.name in EVALUATED:
            specs.append((f"eval_{f.name}", *override(f.name, f"{f.name} in evaluation; null: {f.name}")))
    cls = dataclasses.make_dataclass("MemorySettings", specs)
    cls.__doc__, cls.__module__ = _train_node.__doc__, __name__
    return cls


def eval_overrides(values: Any) -> dict[str, Any]:
    """The ``eval_X`` of ``values`` (a ``memory`` node, a module's hyper-parameters) as the overrides of ``X``."""
    return {name: _get(values, f"eval_{name}") for name in EVALUATED}


def _get(layer: Any, name: str) -> Any:
    return layer.get(name) if hasattr(layer, "get") else getattr(layer, name, None)


@dataclass
class MemoryConfig:
    """A memory variant's own settings. A subclass is a dataclass whose fields are declared with
    :func:`xl.settings.bounds.setting` (type, default, bound, help); a field whose metadata has ``from`` is not a user
    setting but copied from that key of the run's config when the model is made (``seg_len`` from ``data.tgt_len``).

    The rules between the variant's settings and the shared context are the methods below: each raises ValueError
    with one sentence naming the setting to change, and serves the composed config, the model and its decoders."""

    #: The variant's name in tables, sweep summaries and messages.
    name: ClassVar[str] = "memory"
    #: Whether ``xl.evaluate vanilla=true`` (every window read afresh, no memory) can evaluate a model with it.
    reads_afresh: ClassVar[bool] = True
    #: The settings an evaluation may give other values (``python -m xl.evaluate +memory.NAME=V``): those that shape
    #: no weight and only size or search the memory; the others are the trained model's.
    evaluation_settings: ClassVar[tuple[str, ...]] = ()
    #: The name its own training loss (:attr:`xl.model.memory.Update.loss`, if it has one) is logged under:
    #: ``train/<loss_name>``.
    loss_name: ClassVar[str] = "memory_loss"

    def __post_init__(self) -> None:
        check_fields(self, "memory.")

    def memory(self, config: XLConfig) -> Memory:
        """The memory a model of ``config`` (whose ``memory`` is this) attends over."""
        raise NotImplementedError

    # ---- the rules between this variant and the context ------------------------------------------------------
    def check_context(self, same_length: bool) -> None:
        """Refuse an attention context this memory cannot serve (``same_length`` of training or evaluation)."""

    def check_window(self, grad_segments: int, mem_len: int) -> None:
        """Refuse gradients through windows of ``grad_segments`` > 1 segments where nothing carries them."""
        if grad_segments > 1 and mem_len == 0:
            raise ValueError(f"memory.grad_segments={grad_segments} needs memory.mem_len > 0: without a memory no "
                             "gradient crosses segments")

    def check_lengths(self, lengths: dict[str, int]) -> None:
        """Refuse segment or memory lengths (``{"data.tgt_len": 128, "memory.mem_len": 64, ...}``) this memory
        cannot divide up."""

    # ---- what the memory holds --------------------------------------------------------------------------------
    def held(self, mem_len: int, grad_segments: int, n_layer: int) -> list[float]:
        """Per layer, how many positions before a segment's first token a query of that layer can read a token from
        in one attention hop, once the memory is full (``math.inf``: no bound): the cache's ``mem_len`` unless the
        variant keeps more (the recall probe's predictions, :func:`xl.probe.reach_accuracy`)."""
        return [mem_len] * n_layer

    # ---- records ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The settings with ``_target_``: what a checkpoint records, and :func:`variant` reads back."""
        return {"_target_": target_of(type(self)), **dataclasses.asdict(self)}

    @classmethod
    def user_fields(cls) -> list[dataclasses.Field]:
        """The fields a user sets in the ``memory`` group (those not copied from the run's config)."""
        return [f for f in dataclasses.fields(cls) if "from" not in f.metadata]


def for_evaluation(config: MemoryConfig, given: dict[str, Any]) -> MemoryConfig:
    """``config`` (a checkpoint's) with the evaluation's values of its :attr:`~MemoryConfig.evaluation_settings`
    (``given``: ``{name: value}``), checked as the variant checks them; ValueError in one sentence for a setting that
    the variant lacks or that evaluation cannot change."""
    names = {f.name for f in config.user_fields()}
    for name in given:
        if name not in names:
            raise ValueError(f"memory.{name} is not a setting of the checkpoint's {config.name} memory; it has "
                             f"{', '.join(sorted(names)) or 'none of its own'}")
        if name not in config.evaluation_settings:
            can = (f"evaluation can change {', '.join(f'memory.{n}' for n in config.evaluation_settings)}"
                   if config.evaluation_settings else f"evaluation changes none of the {config.name} memory's own")
            raise ValueError(f"memory.{name} cannot change at evaluation: the weights were trained with "
                             f"memory.{name}={getattr(config, name)}; {can}")
    return dataclasses.replace(config, **given) if given else config


def evaluated_model(model: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's model config ``model`` with the evaluation's values ``given`` of its memory's evaluation settings
    (:func:`for_evaluation`; ValueError in one sentence); ``model`` itself where none is given."""
    if not given:
        return model
    return {**model, "memory": for_evaluation(variant(model.get("memory")), given).to_dict()}


def describe(config: MemoryConfig) -> str:
    """The variant and its own settings in one cell of a table: ``name(setting=value, ...)``."""
    own = ", ".join(f"{f.name}={getattr(config, f.name)}" for f in config.user_fields())
    return f"{config.name}({own})" if own else config.name


def target_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def config_class(target: str) -> type[MemoryConfig]:
    """The :class:`MemoryConfig` subclass ``memory._target_`` names, or ValueError in one sentence."""
    module_name, _, name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name) if module_name else None
    except ImportError as err:
        raise ValueError(f"memory._target_={target} cannot be imported ({err}); name a memory's config class, "
                         f"such as {DEFAULT_TARGET}") from None
    except AttributeError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, MemoryConfig)):
        raise ValueError(f"memory._target_={target} is not a memory's config class (a subclass of "
                         f"xl.model.memory_settings.MemoryConfig); name one, such as {DEFAULT_TARGET}")
    return cls


@functools.cache
def _settings_class(target: str) -> type:
    """The dataclass that types a ``memory`` node naming ``target``: :class:`MemorySettings`' fields, then the
    variant's user fields (with their bounds and help)."""
    cls = config_class(target)
    shared = typing.get_type_hints(MemorySettings)
    own = typing.get_type_hints(cls)
    clashing = [f.name for f in cls.user_fields() if f.name in SHARED]
    if clashing:
        raise ValueError(f"{target} declares {', '.join(clashing)}, which every memory has already; rename it")
    specs = [(f.name, shared[f.name], copied(f)) for f in dataclasses.fields(MemorySettings)]
    specs += [(f.name, own[f.name], copied(f)) for f in cls.user_fields()]
    return dataclasses.make_dataclass(f"{cls.__name__}Settings", specs)


#: The ``memory`` group's schema: the shared context of :class:`MemoryContext` with the variant's ``_target_``.
MemorySettings = _train_node()
SHARED = frozenset(f.name for f in dataclasses.fields(MemorySettings))  # the keys every memory node has


def variant(memory: Any = None, run: Any = None) -> MemoryConfig:
    """The variant's config from a ``memory`` node, the one route from a config to a variant: a composed node (a
    DictConfig or mapping; the context every memory shares is left out) or a checkpoint's record
    (:meth:`MemoryConfig.to_dict`); None: the plain cache. A field marked ``from`` is read from ``run`` (the composed
    config, ``OmegaConf.select``-able) when given, else from the node, else its default. ValueError in one sentence
    for a key the variant lacks."""
    values = {} if memory is None else {k: memory[k] for k in memory}
    cls = config_class(values.pop("_target_", DEFAULT_TARGET))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known - SHARED)
    if unknown:
        raise ValueError(f"{', '.join(unknown)} {'is not a setting' if len(unknown) == 1 else 'are not settings'} "
                         f"of the {cls.name} memory; it has {', '.join(sorted(known)) or 'none of its own'}")
    own = {k: v for k, v in values.items() if k in known}
    if run is not None:
        from omegaconf import OmegaConf

        own.update({f.name: OmegaConf.select(run, f.metadata["from"]) for f in dataclasses.fields(cls)
                    if "from" in f.metadata})
    return cls(**own)


def typed(memory: Any) -> Any:
    """A composed ``memory`` node typed by the dataclass of the shared fields and its variant's user fields (a
    DictConfig whose schema is that class, values converted, interpolations kept), or ValueError in one sentence for
    a key or value the variant does not take."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import ValidationError

    from xl.settings.bounds import describe_type

    if not isinstance(memory, DictConfig) or OmegaConf.get_type(memory) is not dict:
        return memory
    target = memory.get("_target_", DEFAULT_TARGET)
    cls = _settings_class(target)
    node = OmegaConf.structured(cls)
    hints = typing.get_type_hints(cls)
    for key, value in OmegaConf.to_container(memory, resolve=False).items():
        if key not in hints:
            raise ValueError(f"memory.{key} is not a setting of the {config_class(target).name} memory; memory has "
                             f"{', '.join(hints)}")
        try:
            node[key] = value
        except ValidationError:
            got = "null" if value is None else str(value)
            raise ValueError(f"memory.{key} must be {describe_type(hints[key])}, got {got!r}") from None
    return node
