"""python -m xl.bench.compressive: the three memories it compares, and the command runs."""

from __future__ import annotations

from tests.helpers.memories import xl_config
from xl.bench.compressive import filled_decoder, main, memories
from xl.bench.shared import CONFIG_S
from xl.device.footprint import cache_footprint
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL


def test_the_compressive_memory_has_the_cache_of_the_first_and_the_mem_len_of_the_last():
    plain, comp, half = memories(128, 4).values()
    d, layers = CONFIG_S["d_model"], CONFIG_S["n_layer"]
    assert (cache_footprint(comp["mem_len"], d, layers, 1, slots=comp["memory"].cmem_len).bytes
            == cache_footprint(plain["mem_len"], d, layers, 1).bytes)
    assert comp["mem_len"] == half["mem_len"] == 64 and comp["memory"].cmem_rate == 4


def test_decoding_is_timed_against_full_memories():
    model = TransformerXL(xl_config(**{**CONFIG_S, "n_layer": 1, "mem_len": 8, "cmem_len": 4, "cmem_rate": 2})).eval()
    decoder = filled_decoder(model, 2)
    assert decoder.slots == 4 and decoder.end - decoder.start == 8
    plain = filled_decoder(TransformerXL(XLConfig(**{**CONFIG_S, "n_layer": 1, "mem_len": 8})).eval(), 2)
    assert plain.slots == 0 and plain.end - plain.start == 8


def test_command_prints_each_memory_and_mode(capsys):
    summary = main(["--mem-len", "8", "--rate", "2", "--batch", "2", "--tgt-len", "4", "--steps", "1",
                    "--decode", "2", "--rounds", "1"])
    names = list(memories(8, 2))
    assert set(summary) == {f"{mode}/{name}" for mode in ("train", "eval", "decode") for name in names}
    assert summary["train/plain 8"] == 1.0 and "compressive 4+4c x2" in capsys.readouterr().out
