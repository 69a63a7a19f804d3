"""Config S side by side with a port of the 2019 code, in one process: ``python -m xl.bench.port``.

The 2019 Transformer-XL code is not an installable package. Hugging Face ``transformers`` carried a port of it
until version 4.35: ``TransfoXLLMHeadModel``. It is time-major and computes the relative attention as the 2019
code does, with einsums, the pad-and-view ``_rel_shift``, ``masked_fill`` and softmax, and projects keys and
values over memory and segment together. Both models read the same segments through the same
:class:`~xl.bench.runner.SegmentRunner`, with the same optimizer (fused AdamW). They alternate in blocks of
steps, so that the VM's drifting speed hits both alike. The figure is the median over rounds of our tokens/s
over the port's. A third part compares one-token decoding (generation):
our cached decoder against the port fed one token at a time with its memory, as the 2019 code decodes.

The port needs an old ``transformers``. Keep it out of the project's environment:

    python -m venv --system-site-packages /tmp/port
    /tmp/port/bin/pip install --no-deps "transformers==4.30.2" safetensors regex "tokenizers==0.13.3"
    /tmp/port/bin/python -m xl.bench.port --rounds 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from xl.bench.runner import SegmentRunner, one_token_decoder, token_stream
from xl.bench.shared import CONFIG_S, cpu_model
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL, XLOutput
from xl.training.services.console import plain_text

PORT_INSTALL = ('python -m venv --system-site-packages /tmp/port && /tmp/port/bin/pip install --no-deps '
                '"transformers==4.30.2" safetensors regex "tokenizers==0.13.3"')


def port_model(cfg: XLConfig) -> nn.Module:
    """The port with config S's shapes: one plain softmax, tied embedding, untied u/v per layer."""
    try:
        from transformers import TransfoXLConfig, TransfoXLLMHeadModel
    except ImportError as err:
        raise SystemExit(f"the port is missing ({err}); install it apart from the project: {PORT_INSTALL}") from None
    port_cfg = TransfoXLConfig(
        vocab_size=cfg.vocab_size, cutoffs=[], div_val=1, adaptive=False, d_model=cfg.d_model, d_embed=cfg.d_model,
        n_head=cfg.n_head, d_head=cfg.d_head, d_inner=cfg.d_inner, n_layer=cfg.n_layer, mem_len=cfg.mem_len,
        clamp_len=cfg.clamp_len, same_length=False, dropout=cfg.dropout, dropatt=cfg.dropatt,
        pre_lnorm=cfg.pre_lnorm, untie_r=True, tie_word_embeddings=True)
    return TransfoXLLMHeadModel(port_cfg)


class PortRunner(SegmentRunner):
    """The port through the same runner: it predicts x[1:] from x[:-1] itself (L - 1 targets a row)."""

    def forward(self, x: Tensor, y: Tensor | None) -> XLOutput:
        out = self.model(input_ids=x, mems=self.mems, labels=x)
        return XLOutput(logits=None, mems=out.mems, loss=out.losses.mean())


def decode_steppers(cfg: XLConfig, batch: int, attn_len: int) -> dict[str, Callable[[], None]]:
    """One-token decoding against ``attn_len`` cached positions: our decoder (cached keys, values and projected
    embeddings) and the port fed one token at a time with ``mem_len = attn_len``, which re-projects the whole
    window every token as the 2019 code does."""
    cfg = replace(cfg, mem_len=attn_len)
    ours, port = TransformerXL(cfg).eval(), port_model(cfg).eval()
    token = torch.zeros(batch, 1, dtype=torch.long)
    with torch.no_grad():
        ours_feed = one_token_decoder(ours, batch, attn_len)
        port_mems = port(input_ids=torch.randint(0, cfg.vocab_size, (batch, attn_len))).mems

    @torch.no_grad()
    def ours_step() -> None:
        ours_feed(token[:, 0])

    @torch.no_grad()
    def port_step() -> None:
        nonlocal port_mems
        port_mems = port(input_ids=token, mems=port_mems).mems

    return {"ours": ours_step, "port": port_step}


def interleaved(steps: dict[str, Callable[[], object]], tokens_per_step: int, block: int, rounds: int
                ) -> dict[str, list[float]]:
    """Tokens/s of each stepper over ``rounds`` rounds of ``block`` steps, the order flipped every round."""
    names = list(steps)
    for step in steps.values():
        for _ in range(3):
            step()
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for _ in range(block):
                steps[name]()
            rates[name].append(block * tokens_per_step / (time.perf_counter() - start))
    return rates


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.port", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--attn-len", type=int, default=512, help="cached positions for one-token decoding")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, B, L = XLConfig(**CONFIG_S), args.batch, args.tgt_len
    print(f"machine: {cpu_model()}, torch {torch.__version__}, {args.threads} threads; config S, batch {B}, "
          f"segment {L}, memory {cfg.mem_len}; {args.rounds} interleaved rounds\n")
    results = {}
    for part, block in (("train", 5), ("eval", 15), (f"one-token decoding, {args.attn_len} cached", 16)):
        torch.manual_seed(0)
        if part.startswith("one-token"):
            steps, tokens_per_step = decode_steppers(cfg, B, args.attn_len), B
        else:
            tokens, train = token_stream(cfg, B, L, 64), part == "train"
            steps = {"ours": SegmentRunner(TransformerXL(cfg), tokens, L, train=train).step,
                     "port": PortRunner(port_model(cfg), tokens, L, train=train).step}
            tokens_per_step = B * L
        rates = interleaved(steps, tokens_per_step, block, args.rounds)
        ratio = statistics.median(a / b for a, b in zip(rates["ours"], rates["port"], strict=True))
        results[part.split(",")[0]] = ratio
        print(f"{part}: ours {statistics.median(rates['ours']):,.0f} tokens/s, "
              f"port {statistics.median(rates['port']):,.0f} tokens/s, ours/port {ratio:.2f}×")
    return results


if __name__ == "__main__":
    main()
