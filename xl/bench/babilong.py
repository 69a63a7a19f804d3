"""The BABILong scorer against the model's evaluation, speed and memory: ``python -m xl.bench.babilong``.

Speed: one model with random weights (speed does not depend on them), by default the shape, segment length and memory
of ``experiment=babilong_bytes`` (the byte-level run that docs/babilong.md scores), timed side by side in one
process, the modes taking turns call by call so that a shared CPU slows them alike (the ratios are medians over the
rounds), over ``--batch`` rows of ``--length`` tokens of context:

- ``evaluate``: :class:`xl.evaluation.Evaluator`'s test step, what ``python -m xl.evaluate`` runs under Lightning
  (called here without the trainer, in inference mode as Lightning calls it): the model's forward with the memory
  and its projected keys/values carried, the loss and the metrics, over a random stream as wide as the longest prompt;
- ``read``: the scorer reading the same number of BABILong prompts (:meth:`xl.babilong.score.Reader.read`: tokenised,
  each row's filler hidden from its prompt, read through the decoder's prefill);
- ``score``: a whole cell (:func:`xl.babilong.score.score_cell`): the samples made from the embedded corpus, read,
  answered greedily (16 tokens at most) and judged.

All three read with the same model, batch, segment length and context (``mem_len``, ``clamp_len``, ``same_length``).
Evaluation counts every token of its stream; the scorer counts its prompts' tokens (not the filler of the shorter
rows), the figure ``results.json`` reports as ``tok_s``.

Memory: each of ``--peak-lengths`` is scored in a fresh process, one sample (``--peak-batch`` rows) after a warm-up
cell at length 0, and the process reports its peak resident set size while the cell is scored (Linux's ``VmHWM``,
reset just before the cell: the whole process, torch's libraries included) and how far that peak rose above the
resident size just before the cell.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from xl.babilong.score import Reader, score_cell
from xl.bench.gpu import experiment_shape
from xl.bench.shared import cpu_model, interleaved_rates, report_ratios
from xl.data.babilong.background import Sentences
from xl.data.babilong.data import token_counter
from xl.data.babilong.lengths import WORDS, is_length, parse_length
from xl.data.babilong.samples import samples
from xl.data.sources import StdlibSource
from xl.data.tokenizers import make_tokenizer
from xl.evaluation import Evaluator
from xl.model.config import XLConfig
from xl.training.services.console import plain_text

MODES = ("evaluate", "read", "score")
TASK = "qa1"
MAX_NEW_TOKENS = 16  # the scorer's default


def build(experiment: str) -> tuple[Evaluator, Reader]:
    """The evaluator and the scorer's reader (a byte tokenizer) around one model with random weights, reading
    segments of the experiment's training length with its memory as the evaluation context."""
    shape, _, seg_len = experiment_shape(experiment)
    config = XLConfig.from_dict(shape)
    context = config.context(doc_boundaries="ignore")
    torch.manual_seed(0)
    evaluator = Evaluator(config.to_dict(), context, "byte").eval()
    return evaluator, Reader(evaluator.model, make_tokenizer("byte"), context, seg_len, MAX_NEW_TOKENS)


def cell_settings(rows: int) -> DictConfig:
    """What :func:`score_cell` reads of the scorer's settings: ``rows`` samples, read together, seed 0."""
    return OmegaConf.create({"samples": rows, "batch_size": rows, "seed": 0})


def prompts(reader: Reader, length: int, rows: int) -> list[str]:
    """The scorer's first ``rows`` test prompts of :data:`TASK` at ``length`` (the embedded corpus as background)."""
    count = token_counter(reader.tokenizer)
    stream = samples(TASK, length, "test", 0, Sentences(StdlibSource(), "test", count), count)
    return [next(stream).prompt for _ in range(rows)]


def evaluate_stream(evaluator: Evaluator, tokens: torch.Tensor, seg_len: int) -> None:
    """One test epoch of the evaluator over ``tokens`` [B, T+1] in segments of ``seg_len``, as Lightning runs it
    (the memory reset at the epoch's start, each step in inference mode)."""
    evaluator.on_test_epoch_start()
    with torch.inference_mode():
        for i, start in enumerate(range(0, tokens.size(1) - 1, seg_len)):
            end = min(start + seg_len, tokens.size(1) - 1)
            evaluator.test_step((tokens[:, start:end], tokens[:, start + 1:end + 1]), i)


def measure(experiment: str, length: int, batch: int, rounds: int) -> dict[str, Any]:
    """Per mode, the tokens/s of each round, and the sizes read."""
    evaluator, reader = build(experiment)
    texts = prompts(reader, length, batch)
    widths = [len(reader.tokenizer.encode(p)) for p in texts]
    stream = torch.randint(0, evaluator.model.config.vocab_size, (batch, max(widths) + 1),
                           generator=torch.Generator().manual_seed(0))
    settings, background = cell_settings(batch), StdlibSource()
    runs = {"evaluate": (lambda: evaluate_stream(evaluator, stream, reader.seg_len), batch * max(widths)),
            "read": (lambda: reader.read(texts), sum(widths)),
            "score": (lambda: score_cell(reader, background, TASK, length, settings), sum(widths))}
    for run, _ in runs.values():  # one untimed call each; then the modes alternate call by call
        run()
    return {"rates": interleaved_rates(runs, rounds, warmup=0, repeats=1), "prompt_tokens": sum(widths),
            "width": max(widths), "seg_len": reader.seg_len, "config": evaluator.model.config}


