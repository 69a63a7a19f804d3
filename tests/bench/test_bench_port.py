"""``python -m xl.bench.port``: the side-by-side harness runs, the port reads through the same runner, and the
command says how to get the port when it is missing."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from xl.bench.port import PortRunner, interleaved, main
from xl.bench.runner import SegmentRunner, token_stream
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL

TINY = XLConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, d_head=8, d_inner=32, mem_len=8, dropout=0.1)


@pytest.mark.parametrize("train", [True, False])
def test_interleaved_rounds_time_every_stepper(train):
    tokens = token_stream(TINY, 2, 8, 4)
    steps = {name: SegmentRunner(TransformerXL(TINY), tokens, 8, train=train).step for name in ("a", "b")}
    rates = interleaved(steps, 2 * 8, block=2, rounds=3)
    assert {name: len(r) for name, r in rates.items()} == {"a": 3, "b": 3}
    assert all(rate > 0 for r in rates.values() for rate in r)


class FakePort(torch.nn.Module):
    """Called as the port is (input_ids, mems, labels); records the memory it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.seen: list = []

    def forward(self, input_ids, mems=None, labels=None):
        self.seen.append(mems)
        losses = self.weight * input_ids[:, 1:].float()  # the port scores L - 1 targets a row
        return SimpleNamespace(mems=[input_ids.clone()], losses=losses)


def test_port_runner_carries_the_ports_memory_and_trains():
    port = FakePort()
    tokens = torch.arange(2 * 13).view(2, 13)
    runner = PortRunner(port, tokens, 4, train=True)
    runner.run(3)
    assert port.seen[0] is None
    for previous, start in zip(port.seen[1:], (0, 4), strict=True):
        assert torch.equal(previous[0], tokens[:, start:start + 4])  # the last segment's memory, handed back
    assert port.weight.item() < 1.0  # AdamW stepped on the mean of the port's losses


def test_missing_port_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as without the package
    with pytest.raises(SystemExit, match="transformers==4.30.2"):
        main(["--rounds", "1", "--threads", str(torch.get_num_threads())])
