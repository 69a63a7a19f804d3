"""How much the memory cache costs: mem_len × d_model × n_layer × batch × bytes per element.

One cached tensor per layer holds that layer's input for the last ``mem_len`` positions, so the
cache is exactly ``n_layer`` tensors of ``[batch, mem_len, d_model]`` (the seed chapter on the
limits of recurrent memory gives the same product). Run ``python -m xl.footprint`` for a table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

MiB = 1024 * 1024


@dataclass(frozen=True)
class CacheFootprint:
    mem_len: int
    d_model: int
    n_layer: int
    batch_size: int
    dtype: torch.dtype

    @property
    def elements(self) -> int:
        return self.mem_len * self.d_model * self.n_layer * self.batch_size

    @property
    def bytes(self) -> int:
        return self.elements * torch.empty((), dtype=self.dtype).element_size()

    @property
    def mb(self) -> float:
        """Mebibytes (2**20 bytes), the unit of the seed's table."""
        return self.bytes / MiB

    @property
    def gb(self) -> float:
        return self.bytes / MiB / 1024


def cache_footprint(
    mem_len: int, d_model: int, n_layer: int, batch_size: int, dtype: torch.dtype = torch.float32
) -> CacheFootprint:
    return CacheFootprint(mem_len, d_model, n_layer, batch_size, dtype)


def format_table(rows: list[CacheFootprint], params: list[int | None] | None = None) -> str:
    header = f"{'config':<32} {'elements':>14} {'MB':>10} {'GB':>7}"
    if params is not None:
        header += f" {'params':>12}"
    lines = [header, "-" * len(header)]
    for i, r in enumerate(rows):
        name = f"{r.mem_len}m × {r.d_model}d × {r.n_layer}L × {r.batch_size}b {str(r.dtype).removeprefix('torch.')}"
        line = f"{name:<32} {r.elements:>14,} {r.mb:>10.1f} {r.gb:>7.2f}"
        if params is not None:
            line += f" {params[i]:>12,}" if params[i] is not None else f" {'':>12}"
        lines.append(line)
    return "\n".join(lines)


# The seed chapter's own table (mem_len, d_model, n_layer, batch).
SEED_CONFIGS = [(512, 768, 12, 8), (512, 1024, 24, 8), (1024, 1024, 24, 8), (2048, 2048, 36, 4)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Memory-cache footprint of Transformer-XL (and parameter count).")
    parser.add_argument("--mem-len", type=int)
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
    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    shape = (args.mem_len, args.d_model, args.n_layer)
    if all(v is None for v in shape):
        rows = [cache_footprint(*c, dtype=d) for c in SEED_CONFIGS for d in (torch.float32, torch.bfloat16)]
        print(format_table(rows))
        return
    if any(v is None for v in shape):
        parser.error("give --mem-len, --d-model and --n-layer together (or none for the reference table)")
    params = None
    if None not in (args.n_head, args.d_head, args.d_inner, args.vocab):
        from xl.model import XLConfig, count_parameters

        cfg = XLConfig(vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                       d_head=args.d_head, d_inner=args.d_inner, mem_len=args.mem_len)
        params = [count_parameters(cfg)] + [None] * (len(dtypes) - 1)
    print(format_table([cache_footprint(*shape, args.batch, dtype) for dtype in dtypes], params))
    if params is not None and args.tgt_len:
        from xl.lit import segment_activation_bytes

        per = segment_activation_bytes(cfg, args.batch, args.tgt_len) / MiB
        k = args.grad_segments
        print(f"training activations: {per:.1f} MB per segment (float32); memory.grad_segments={k} keeps {k} "
              f"segments' activations until the window's backward: {k * per:.1f} MB")


if __name__ == "__main__":
    main()
