"""What document boundaries cost: ``python -m xl.docbench``.

Training and evaluation tokens/s of config S (as ``python -m xl.bench`` measures them) in three conditions,
interleaved round by round in one process so that a shared CPU slows them alike: no documents (the plain
forward), documents given but no boundary in reach (the plain mask must be used: the same cost), and a document
beginning every ``--doc-len`` tokens in every row, at a different phase per row (a per-row mask every segment).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from xl.bench import CONFIG_S, SegmentRunner, median_rate, token_stream
from xl.documents import Documents
from xl.model import TransformerXL, XLConfig

CONDITIONS = ("none", "far", "boundaries")


def documents_for(runner: SegmentRunner, condition: str, doc_len: int) -> Documents | None:
    """The documents of the segment the runner is about to give (see the module docstring)."""
    if condition == "none":
        return None
    rows, start = runner.tokens.size(0), (runner.index % runner.n_segments) * runner.tgt_len
    index = np.arange(start, start + runner.tgt_len)[None]
    if condition == "far":  # every row's document began long before the stream: nothing to hide
        pos = np.repeat(index + 10**6, rows, axis=0)
    else:
        phase = (np.arange(rows) * 37 % doc_len)[:, None]
        pos = (index - phase) % doc_len
    latest = int((np.arange(runner.tgt_len) - pos).max())
    return Documents(torch.from_numpy(pos), latest)


def rates(cfg: XLConfig, batch: int, tgt_len: int, steps: int, doc_len: int, rounds: int) -> dict[str, list[float]]:
    """Per condition and mode, the tokens/s of each round (median of 3 timed repeats after a warm-up)."""
    torch.manual_seed(0)
    model = TransformerXL(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2.5e-4, fused=True)
    runners = {c: SegmentRunner(model, token_stream(cfg, batch, tgt_len, 64), tgt_len) for c in CONDITIONS}
    kv: dict[str, list | None] = dict.fromkeys(CONDITIONS)

    def train(condition: str) -> None:
        model.train()
        runner = runners[condition]
        for _ in range(steps):
            documents = documents_for(runner, condition, doc_len)
            x, y = runner.next_batch()
            out = model(x, runner.mems, y, return_logits=False, documents=documents)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            runner.mems = out.mems

    @torch.no_grad()
    def evaluate(condition: str) -> None:
        model.eval()
        runner = runners[condition]
        for _ in range(steps):
            documents = documents_for(runner, condition, doc_len)
            x, y = runner.next_batch()
            out = model(x, runner.mems, y, return_logits=False, cache_kv=True, kv=kv[condition], documents=documents)
            runner.mems, kv[condition] = out.mems, out.kv

    out: dict[str, list[float]] = {f"{mode}/{c}": [] for mode in ("train", "eval") for c in CONDITIONS}
    for _ in range(rounds):
        for mode, run in (("train", train), ("eval", evaluate)):
            for c in CONDITIONS:
                out[f"{mode}/{c}"].append(median_rate(lambda c=c, run=run: run(c), steps * batch * tgt_len, 1, 3))
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m xl.docbench", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="segments per timed repeat")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median ratio is reported")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--doc-len", type=int, default=64, help="tokens between document starts in every row")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = XLConfig(**CONFIG_S)
    result = rates(cfg, args.batch, args.tgt_len, args.steps, args.doc_len, args.rounds)
    print(f"config S, batch {args.batch}, tgt_len {args.tgt_len}, mem_len {cfg.mem_len}, a document every "
          f"{args.doc_len} tokens, {args.threads} thread(s), {args.rounds} interleaved rounds")
    summary = {}
    for mode in ("train", "eval"):
        base = result[f"{mode}/none"]
        for c in CONDITIONS:
            ratios = [b / r for b, r in zip(base, result[f"{mode}/{c}"], strict=True)]
            summary[f"{mode}/{c}"] = statistics.median(ratios)
            print(f"  {mode:<5} {c:<10} {statistics.median(result[f'{mode}/{c}']):>9,.0f} tok/s   "
                  f"time vs none {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    return summary


if __name__ == "__main__":
    main()
