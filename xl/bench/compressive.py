"""What the compressive memory costs in speed: ``python -m xl.bench.compressive``.

Config S (``python -m xl.bench``'s model) with three memories of the same width, interleaved round by round in one
process so that a shared CPU slows them alike:

- ``plain M``: Transformer-XL with ``mem_len = M``;
- ``compressive``: ``mem_len = M/2`` and ``cmem_len = M/2`` slots at ``--rate`` (the learned convolution): the same
  cache bytes as ``plain M``, reaching ``M/2 + rate·M/2`` positions back;
- ``plain M/2``: the same ``mem_len`` as the compressive one, without its slots.

Each is timed in training (forward, backward with the reconstruction loss, AdamW; :class:`xl.bench.runner.
SegmentRunner`), in evaluation (segments with cached keys/values) and in one-token decoding (``model.decoder``,
after a prompt that fills every memory). Times are reported against ``plain M``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from xl.bench.runner import SegmentRunner, token_stream
from xl.bench.shared import CONFIG_S, cpu_model, interleaved_rates, report_ratios
from xl.memory.compressive import CompressiveConfig
from xl.model.config import XLConfig
from xl.model.decoding import IncrementalDecoder
from xl.model.transformer import TransformerXL
from xl.training.services.console import plain_text

MODES = ("train", "eval", "decode")


def memories(mem_len: int, rate: int) -> dict[str, dict[str, Any]]:
    """The three memories compared (see the module docstring), as config overrides."""
    half = mem_len // 2
    return {f"plain {mem_len}": {"mem_len": mem_len},
            f"compressive {half}+{half}c x{rate}": {"mem_len": half,
                                                    "memory": CompressiveConfig(cmem_len=half, cmem_rate=rate)},
            f"plain {half}": {"mem_len": half}}


def filled_decoder(model: TransformerXL, batch: int) -> IncrementalDecoder:
    """A decoder after a random prompt long enough to fill the memory and the compressed memory."""
    cfg = model.config
    decoder = model.decoder(batch)
    prompt = cfg.mem_len + decoder.rate * decoder.slot_len
    decoder.prefill(torch.randint(0, cfg.vocab_size, (batch, prompt)), seg_len=cfg.mem_len)
    return decoder


def decode_steps(model: TransformerXL, batch: int, steps: int) -> Callable[[], None]:
    """``steps`` one-token decoding steps of a :func:`filled_decoder`."""
    decoder = filled_decoder(model, batch)
    token = torch.zeros(batch, dtype=torch.long)

    def run() -> None:
        for _ in range(steps):
            decoder.feed(token)

    return run


def rates(mem_len: int, rate: int, batch: int, tgt_len: int, steps: int, decode: int,
          rounds: int) -> dict[str, list[float]]:
    """Per memory and mode, the tokens/s of each round (median of 3 timed repeats after a warm-up)."""
    runs: dict[str, tuple[Callable[[], None], int]] = {}
    for name, overrides in memories(mem_len, rate).items():
        torch.manual_seed(0)
        cfg = XLConfig(**{**CONFIG_S, **overrides})
        stream = token_stream(cfg, batch, tgt_len, 16)
        for mode in MODES:
            # One model per mode, left in its mode: training changes the weights; the evaluation runner and the
            # decoder run without gradients themselves.
            model = TransformerXL(cfg)
            if mode == "decode":
                runs[f"{mode}/{name}"] = decode_steps(model, batch, decode), batch * decode
            else:
                runner = SegmentRunner(model, stream, tgt_len, train=mode == "train")
                runs[f"{mode}/{name}"] = (lambda r=runner: r.run(steps)), batch * tgt_len * steps
    return interleaved_rates(runs, rounds)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.compressive", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--mem-len", type=int, default=128, help="M: the plain memory; the compressive one has M/2 + M/2")
    p.add_argument("--rate", type=int, default=2, help="compression rate of the compressive memory")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="segments per timed repeat")
    p.add_argument("--decode", type=int, default=64, help="one-token steps per timed repeat")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median ratio is reported")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.mem_len < 2 or args.mem_len % 2 or args.tgt_len % args.rate:
        p.error("--mem-len must be even and >= 2, and --rate must divide --tgt-len")
    torch.set_num_threads(args.threads)
    result = rates(args.mem_len, args.rate, args.batch, args.tgt_len, args.steps, args.decode, args.rounds)
    print(f"machine: {cpu_model()}, torch {torch.__version__}, {args.threads} thread(s); config S, batch "
          f"{args.batch}, segments of {args.tgt_len}, {args.rounds} interleaved rounds")
    return report_ratios(result, MODES, list(memories(args.mem_len, args.rate)))


if __name__ == "__main__":
    main()
