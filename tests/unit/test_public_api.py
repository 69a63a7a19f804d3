"""``from xl import ...`` reaches the names a user needs, and ``import xl`` imports none of the heavy libraries."""

from __future__ import annotations

import subprocess
import sys

import pytest

import xl
from tests.helpers.paths import ROOT


@pytest.mark.parametrize("name", sorted(xl.PUBLIC))
def test_each_public_name_is_the_defining_modules_object(name):
    import importlib

    assert getattr(xl, name) is getattr(importlib.import_module(xl.PUBLIC[name]), name)
    assert name in dir(xl) and name in xl.__all__


def test_the_docstrings_example_builds_a_model_that_runs():
    from xl import TransformerXL, XLConfig

    model = TransformerXL(XLConfig(vocab_size=256, n_layer=2))
    assert sum(p.numel() for p in model.parameters()) > 0
    assert "TransformerXL(XLConfig(vocab_size=256, n_layer=2))" in xl.__doc__


def test_all_lists_exactly_the_public_names():
    assert sorted(xl.__all__) == sorted(["__version__", *xl.PUBLIC])


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Transformer'"):
        xl.Transformer  # noqa: B018


def test_import_xl_imports_neither_torch_nor_lightning_nor_hydra():
    code = "import sys, xl; print(sorted(m for m in ('torch', 'lightning', 'hydra', 'omegaconf') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_from_xl_import_in_the_docs_names_a_public_name():
    import re

    texts = [(ROOT / "README.md").read_text(encoding="utf-8"),
             *(path.read_text(encoding="utf-8") for path in (ROOT / "docs").glob("*.md"))]
    named = {name.strip() for text in texts for line in re.findall(r"^from xl import (.+)$", text, re.M)
             for name in line.split("#")[0].split(",")}
    assert named and named <= set(xl.PUBLIC)
