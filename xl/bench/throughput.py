"""Throughput of the model on this machine: ``python -m xl.bench``.

Prints training and evaluation tokens/s with the memory carried between segments (the way the
model is used), and the cost of our attention sublayer (SDPA forward; on CPU with gradients, the
hand-written backward of ``TrainingAttentionCPU``) against the explicit-softmax formulation of the
2019 code, so that a speed claim can be re-checked with one command. Warm-up steps are excluded;
every figure is the median of several timed repeats because a small shared CPU is noisy (±10% run
to run).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import Tensor

from xl.bench.runner import SegmentRunner, token_stream
from xl.bench.shared import CONFIG_S, cpu_model, median_rate
from xl.model.attention import RelMultiHeadAttention
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.services.console import plain_text


def train_rate(cfg: XLConfig, batch: int, tgt_len: int, steps: int, warmup: int, repeats: int) -> float:
    """Tokens/s of forward (memory carried) + backward + fused AdamW step + zero_grad."""
    torch.manual_seed(0)
    runner = SegmentRunner(TransformerXL(cfg), token_stream(cfg, batch, tgt_len, 64), tgt_len, train=True)
    return median_rate(lambda: runner.run(steps), steps * batch * tgt_len, warmup, repeats)


def eval_rate(cfg: XLConfig, batch: int, tgt_len: int, steps: int, warmup: int, repeats: int) -> float:
    """Tokens/s of the evaluation loop: eval mode, no_grad, memory and its keys/values carried, loss computed."""
    torch.manual_seed(0)
    runner = SegmentRunner(TransformerXL(cfg), token_stream(cfg, batch, tgt_len, 64), tgt_len)
    return median_rate(lambda: runner.run(steps), steps * batch * tgt_len, warmup, repeats)


def shift_2019(x: Tensor) -> Tensor:
    """The 2019 code's _rel_shift: zero column in front, view as [K+1, L], drop the first row."""
    *lead, q_len, k_len = x.shape
    zero_pad = x.new_zeros(*lead, q_len, 1)
    padded = torch.cat([zero_pad, x], dim=-1).view(*lead, k_len + 1, q_len)
    return padded[..., 1:, :].reshape_as(x)


def explicit_attention(attn: RelMultiHeadAttention, h: Tensor, mem: Tensor, pos_emb: Tensor, hidden: Tensor) -> Tensor:
    """The same sublayer written as the 2019 code does: full score matrix, masked_fill, softmax, matmul.

    Same weights as ``attn``; ``hidden`` is the boolean [L, M+L] mask (True = may not look).
    """
    B, L, _ = h.shape
    H, D = attn.n_head, attn.d_head
    cat = torch.cat([mem, h], dim=1) if mem.size(1) else h
    if attn.pre_lnorm:
        cat = attn.layer_norm(cat)
    K = cat.size(1)
    q = attn.q_net(cat[:, -L:]).view(B, L, H, D).transpose(1, 2)  # [B, H, L, D]
    k, v = attn.kv_net(cat).view(B, K, 2, H, D).permute(2, 0, 3, 1, 4)  # 2 × [B, H, K, D]
    r = attn.r_net(pos_emb).view(K, H, D).permute(1, 2, 0)  # [H, D, K]
    ac = torch.matmul(q + attn.r_w_bias[:, None], k.transpose(-1, -2))
    bd = shift_2019(torch.matmul(q + attn.r_r_bias[:, None], r))
    scores = (ac + bd).mul_(attn.scale).masked_fill_(hidden, float("-inf"))
    prob = F.dropout(scores.softmax(-1), attn.dropatt, attn.training)
    out = torch.matmul(prob, v).transpose(1, 2).reshape(B, L, H * D)
    out = attn.drop(attn.o_net(out))
    return h + out if attn.pre_lnorm else attn.layer_norm(h + out)


