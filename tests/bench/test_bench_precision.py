"""python -m xl.bench.precision: both precisions train the same model, and the command reports each."""

from __future__ import annotations

import torch

from xl.bench.precision import PRECISIONS, main
from xl.bench.runner import SegmentRunner, token_stream
from xl.model.transformer import TransformerXL, XLConfig


def test_bf16_step_runs_under_autocast_and_float32_does_not():
    cfg = XLConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, d_head=8, d_inner=32, mem_len=8)
    stream = token_stream(cfg, 2, 8, 2)
    dtypes = {}
    for name, dtype in PRECISIONS.items():
        torch.manual_seed(0)
        model = TransformerXL(cfg)
        seen = []

        def record(module, args, out, seen=seen):
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

        model.layers[0].register_forward_hook(record)
        SegmentRunner(model, stream, 8, train=True, autocast=dtype).step()
        dtypes[name] = seen[0]
        assert all(p.dtype == torch.float32 for p in model.parameters())  # mixed: the weights stay float32
    assert dtypes == {"32-true": None, "bf16-mixed": torch.bfloat16}


def test_command_reports_both_precisions(capsys):
    summary = main(["--steps", "1", "--rounds", "1", "--tgt-len", "8", "--batch", "2"])
    assert set(summary) == {"train/32-true", "train/bf16-mixed"}
    assert summary["train/32-true"] == 1.0 and summary["train/bf16-mixed"] > 0
    out = capsys.readouterr().out
    assert "native bfloat16" in out and "bf16-mixed" in out
