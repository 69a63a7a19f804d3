"""Training throughput, peak memory and model FLOPs utilisation on an accelerator: ``python -m xl.bench.gpu``.

Runs the training step as :class:`xl.training.loop.module.XLLitModule` does (:class:`xl.bench.runner.SegmentRunner`:
forward with the memory carried, backward, gradient clipping, AdamW) for one of the paper's experiment configs or config
S, in bf16 autocast by default, optionally under ``torch.compile``. Model FLOPs are counted exactly for the shapes run
(see :func:`model_flops`; a test checks the count against ``torch.utils.flop_counter``), and MFU divides the achieved
FLOP rate by the device's dense bf16 peak (a small table, or ``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import torch
from omegaconf import DictConfig

from xl.bench.runner import SegmentRunner, token_stream
from xl.bench.shared import CONFIG_S
from xl.config.compose import compose
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.services.console import plain_text

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None}  # precision → autocast dtype
CLIP = 0.25  # trainer.gradient_clip_val, the paper's clipping

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, in TFLOP/s; first match wins.
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
                    ("L4", 121.0), ("A10", 125.0), ("RTX 4090", 165.0), ("V100", 125.0)]


def model_flops(cfg: XLConfig, batch: int, tgt_len: int, mem_len: int, train: bool) -> int:
    """FLOPs (2 per multiply-add) of one segment's step with ``mem_len`` cached positions; plain softmax head.

    Per layer: queries over L positions, keys/values over K = M + L, the relative embeddings projected once
    for the batch, position scores (over K + 1 columns: the shift reads one zero column past distance 0), content
    scores and the weighted sum over all K keys (on the GPU the causal mask is applied, not skipped), output
    projection and feed-forward. Training is three times the forward, less the input gradients nobody needs: of
    the position projection (its input is a constant) and of the memory's key/value projection (the memory is
    detached).
    """
    if cfg.cutoffs:
        raise ValueError("model_flops counts the plain softmax head only; set cutoffs=() for the benchmark")
    B, L, M, d, inner, di = batch, tgt_len, mem_len, cfg.d_model, cfg.n_head * cfg.d_head, cfg.d_inner
    K = M + L
    per_row = 2 * L * d * inner + 2 * K * d * 2 * inner + 2 * L * (K + 1) * inner + 2 * 2 * L * K * inner \
        + 2 * L * inner * d + 2 * 2 * L * d * di
    position_projection = 2 * K * d * inner
    forward = cfg.n_layer * (B * per_row + position_projection) + B * 2 * L * d * cfg.vocab_size
    memory_kv_input_grad = B * 2 * M * 2 * inner * d
    return 3 * forward - cfg.n_layer * (position_projection + memory_kv_input_grad) if train else forward


def peak_tflops(device: torch.device) -> tuple[str, float | None]:
    """The device's name and dense bf16 peak, if it is in the table."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def experiment_config(name: str) -> DictConfig | None:
    """The composed config of a conf/experiment overlay (``train.py experiment=NAME``), None for ``S``."""
    return None if name == "S" else compose("config", [f"experiment={name}"])


def experiment_shape(name: str, composed: DictConfig | None = None) -> tuple[dict, int, int]:
    """(XLConfig fields with mem_len, per-device batch, tgt_len) of a conf/experiment overlay (``composed``: its
    config from :func:`experiment_config`, composed here if not given), or of config S (``S``: the CPU benchmark's
    model, batch 8, segments of 128). The head has 256 symbols, or a word vocabulary's ``max_size`` and its two
    special symbols where the experiment caps one (one softmax: the cutoffs are fitted to the data, which is not
    read here)."""
    if name == "S":
        return dict(CONFIG_S), 8, 128
    from xl.config.rules import model_values

    cfg = composed if composed is not None else experiment_config(name)
    words = (cfg.data.get("tokenizer_kwargs") or {}).get("max_size")
    return model_values(cfg, 256 if words is None else words + 2), cfg.data.batch_size, cfg.data.tgt_len


def run_estimate(cfg: DictConfig, fields: dict) -> tuple[int, int, str]:
    """For ``--estimate``, from an experiment's composed config and its XLConfig ``fields``: its steps
    (``trainer.max_steps``), the positions its memory holds beyond the cache (a retrieval store's entries:
    :meth:`MemoryConfig.held`) filled before the timed steps (all, or the last curriculum stage's sample length if
    fewer: a memory holds one document), and that in words."""
    from xl.config.curriculum import stages
    from xl.data.babilong.lengths import parse_length
    from xl.model import memory_settings

    steps = int(cfg.trainer.max_steps)
    mem_len = fields["mem_len"]
    beyond = max(memory_settings.variant(fields.get("memory")).held(mem_len, 1, fields["n_layer"])) - mem_len
    if beyond <= 0 or math.isinf(beyond):  # a recurrent memory's reach has no bound, and nothing to fill
        return steps, 0, "no memory to fill beyond the cache"
    last = stages(cfg.get("curriculum") or [])
    length = parse_length(last[-1].data["length"]) if last else parse_length(cfg.data.get("length", 0) or 0)
    fill = min(beyond, length) if length else beyond
    return steps, fill, f"the memory holding {fill:,} positions beyond the cache, as at the last stage's length: " \
                        "an upper bound"