def attention_ratios(cfg: XLConfig, batch: int, tgt_len: int, steps: int, warmup: int,
                     repeats: int) -> tuple[float, float, float]:
    """(max |ours − explicit|, explicit/ours time forward, explicit/ours time forward+backward).

    One sublayer with a full memory (M = mem_len) in training mode with dropout off, so both paths
    compute the same function and can be checked against each other before they are timed.
    """
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(**{**cfg.to_dict(), "dropout": 0.0, "dropatt": 0.0})).train()
    attn = model.layers[0].attn
    M, L, d = cfg.mem_len, tgt_len, cfg.d_model
    h = torch.randn(batch, L, d, requires_grad=True)
    mem = torch.randn(batch, M, d)
    pos_emb, mask = model._context(L, M, cfg.clamp_len, M if cfg.same_length else None)
    hidden = mask.isinf()
    paths = {
        "ours": lambda: attn(h, mem, pos_emb, mask)[0],
        "explicit": lambda: explicit_attention(attn, h, mem, pos_emb, hidden),
    }

    with torch.no_grad():
        diff = (paths["ours"]() - paths["explicit"]()).abs().max().item()
    grads = {}
    for name, f in paths.items():
        h.grad = None
        f().square().sum().backward()
        grads[name] = h.grad.clone()
    diff = max(diff, (grads["ours"] - grads["explicit"]).abs().max().item())
    if not diff < 1e-4:
        raise AssertionError(f"our attention and the explicit formulation disagree by {diff:.3g}")

    def forward(f: Callable[[], Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                for _ in range(steps):
                    f()
        return run

    def backward(f: Callable[[], Tensor]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                f().sum().backward()
        return run

    # Interleave the two paths repeat by repeat so that a burst of load hits both alike.
    fwd: dict[str, list[float]] = {n: [] for n in paths}
    bwd: dict[str, list[float]] = {n: [] for n in paths}
    for _ in range(repeats):
        for name, f in paths.items():
            fwd[name].append(1.0 / median_rate(forward(f), 1.0, warmup if not fwd[name] else 0, 1))
            bwd[name].append(1.0 / median_rate(backward(f), 1.0, warmup if not bwd[name] else 0, 1))
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in (("fwd", fwd), ("bwd", bwd))}
    return diff, med["fwd"]["explicit"] / med["fwd"]["ours"], med["bwd"]["explicit"] / med["bwd"]["ours"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xl.bench", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--steps", type=int, default=10, help="segments per timed repeat")
    p.add_argument("--warmup", type=int, default=3, help="untimed repeats (of --steps segments) before timing")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--only", choices=("train", "eval", "attn"), action="append",
                   help="run only these parts (repeatable); default all")
    p.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                   help="override an XLConfig field of config S, e.g. --set mem_len=256")
    return p.parse_args(argv)


def build_config(overrides: list[str]) -> XLConfig:
    types = {f.name: f.type for f in fields(XLConfig)}
    values: dict = dict(CONFIG_S)
    for item in overrides:
        name, _, raw = item.partition("=")
        if name not in types:
            raise SystemExit(f"unknown XLConfig field {name!r}; valid: {sorted(types)}")
        kind = types[name] if isinstance(types[name], str) else types[name].__name__
        if kind == "bool":
            values[name] = raw.lower() in ("1", "true", "yes")
        else:
            values[name] = float(raw) if kind == "float" else int(raw)
    return XLConfig(**values)


def main(argv: list[str] | None = None) -> None:
    """The command (``xl-bench``): the table only (a console script hands what its function returns to sys.exit,
    which would print it)."""
    measure(argv)


def measure(argv: list[str] | None = None) -> dict[str, float]:
    """Print the table of the parts asked for, and return their figures."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = build_config(args.set)
    parts = args.only or ["train", "eval", "attn"]
    B, L = args.batch, args.tgt_len
    shape = (f"n_layer={cfg.n_layer} n_head={cfg.n_head} d_model={cfg.d_model} d_head={cfg.d_head} "
             f"d_inner={cfg.d_inner} vocab={cfg.vocab_size} mem_len={cfg.mem_len} tgt_len={L} batch={B}")
    print(f"machine : {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"config  : {shape} dropout={cfg.dropout}")
    print(f"timing  : {args.warmup} warm-up + median of {args.repeats} × {args.steps} segments\n")
    results: dict[str, float] = {}
    rows: list[tuple[str, str]] = []
    if "train" in parts:
        results["train_tok_s"] = train_rate(cfg, B, L, args.steps, args.warmup, args.repeats)
        rows.append(("train tokens/s (fwd+bwd+AdamW, memory carried)", f"{results['train_tok_s']:,.0f}"))
    if "eval" in parts:
        results["eval_tok_s"] = eval_rate(cfg, B, L, args.steps, args.warmup, args.repeats)
        rows.append(("eval tokens/s (no_grad, memory carried)", f"{results['eval_tok_s']:,.0f}"))
    if "attn" in parts:
        diff, fwd, bwd = attention_ratios(cfg, B, L, args.steps, args.warmup, args.repeats)
        results.update(attn_max_diff=diff, attn_fwd_ratio=fwd, attn_fwd_bwd_ratio=bwd)
        rows.append(("attention sublayer explicit/ours time, forward", f"{fwd:.2f}×"))
        rows.append(("attention sublayer explicit/ours time, fwd+bwd", f"{bwd:.2f}×"))
        rows.append(("  (max |ours − explicit| over output and grad)", f"{diff:.1e}"))
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>10}")
    print(f"{'-' * width}  {'-' * 10}")
    for name, value in rows:
        print(f"{name:<{width}}  {value:>10}")
    return results


if __name__ == "__main__":
    main()
