"""Evaluation speed, Transformer-XL against the vanilla transformer: ``python -m xl.bench.evalspeed``.

The paper's comparison (Dai et al., 2019, section 4, Table 9): at the same attention length A,
the vanilla model predicts each token with a fresh forward over the A tokens before it, while
Transformer-XL predicts a whole segment at once against its cached memory. Both are timed here
through the code ``python -m xl.evaluate`` runs (the model's forward with the memory and its keys/values
carried, read by :class:`xl.bench.runner.SegmentRunner`, and :func:`xl.evaluation.vanilla_nll`), on config S
with random weights (speed does not depend on them).

Reading of "attention length": Transformer-XL runs with ``mem_len = A`` and ``same_length``, so that
every scored token attends over exactly A keys, the same context as a vanilla window of A; the
segment length (``--tgt-len``, default 128 as in the released enwik8-large evaluation script) is how
many tokens one forward predicts. The one-token column is generation's decoder
(:func:`xl.bench.runner.one_token_decoder`): one token per step against cached keys, values and projected
relative embeddings, as the paper's evaluation would run with segments of one token.
"""

from __future__ import annotations

import argparse

import torch

from xl.bench.runner import SegmentRunner, one_token_decoder
from xl.bench.shared import CONFIG_S, cpu_model, median_rate
from xl.evaluation import vanilla_nll
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.services.console import plain_text


def xl_seconds_per_token(model: TransformerXL, attn_len: int, tgt_len: int, batch: int, repeats: int) -> float:
    """One segment of ``tgt_len`` tokens per stream against a full memory of ``attn_len``, loss included."""
    cfg = model.config
    stream = torch.randint(0, cfg.vocab_size, (batch, 4 * tgt_len + 1))
    runner = SegmentRunner(model, stream, tgt_len, mem_len=attn_len, same_length=True)
    runner.mems = [torch.randn(batch, attn_len, cfg.d_model) for _ in range(cfg.n_layer)]  # full from the start
    # The untimed first segment projects the memory's keys/values once; from there they are carried.
    return 1.0 / median_rate(runner.step, batch * tgt_len, warmup=1, repeats=repeats)


def decode_seconds_per_token(model: TransformerXL, attn_len: int, batch: int, steps: int, repeats: int) -> float:
    """One token per step against a full window of ``attn_len`` cached positions (the window slides)."""
    step = one_token_decoder(model, batch, attn_len)
    token = torch.zeros(batch, dtype=torch.long)

    def run() -> None:
        for _ in range(steps):
            step(token)

    return 1.0 / median_rate(run, batch * steps, warmup=1, repeats=repeats)


def vanilla_seconds_per_token(model: TransformerXL, attn_len: int, positions: int, batch: int, repeats: int) -> float:
    """``positions`` predictions per stream, each a fresh forward over the ``attn_len`` tokens before it."""
    cfg = model.config
    context = torch.randint(0, cfg.vocab_size, (batch, attn_len - 1))
    x, y = torch.randint(0, cfg.vocab_size, (2, batch, positions))

    def run() -> None:
        vanilla_nll(model, context, x, y, attn_len, cfg.clamp_len)

    return 1.0 / median_rate(run, batch * positions, warmup=1, repeats=repeats)


def measure(attn_lens: list[int], tgt_len: int, batch: int, positions: int, repeats: int) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(**{**CONFIG_S, "mem_len": max(attn_lens)})).eval()  # eval: no dropout
    rows = []
    with torch.no_grad():
        for attn_len in attn_lens:
            xl = xl_seconds_per_token(model, attn_len, tgt_len, batch, repeats)
            one = decode_seconds_per_token(model, attn_len, batch, 64, repeats)  # 64 steps: a timing well above noise
            vanilla = vanilla_seconds_per_token(model, attn_len, positions, batch, repeats)
            rows.append({"attn_len": attn_len, "xl_us": xl * 1e6, "one_token_us": one * 1e6,
                         "vanilla_us": vanilla * 1e6, "speedup": vanilla / xl, "one_token_speedup": vanilla / one})
    return rows


def format_table(rows: list[dict[str, float]]) -> str:
    lines = [f"{'attn_len':>8} {'XL µs/token':>12} {'one-token µs/token':>19} {'vanilla µs/token':>17} "
             f"{'speed-up':>9} {'one-token speed-up':>19}"]
    lines += [f"{r['attn_len']:>8} {r['xl_us']:>12,.1f} {r['one_token_us']:>19,.1f} {r['vanilla_us']:>17,.1f} "
              f"{r['speedup']:>8,.1f}× {r['one_token_speedup']:>18,.1f}×" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.evalspeed", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--attn-lens", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--tgt-len", type=int, default=128, help="Transformer-XL segment: tokens predicted per forward")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--positions", type=int, default=4, help="vanilla predictions (window forwards) per repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"config S (n_layer 4, n_head 4, d_model 256, d_head 64, d_inner 1024, vocab 256), random weights, "
          f"batch {args.batch}; Transformer-XL: segment {args.tgt_len}, mem_len = attn_len, same_length; "
          f"vanilla: one window forward per token; median of {args.repeats}\n")
    rows = measure(args.attn_lens, args.tgt_len, args.batch, args.positions, args.repeats)
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
