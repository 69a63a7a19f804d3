"""The cache-footprint formula reproduces the seed chapter's table exactly."""

import pytest
import torch

from xl.memory import cache_footprint, main

SEED_TABLE = [
    ((512, 768, 12, 8), 37_748_736, 144.0, 0.14),
    ((512, 1024, 24, 8), 100_663_296, 384.0, 0.38),
    ((1024, 1024, 24, 8), 201_326_592, 768.0, 0.75),
    ((2048, 2048, 36, 4), 603_979_776, 2304.0, 2.25),
]


@pytest.mark.parametrize("config,floats,mb,gb", SEED_TABLE)
def test_seed_table(config, floats, mb, gb):
    fp = cache_footprint(*config)
    assert fp.elements == floats
    assert fp.bytes == floats * 4
    assert fp.mb == mb
    assert round(fp.gb, 2) == gb
    assert cache_footprint(*config, dtype=torch.bfloat16).mb == mb / 2


def test_command_prints_table_and_params(capsys):
    main([])
    assert "144.0" in capsys.readouterr().out
    main(["--mem-len", "128", "--d-model", "256", "--n-layer", "4", "--batch", "8",
          "--n-head", "4", "--d-head", "64", "--d-inner", "1024", "--vocab", "256"])
    out = capsys.readouterr().out
    assert "3,484,672" in out
    fp32, bf16 = [line for line in out.splitlines() if line.startswith("128m")]
    assert "float32" in fp32 and " 4.0 " in fp32 and "bfloat16" in bf16 and " 2.0 " in bf16
