"""What bf16 autocast buys on this machine: ``python -m xl.bench.precision``.

Config S's training step (:class:`xl.bench.runner.SegmentRunner`: forward with the memory carried, backward, gradient
clipping, fused AdamW) in float32 (``precision=32-true``) and under bf16 autocast (``precision=bf16-mixed``, as
Lightning's plugin runs it), interleaved round by round in one process so that a shared CPU slows both alike. A CPU
that multiplies bfloat16 in hardware (``amx_bf16`` or ``avx512_bf16``: :mod:`xl.device.cpu`) runs the bf16 step
faster; elsewhere bf16 is emulated and far slower.
"""

from __future__ import annotations

import argparse

import torch

from xl.bench.runner import SegmentRunner, token_stream
from xl.bench.shared import CONFIG_S, cpu_model, interleaved_rates, report_ratios
from xl.device.cpu import cpu_flags, native_bf16
from xl.model.transformer import TransformerXL, XLConfig
from xl.training.services.console import plain_text

PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16}  # precision → autocast dtype
CLIP = 0.25  # trainer.gradient_clip_val


def rates(cfg: XLConfig, batch: int, tgt_len: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """Per precision, the training tokens/s of each round (median of 3 timed repeats after a warm-up); the two
    models start from the same weights."""
    runs = {}
    stream = token_stream(cfg, batch, tgt_len, 16)
    for name, dtype in PRECISIONS.items():
        torch.manual_seed(0)
        runner = SegmentRunner(TransformerXL(cfg), stream, tgt_len, train=True, clip=CLIP, autocast=dtype)
        runs[f"train/{name}"] = (lambda r=runner: r.run(steps)), batch * tgt_len * steps
    return interleaved_rates(runs, rounds)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.precision", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="segments per timed repeat")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median ratio is reported")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = native_bf16(cpu_flags())
    print(f"machine: {cpu_model()} (native bfloat16: {', '.join(native) or 'no'}), torch {torch.__version__}, "
          f"{args.threads} thread(s); config S, batch {args.batch}, segments of {args.tgt_len}, "
          f"{args.rounds} interleaved rounds")
    result = rates(XLConfig(**CONFIG_S), args.batch, args.tgt_len, args.steps, args.rounds)
    return report_ratios(result, ("train",), list(PRECISIONS))


if __name__ == "__main__":
    main()
