"""python -m xl.bench.babilong: the evaluation it times reads its stream as one text, every mode is timed against it,
and one cell's peak memory is reported."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xl.bench.babilong import build, evaluate_stream, main, peak_of_one_cell


def test_the_evaluation_timed_reads_its_stream_segment_by_segment_as_one_text():
    evaluator, reader = build("babilong_bytes")
    assert reader.model is evaluator.model
    width = evaluator.model.config.mem_len  # every token's context fits in the memory: one forward sees the same
    stream = torch.randint(0, 256, (2, width + 1), generator=torch.Generator().manual_seed(0))
    evaluate_stream(evaluator, stream, reader.seg_len)
    assert width > 2 * reader.seg_len and evaluator.tokens == 2 * width  # several segments, every token scored
    loss = evaluator.metrics.compute("test")["test/loss"]
    with torch.no_grad():
        logits = evaluator.model(stream[:, :-1], mem_len=0).logits
    expected = F.cross_entropy(logits.flatten(0, 1).double(), stream[:, 1:].flatten())
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_command_times_the_scorer_against_evaluation(capsys):
    result = main(["--length", "150", "--batch", "2", "--rounds", "1", "--threads", "1", "--peak-lengths"])
    assert set(result["summary"]) == {"150/evaluate", "150/read", "150/score"}
    assert result["summary"]["150/evaluate"] == 1.0 and all(r > 0 for r in result["summary"].values())
    assert all(len(rates) == 1 and rates[0] > 0 for rates in result["rates"].values())
    assert result["peaks"] == []
    printed = capsys.readouterr().out
    assert "read" in printed and "time vs evaluate" in printed


def test_one_cell_reports_its_tokens_and_peak_memory():
    peak = peak_of_one_cell("babilong_bytes", "300", 1)
    assert peak["length"] == "300" and 250 < peak["read_tokens"] < 400  # context within a sentence, and the question
    assert 0 < peak["before_mib"] <= peak["peak_mib"] and peak["seconds"] > 0


def test_a_bad_length_stops_before_any_work(capsys):
    with pytest.raises(SystemExit):
        main(["--length", "2kb"])
    assert "'2kb' is not a length" in capsys.readouterr().err
