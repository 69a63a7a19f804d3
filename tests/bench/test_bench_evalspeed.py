"""``python -m xl.bench.evalspeed``: every mode is timed and the speed-ups are the ratios of the timings."""

from __future__ import annotations

import pytest

from xl.bench.evalspeed import main


def test_speed_benchmark_reports_all_modes():
    rows = main(["--attn-lens", "16", "32", "--tgt-len", "8", "--batch", "2", "--positions", "2", "--repeats", "1",
                 "--threads", "1"])
    assert [r["attn_len"] for r in rows] == [16, 32]
    for r in rows:
        assert r["xl_us"] > 0 and r["vanilla_us"] > 0 and r["one_token_us"] > 0
        assert r["speedup"] == pytest.approx(r["vanilla_us"] / r["xl_us"])
        assert r["one_token_speedup"] == pytest.approx(r["vanilla_us"] / r["one_token_us"])
