"""The footprint command: the memory cache's footprint (a reference table, one cache, its parameters), or with
``--run`` and a training command's overrides the whole estimate of the run that they would start, against this
machine (the formula: :mod:`xl.device.footprint`)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from xl.device.footprint import (
    CacheFootprint,
    MiB,
    available_memory,
    cache_footprint,
    describe_run,
    segment_activation_bytes,
)
from xl.model.config import XLConfig
from xl.model.transformer import count_parameters


def format_table(rows: list[CacheFootprint], params: list[int | None] | None = None) -> str:
    header = f"{'config':<32} {'elements':>14} {'MiB':>10} {'GiB':>7}"
    if params is not None:
        header += f" {'params':>12}"
    lines = [header, "-" * len(header)]
    for i, r in enumerate(rows):
        slots = f"{r.mem_len}m+{r.slots}s" if r.slots else f"{r.mem_len}m"
        name = f"{slots} × {r.d_model}d × {r.n_layer}L × {r.batch_size}b {str(r.dtype).removeprefix('torch.')}"
        line = f"{name:<32} {r.elements:>14,} {r.mib:>10.1f} {r.gib:>7.2f}"
        if params is not None:
            line += f" {params[i]:>12,}" if params[i] is not None else f" {'':>12}"
        lines.append(line)
    return "\n".join(lines)


# The reference table's configurations (mem_len, d_model, n_layer, batch): 12 × 768 to 36 × 2048, 512 to 2,048
# positions of memory.
SEED_CONFIGS = [(512, 768, 12, 8), (512, 1024, 24, 8), (1024, 1024, 24, 8), (2048, 2048, 36, 4)]


def print_run(overrides: list[str]) -> None:
    """The estimate of the training run that ``python train.py OVERRIDES`` would start, against this machine."""
    from xl.config.compose import compose, exit_on_user_error
    from xl.config.machine import check_device, run_estimate

    with exit_on_user_error():
        cfg = compose("config", overrides)
        cuda = check_device(cfg)
        footprint, processes = run_estimate(cfg)
    print(describe_run(footprint, *available_memory(cuda), processes))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Memory-cache footprint of Transformer-XL (and parameter count), "
                                                 "or with --run the whole estimate of a training run.")
    parser.add_argument("--run", nargs="*", metavar="KEY=VALUE",
                        help="estimate the run of `python train.py KEY=VALUE ...` (the estimate train.py checks)")
    parser.add_argument("--mem-len", type=int)
    parser.add_argument("--slots", type=int, default=0,
                        help="vectors per layer a memory keeps beyond mem_len (compressed slots, Rae et al., 2019)")
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="the cache's storage dtype (memory.mem_dtype); default: float32 and bfloat16 side by side")
    parser.add_argument("--n-head", type=int, help="with --d-head, --d-inner and --vocab: also count parameters")
    parser.add_argument("--d-head", type=int)
    parser.add_argument("--d-inner", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--grad-segments", type=int, default=1,
                        help="memory.grad_segments: with the full shape and --tgt-len, also the activations a "
                             "window of this many training segments holds (measured by running one segment on the CPU)")
    parser.add_argument("--tgt-len", type=int)
    args = parser.parse_args(argv)
    if args.run is not None:
        print_run(args.run)
        return
    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    shape = (args.mem_len, args.d_model, args.n_layer)
    if all(v is None for v in shape):
        rows = [cache_footprint(*c, dtype=d) for c in SEED_CONFIGS for d in (torch.float32, torch.bfloat16)]
        print(format_table(rows))
        return
    if any(v is None for v in shape):
        parser.error("give --mem-len, --d-model and --n-layer together (or none for the reference table)")
    params: list[Any] | None = None
    if None not in (args.n_head, args.d_head, args.d_inner, args.vocab):
        cfg = XLConfig(vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                       d_head=args.d_head, d_inner=args.d_inner, mem_len=args.mem_len)
        params = [count_parameters(cfg)] + [None] * (len(dtypes) - 1)
    print(format_table([cache_footprint(*shape, args.batch, dtype, args.slots) for dtype in dtypes], params))
    if params is not None and args.tgt_len:
        per = segment_activation_bytes(cfg, args.batch, args.tgt_len) / MiB
        k = args.grad_segments
        print(f"training activations: {per:.1f} MiB per segment (float32); memory.grad_segments={k} keeps {k} "
              f"segments' activations until the window's backward: {k * per:.1f} MiB")


if __name__ == "__main__":
    main()
