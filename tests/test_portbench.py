"""``python -m xl.portbench``: the side-by-side harness runs, and says how to get the port when it is missing."""

from __future__ import annotations

import sys

import pytest
import torch

from xl.bench import token_stream
from xl.model import TransformerXL, XLConfig
from xl.portbench import interleaved, main, stepper

TINY = XLConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, d_head=8, d_inner=32, mem_len=8, dropout=0.1)


@pytest.mark.parametrize("train", [True, False])
def test_interleaved_rounds_time_every_stepper(train):
    tokens = token_stream(TINY, 2, 8, 4)
    steps = {name: stepper(TransformerXL(TINY), True, train, tokens, 8) for name in ("a", "b")}
    rates = interleaved(steps, 2 * 8, block=2, rounds=3)
    assert {name: len(r) for name, r in rates.items()} == {"a": 3, "b": 3}
    assert all(rate > 0 for r in rates.values() for rate in r)


def test_missing_port_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as without the package
    with pytest.raises(SystemExit, match="transformers==4.30.2"):
        main(["--rounds", "1", "--threads", str(torch.get_num_threads())])
