"""python -m xl.bench.documents: the runner hands each segment's documents to the model, and the command runs."""

from __future__ import annotations

import torch

from xl.bench.documents import DocumentRunner, main
from xl.bench.runner import token_stream
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL


def test_boundaries_reach_the_model_every_segment_and_far_ones_use_the_plain_mask():
    cfg = XLConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, d_head=8, d_inner=32, mem_len=8)
    model = TransformerXL(cfg)
    stream = token_stream(cfg, 3, 8, 4)
    seen = {}
    for condition in ("none", "far", "boundaries"):
        runner = DocumentRunner(model, stream, 8, condition=condition, doc_len=5)
        runner.step()
        seen[condition] = runner.documents()
    assert seen["none"] is None
    assert seen["far"].latest_start < 0  # every document began long before the segment
    positions = seen["boundaries"].pos
    assert positions.shape == (3, 8) and int(positions.max()) < 5 and bool((positions == 0).any())
    assert not torch.equal(positions[0], positions[1])  # each row at its own phase


def test_command_prints_each_condition(capsys):
    summary = main(["--steps", "1", "--rounds", "1", "--tgt-len", "8", "--batch", "2", "--doc-len", "4"])
    assert set(summary) == {f"{m}/{c}" for m in ("train", "eval") for c in ("none", "far", "boundaries")}
    assert summary["train/none"] == 1.0 and "boundaries" in capsys.readouterr().out
