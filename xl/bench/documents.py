"""What document boundaries cost: ``python -m xl.bench.documents``.

Training and evaluation tokens/s of config S (as ``python -m xl.bench`` measures them) in three conditions,
interleaved round by round in one process so that a shared CPU slows them alike: no documents (the plain
forward), documents given but no boundary in reach (the plain mask must be used: the same cost), and a document
beginning every ``--doc-len`` tokens in every row, at a different phase per row (a per-row mask every segment).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import Tensor

from xl.bench.runner import SegmentRunner, token_stream
from xl.bench.shared import CONFIG_S, interleaved_rates, report_ratios
from xl.model.config import XLConfig
from xl.model.documents import Documents
from xl.model.transformer import TransformerXL, XLOutput
from xl.training.services.console import plain_text

CONDITIONS = ("none", "far", "boundaries")


class DocumentRunner(SegmentRunner):
    """The shared runner, with each segment's documents (see the module docstring) handed to the model."""

    def __init__(self, *args, condition: str, doc_len: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.condition, self.doc_len = condition, doc_len

    def documents(self) -> Documents | None:
        """The documents of the segment just read."""
        if self.condition == "none":
            return None
        rows, start = self.tokens.size(0), self.starts[self.index - 1]
        index = np.arange(start, start + self.tgt_len)[None]
        if self.condition == "far":  # every row's document began long before the stream: nothing to hide
            pos = np.repeat(index + 10**6, rows, axis=0)
        else:
            phase = (np.arange(rows) * 37 % self.doc_len)[:, None]
            pos = (index - phase) % self.doc_len
        latest = int((np.arange(self.tgt_len) - pos).max())
        return Documents(torch.from_numpy(pos), latest)

    def forward(self, x: Tensor, y: Tensor | None) -> XLOutput:
        return self.model(x, self.mems, y, return_logits=self.return_logits, cache_kv=self.optimizer is None,
                          kv=self.kv, documents=self.documents(), **self.context)


def rates(cfg: XLConfig, batch: int, tgt_len: int, steps: int, doc_len: int, rounds: int) -> dict[str, list[float]]:
    """Per condition and mode, the tokens/s of each round (median of 3 timed repeats after a warm-up)."""
    torch.manual_seed(0)
    model = TransformerXL(cfg)
    stream = token_stream(cfg, batch, tgt_len, 64)
    runners = {f"{mode}/{c}": DocumentRunner(model, stream, tgt_len, train=mode == "train", condition=c,
                                             doc_len=doc_len)
               for mode in ("train", "eval") for c in CONDITIONS}

    def run(name: str, runner: DocumentRunner) -> None:
        runner.model.train(name.startswith("train"))  # the runners share one model
        runner.run(steps)

    return interleaved_rates({name: (lambda n=name, r=runner: run(n, r), steps * batch * tgt_len)
                              for name, runner in runners.items()}, rounds)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.documents", description=plain_text(__doc__.splitlines()[0]))
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
    return report_ratios(result, ("train", "eval"), list(CONDITIONS))


if __name__ == "__main__":
    main()