def resident_mib(field: str) -> float:
    """This process's ``VmRSS`` (resident now) or ``VmHWM`` (its peak) in MiB, from Linux's /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) / 1024


def reset_peak() -> None:
    """Start the process's peak resident size (VmHWM) afresh from its resident size now (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as err:
        raise SystemExit(f"the memory figures reset the peak resident size through /proc/self/clear_refs, which "
                         f"this system refuses ({err.strerror}); leave them out with --peak-lengths and nothing after"
                         ) from None


def peak_of_one_cell(experiment: str, length: str, rows: int) -> dict[str, Any]:
    """Score ``rows`` samples at ``length`` in this process after a warm-up cell at length 0: the resident size just
    before the cell and its peak while the cell is scored, in MiB, with the cell's tokens and seconds."""
    _, reader = build(experiment)
    score_cell(reader, StdlibSource(), TASK, 0, cell_settings(rows))
    reset_peak()
    before = resident_mib("VmRSS")
    cell = score_cell(reader, StdlibSource(), TASK, parse_length(length), cell_settings(rows))
    return {"length": length, "read_tokens": cell.read_tokens, "before_mib": before, "peak_mib": resident_mib("VmHWM"),
            "seconds": cell.seconds}


def peak_in_fresh_process(experiment: str, length: str, rows: int, threads: int) -> dict[str, Any]:
    """:func:`peak_of_one_cell` in a fresh process (this command, with a hidden flag)."""
    command = [sys.executable, "-m", "xl.bench.babilong", "--experiment", experiment, "--threads", str(threads),
               "--peak-batch", str(rows), "--peak-child", length]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"scoring one cell at {length} in a fresh process failed: {done.stderr.strip()}")
    return json.loads(done.stdout.splitlines()[-1])


def format_peaks(peaks: list[dict[str, Any]]) -> str:
    base = peaks[0]["peak_mib"]
    lines = [f"  {'length':>7} {'tokens read':>12} {'seconds':>8} {'peak RSS MiB':>13} {'rise MiB':>9} "
             f"{'peak vs ' + peaks[0]['length']:>12}"]
    lines += [f"  {p['length']:>7} {p['read_tokens']:>12,} {p['seconds']:>8.1f} {p['peak_mib']:>13,.1f} "
              f"{p['peak_mib'] - p['before_mib']:>9,.1f} {p['peak_mib'] / base:>11.3f}x" for p in peaks]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.babilong", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--experiment", default="babilong_bytes",
                   help="a conf/experiment overlay's model and segments, or S")
    p.add_argument("--length", default="2k", help="context length of the speed rounds, in tokens (1k = 1,000)")
    p.add_argument("--batch", type=int, default=8, help="rows read at once (the scorer's batch_size)")
    p.add_argument("--rounds", type=int, default=9,
                   help="rounds, each one timed call of every mode in turn; 0: the memory figures alone")
    p.add_argument("--peak-lengths", nargs="*", default=["1k", "4k"], help="lengths scored each in a fresh process")
    p.add_argument("--peak-batch", type=int, default=1, help="samples in the cell of each fresh process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)  # the fresh process's part
    args = p.parse_args(argv)
    for value in (args.length, *args.peak_lengths, *([args.peak_child] if args.peak_child else [])):
        if not is_length(value):
            p.error(f"{value!r} is not a length: {WORDS}")
    for name in ("batch", "peak_batch", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rounds < 0:
        p.error("--rounds must be 0 (the memory figures alone) or more")
    torch.set_num_threads(args.threads)
    if args.peak_child is not None:
        result = peak_of_one_cell(args.experiment, args.peak_child, args.peak_batch)
        print(json.dumps(result))
        return result
    print(f"machine: {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    summary, rates = {}, {}
    if args.rounds:
        m = measure(args.experiment, parse_length(args.length), args.batch, args.rounds)
        cfg, label, rates = m["config"], args.length, m["rates"]
        print(f"experiment={args.experiment} (n_layer {cfg.n_layer}, d_model {cfg.d_model}, mem_len {cfg.mem_len}), "
              f"random weights; batch {args.batch}, segments of {m['seg_len']}; {TASK} at {label}: "
              f"{m['prompt_tokens']:,} prompt tokens, {m['width']:,} per row at most; {args.rounds} rounds\n")
        summary = report_ratios({f"{label}/{mode}": r for mode, r in rates.items()}, (label,), list(MODES))
    peaks = [peak_in_fresh_process(args.experiment, n, args.peak_batch, args.threads)
             for n in args.peak_lengths]
    if peaks:
        print(f"\npeak memory of one cell of {args.peak_batch} sample(s) of {TASK} in a fresh process after a "
              f"warm-up cell at length 0: peak resident size while it is scored (VmHWM), and its rise above the "
              f"resident size just before")
        print(format_peaks(peaks))
    return {"summary": summary, "rates": rates, "peaks": peaks}


if __name__ == "__main__":
    main()
