"""python -m xl.bench.tokens: the memories it compares, and the command runs."""

from __future__ import annotations

from xl.bench.tokens import main, memories


def test_the_token_memories_share_the_plain_cache_or_have_none():
    plain, both, alone, lmrmt = memories(128, 4, 64).values()
    assert plain == {"mem_len": 128} and both["mem_len"] == 128 and alone["mem_len"] == lmrmt["mem_len"] == 0
    assert both["memory"].num_tokens == alone["memory"].num_tokens == lmrmt["memory"].num_tokens == 4
    assert both["memory"].seg_len == lmrmt["memory"].seg_len == 64 and lmrmt["memory"].name == "lmrmt"


def test_command_prints_each_memory_and_mode(capsys):
    summary = main(["--mem-len", "8", "--num-tokens", "2", "--batch", "2", "--tgt-len", "4", "--steps", "1",
                    "--rounds", "1"])
    names = list(memories(8, 2, 4))
    assert set(summary) == {f"{mode}/{name}" for mode in ("train", "eval") for name in names}
    assert summary["train/plain 8"] == 1.0 and "8 + 2 tokens" in capsys.readouterr().out