def run(cfg: XLConfig, batch: int, tgt_len: int, device: torch.device, dtype: torch.dtype | None, compile: bool,
        steps: int, warmup: int, peak: float | None, fill: int = 0) -> dict[str, float]:
    """Time ``steps`` training steps after ``warmup`` (which also fill the memory, and ``fill`` more positions: a
    retrieval store's entries); peak memory, MFU, last loss."""
    torch.manual_seed(0)
    model = TransformerXL(cfg).to(device)
    if compile:
        from xl.training.build import compile_model

        compile_model(model)
    tokens = token_stream(cfg, batch, tgt_len, 8).to(device)
    runner = SegmentRunner(model, tokens, tgt_len, train=True, clip=CLIP, autocast=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    runner.run(max(warmup, (cfg.mem_len + fill) // tgt_len + 1))  # the memory is full from here on
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    last = runner.run(steps)
    sync()
    seconds = (time.perf_counter() - start) / steps
    flops = model_flops(cfg, batch, tgt_len, cfg.mem_len, train=True)
    return {
        "tokens_per_s": batch * tgt_len / seconds,
        "step_ms": seconds * 1e3,
        "tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / (peak * 1e12) if peak else float("nan"),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"),
        "loss": last.loss.item(),
    }


def measure(experiment: str, precision: str, device: torch.device, steps: int, warmup: int,
            batch: int | None = None, overrides: Sequence[str] = (), compile: bool = False,
            peak: float | None = None, fill: int = 0, shape: tuple[dict, int, int] | None = None,
            ) -> tuple[XLConfig, int, int, dict[str, float]]:
    """(config, batch, tgt_len, :func:`run`'s figures) for an experiment name and ``FIELD=VALUE`` overrides;
    ``shape``: its :func:`experiment_shape` if already known."""
    fields, default_batch, tgt_len = shape if shape is not None else experiment_shape(experiment)
    fields = dict(fields)
    for item in overrides:
        key, _, value = item.partition("=")
        fields[key] = int(value)
    cfg = XLConfig.from_dict(fields)
    batch = batch or default_batch
    return cfg, batch, tgt_len, run(cfg, batch, tgt_len, device, AUTOCAST[precision], compile, steps, warmup, peak,
                                    fill)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.gpu", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--experiment", default="enwik8_base",
                   help="a character-level conf/experiment config (model, batch, lengths), with a 256-symbol head, "
                        "or S (config S of python -m xl.bench)")
    p.add_argument("--batch", type=int, help="per-device batch (default: the experiment's)")
    p.add_argument("--precision", choices=tuple(AUTOCAST), default="bf16-mixed")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, if not in the table")
    p.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                   help="override an integer XLConfig field, e.g. --set n_layer=2 (smoke runs)")
    p.add_argument("--estimate", action="store_true",
                   help="also the experiment's time: its trainer.max_steps at the measured rate, its retrieval "
                        "stores filled first as at its last curriculum stage")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name, peak = peak_tflops(device)
    if args.estimate and args.experiment == "S":
        p.error("--estimate needs an experiment's trainer.max_steps; name a conf/experiment config")
    composed = experiment_config(args.experiment)
    shape = experiment_shape(args.experiment, composed)
    fill, estimate = 0, None
    if args.estimate:
        steps, fill, filled = run_estimate(composed, shape[0])
    cfg, batch, tgt_len, r = measure(args.experiment, args.precision, device, args.steps, args.warmup, args.batch,
                                     args.set, args.compile, args.peak_tflops or peak, fill, shape)
    if args.estimate:
        tokens = steps * batch * tgt_len
        r["estimate_h"] = tokens / r["tokens_per_s"] / 3600
        estimate = (f"estimate : {steps:,} steps of {batch} x {tgt_len} tokens: "
                    f"{r['estimate_h']:.1f} h at {r['tokens_per_s']:,.0f} tokens/s, {filled}")
    print(f"device   : {name}, torch {torch.__version__}, {args.precision}, compile={args.compile}")
    print(f"config   : {args.experiment} ({cfg.n_layer} layers, d_model {cfg.d_model}), batch {batch}, "
          f"tgt_len {tgt_len}, mem_len {cfg.mem_len}")
    print(f"tokens/s : {r['tokens_per_s']:,.0f}   step {r['step_ms']:.1f} ms")
    print(f"TFLOP/s  : {r['tflops']:.1f}   MFU {r['mfu']:.1%}   peak memory {r['peak_gib']:.2f} GiB")
    if estimate:
        print(estimate)
    return r


if __name__ == "__main__":
    main()
