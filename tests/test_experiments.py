"""The paper's experiments as configs: they compose, and our parameter counts match the paper's."""

from __future__ import annotations

import pytest

from tests.conftest import CONF_DIR, compose_config
from xl.build import model_config
from xl.model import XLConfig, count_parameters

# (experiment, vocabulary of its tokenizer, parameters reported by Dai et al., 2019)
PAPER = [("enwik8_base", 256, 41e6), ("enwik8_large", 256, 277e6), ("text8_large", 28, 277e6)]


def test_every_experiment_is_listed():
    assert {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")} == {name for name, *_ in PAPER}


@pytest.mark.parametrize("name,vocab,paper", PAPER)
def test_experiment_composes_and_matches_the_papers_size(name, vocab, paper):
    cfg = compose_config(f"experiment={name}")
    config = XLConfig.from_dict(model_config(cfg, vocab))  # validates every field
    params = count_parameters(config)  # on the meta device: nothing allocated
    assert abs(params - paper) / paper < 0.03, f"{name}: {params:,} parameters vs the paper's {paper:,.0f}"
    assert cfg.memory.eval_mem_len > cfg.memory.mem_len and cfg.memory.eval_same_length
