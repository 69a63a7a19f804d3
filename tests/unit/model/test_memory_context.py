"""The memory's context: each field declared once (MemoryContext), the schemas that set or override it made from those
fields; an instance is one resolved context, evaluation's made from training's with its overrides, and one method
holds the context's rules."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from omegaconf import OmegaConf

from xl.config.schema import DecodingContext, EvalContextSchema, GenerateSchema, ScoreSchema
from xl.model.config import XLConfig
from xl.model.memory_settings import (
    EVALUATED,
    MemoryContext,
    MemorySettings,
    eval_overrides,
    evaluation,
)
from xl.settings.bounds import bound_of, help_of, nullable, one_of

CONTEXT = {f.name: f for f in dataclasses.fields(MemoryContext)}
SAMPLES = [None, -2, -1, 0, 1, 7, True, False, "reset", "ignore", "float32", "bfloat16", "int8", 2.5]


def overridden(name: str) -> str:
    """The context field a schema field sets or overrides: X for X and eval_X."""
    return name.removeprefix("eval_")


@pytest.mark.parametrize("schema", [MemorySettings, EvalContextSchema, DecodingContext, GenerateSchema, ScoreSchema])
def test_every_schema_takes_the_context_fields_bounds(schema):
    """A field of a schema named for a context field (or its eval_ override) allows what that field's declared bound
    allows, and null where it overrides; each has help."""
    for f in dataclasses.fields(schema):
        if overridden(f.name) not in CONTEXT:
            continue
        declared = bound_of(CONTEXT[overridden(f.name)])
        ours = bound_of(f)
        assert help_of(f), f"{schema.__name__}.{f.name} has no help"
        takes_null = f.default is None
        assert (ours is None) == (declared is None), f"{schema.__name__}.{f.name}"
        if ours is None:
            continue
        for value in SAMPLES:
            expected = (value is None and takes_null) or (value is not None and declared.allows(value))
            assert ours.allows(value) == expected, f"{schema.__name__}.{f.name}: {value!r}"


def test_the_memory_node_is_the_context_with_an_override_of_each_evaluated_field():
    names = [f.name for f in dataclasses.fields(MemorySettings)]
    assert names[0] == "_target_"
    assert [n for n in names[1:] if not n.startswith("eval_")] == list(CONTEXT)
    assert [n for n in names if n.startswith("eval_")] == [f"eval_{n}" for n in EVALUATED]
    defaults = MemorySettings()
    assert all(getattr(defaults, n) == getattr(MemoryContext(), n) for n in CONTEXT)
    assert all(getattr(defaults, f"eval_{n}") is None for n in EVALUATED)


def test_the_model_takes_its_context_defaults_from_the_declaration():
    model = XLConfig()
    assert {n: getattr(model, n) for n in EVALUATED + ("mem_dtype",)} == {
        n: getattr(MemoryContext(), n) for n in EVALUATED + ("mem_dtype",)}


def test_nullable_words():
    assert nullable(bound_of(CONTEXT["mem_len"])).says == "null or an integer >= 0"
    assert nullable(bound_of(CONTEXT["clamp_len"])).says == "null, -1 (no clamping) or a positive integer"
    assert nullable(bound_of(CONTEXT["doc_boundaries"])).says == "reset, ignore or null"
    assert nullable(one_of(1, 2)).says == "1, 2 or null"


def reference(layers: list[dict]) -> dict:
    """The first layer that sets each field, written out; a field none sets keeps its declared default."""
    out = {}
    for name in CONTEXT:
        out[name] = getattr(MemoryContext(), name)
        for layer in layers:
            if layer.get(name) is not None:
                out[name] = layer[name]
                break
    return out


def test_a_context_takes_each_field_from_the_first_layer_that_sets_it():
    trained = {"mem_len": 16, "clamp_len": -1, "same_length": False}
    choices = {"mem_len": [None, 0, 32], "clamp_len": [None, 4], "same_length": [None, True, False]}
    for first, second in itertools.product(itertools.product(*choices.values()), repeat=2):
        layers = [dict(zip(choices, first, strict=True)), dict(zip(choices, second, strict=True)), trained]
        assert dataclasses.asdict(MemoryContext.of(*layers)) == reference(layers)
        # a DictConfig and an XLConfig are layers too
        as_configs = [OmegaConf.create(layers[0]), layers[1], XLConfig(**trained)]
        assert dataclasses.asdict(MemoryContext.of(*as_configs)) == reference(layers)


def test_evaluation_is_a_second_context_made_from_trainings_with_its_overrides():
    memory = OmegaConf.structured(MemorySettings(mem_len=8, eval_mem_len=24, eval_same_length=True, grad_segments=2,
                                                 mem_dtype="bfloat16", doc_boundaries="ignore"))
    assert eval_overrides(memory) == {"mem_len": 24, "clamp_len": None, "same_length": True}
    trained = MemoryContext.of(memory)
    assert trained == MemoryContext(mem_len=8, mem_dtype="bfloat16", doc_boundaries="ignore", grad_segments=2)
    evaluated = evaluation(memory)
    # the evaluated fields overridden, the rest training's, and no gradient across segments
    assert evaluated == MemoryContext(mem_len=24, same_length=True, mem_dtype="bfloat16", doc_boundaries="ignore")
    assert evaluated.attention() == {"mem_len": 24, "clamp_len": -1, "same_length": True}
    assert trained.evaluated({}) == dataclasses.replace(trained, grad_segments=1)


def test_the_contexts_rules_are_one_method_naming_the_setting():
    from xl.memory.compressive import CompressiveConfig

    with pytest.raises(ValueError, match=r"^memory\.same_length=True needs mem_len > 0"):
        MemoryContext(mem_len=0, same_length=True).check(key=lambda n: f"memory.{n}")
    with pytest.raises(ValueError, match=r"^mem_len must be an integer >= 0, got -1$"):
        MemoryContext(mem_len=-1).check()
    with pytest.raises(ValueError, match="same_length"):  # the variant's rule against the context
        MemoryContext(same_length=True).check(CompressiveConfig())
    with pytest.raises(ValueError, match=r"^memory\.grad_segments=2 needs memory\.mem_len > 0"):
        MemoryContext(mem_len=0, grad_segments=2).check(XLConfig().memory)
    context = MemoryContext(mem_len=4, same_length=True)
    assert context.check(XLConfig().memory) is context


def test_a_context_outside_a_config_is_refused_by_the_declared_bound():
    with pytest.raises(ValueError, match=r"^XLConfig\.clamp_len must be -1 \(no clamping\) or a positive integer, "
                                         r"got 0$"):
        XLConfig(clamp_len=0)
    with pytest.raises(ValueError, match=r"^XLConfig\.mem_dtype must be one of bfloat16, float16, float32"):
        XLConfig(mem_dtype="int8")


def test_the_modules_context_settings_are_refused_by_the_declared_bounds():
    from xl.training.loop.module import XLLitModule

    model = {"vocab_size": 16, "n_layer": 1, "n_head": 1, "d_model": 8, "d_head": 8, "d_inner": 8, "mem_len": 4}
    with pytest.raises(ValueError, match=r"^memory\.grad_segments must be an integer >= 1, got 0$"):
        XLLitModule(model=model, grad_segments=0)
    with pytest.raises(ValueError, match=r"^memory\.eval_clamp_len must be -1 \(no clamping\) or a positive integer"):
        XLLitModule(model=model, eval_clamp_len=0)


def test_no_module_declares_a_context_setting_again():
    """A schema field named for a context field (or its eval_ override) is declared only in MemoryContext; the others
    are made from it. XLConfig's context fields take MemoryContext's defaults."""
    import re
    from pathlib import Path

    import xl

    names = "|".join([*CONTEXT, *(f"eval_{n}" for n in EVALUATED)])
    declared = re.compile(rf"^\s+({names})\s*:[^=]+=\s*setting\(", re.MULTILINE)
    root = Path(xl.__file__).parent
    found = {str(p.relative_to(root)): declared.findall(p.read_text(encoding="utf-8")) for p in root.rglob("*.py")}
    assert {p: n for p, n in found.items() if n} == {"model/memory_settings.py": list(CONTEXT)}
    model_fields = re.findall(rf"^\s+({names})\s*:[^=]+=\s*(.+)$", (root / "model" / "config.py").read_text(),
                              re.MULTILINE)
    assert model_fields and all(default == f"MemoryContext.{name}" for name, default in model_fields)
