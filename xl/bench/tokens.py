"""What memory tokens cost in speed: ``python -m xl.bench.tokens``.

Config S (``python -m xl.bench``'s model) with four memories, interleaved round by round in one process so that a
shared CPU slows them alike:

- ``plain M``: Transformer-XL with ``mem_len = M``;
- ``M + n tokens``: the same cache with ``n`` memory tokens read and written every segment (``memory=tokens``);
- ``n tokens``: the memory tokens alone (``mem_len = 0``);
- ``n tokens, LM-RMT``: memory tokens laid out as LM-RMT's models, alone (``memory=lmrmt``'s default).

Each is timed in training (forward, backward, AdamW; :class:`xl.bench.runner.SegmentRunner`) and in evaluation
(segments with cached keys/values), in text tokens per second, and reported against ``plain M``. A segment of
``tgt_len`` text tokens runs ``tgt_len + 2n`` positions through the layers.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from xl.bench.runner import SegmentRunner, token_stream
from xl.bench.shared import CONFIG_S, cpu_model, interleaved_rates, report_ratios
from xl.memory.lmrmt import LMRMTConfig
from xl.memory.tokens import TokensConfig
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.services.console import plain_text

MODES = ("train", "eval")


def memories(mem_len: int, num_tokens: int, tgt_len: int) -> dict[str, dict[str, Any]]:
    """The memories compared (see the module docstring), as config overrides."""
    tokens = {"memory": TokensConfig(num_tokens=num_tokens, seg_len=tgt_len)}
    return {f"plain {mem_len}": {"mem_len": mem_len},
            f"{mem_len} + {num_tokens} tokens": {"mem_len": mem_len, **tokens},
            f"{num_tokens} tokens": {"mem_len": 0, **tokens},
            f"{num_tokens} tokens, LM-RMT": {"mem_len": 0,
                                             "memory": LMRMTConfig(num_tokens=num_tokens, seg_len=tgt_len)}}


def rates(mem_len: int, num_tokens: int, batch: int, tgt_len: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """Per memory and mode, the text tokens/s of each round (median of 3 timed repeats after a warm-up)."""
    runs: dict[str, tuple[Callable[[], None], int]] = {}
    for name, overrides in memories(mem_len, num_tokens, tgt_len).items():
        torch.manual_seed(0)
        cfg = XLConfig(**{**CONFIG_S, **overrides})
        stream = token_stream(cfg, batch, tgt_len, 16)
        for mode in MODES:
            # One model per mode, left in its mode: training changes the weights.
            runner = SegmentRunner(TransformerXL(cfg), stream, tgt_len, train=mode == "train")
            runs[f"{mode}/{name}"] = (lambda r=runner: r.run(steps)), batch * tgt_len * steps
    return interleaved_rates(runs, rounds)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.tokens", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--mem-len", type=int, default=128, help="M: the cache of the plain memory and of M + n tokens")
    p.add_argument("--num-tokens", type=int, default=4, help="n: memory tokens")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="segments per timed repeat")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median ratio is reported")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.mem_len < 1 or args.num_tokens < 1:
        p.error("--mem-len and --num-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    result = rates(args.mem_len, args.num_tokens, args.batch, args.tgt_len, args.steps, args.rounds)
    print(f"machine: {cpu_model()}, torch {torch.__version__}, {args.threads} thread(s); config S, batch "
          f"{args.batch}, segments of {args.tgt_len}, {args.rounds} interleaved rounds")
    return report_ratios(result, MODES, list(memories(args.mem_len, args.num_tokens, args.tgt_len)))


if __name__ == "__main__":
    main()
