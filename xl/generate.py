"""Sample text from a checkpoint: ``python -m xl.generate ckpt=PATH prompt="..." [key=value ...]`` (Hydra).

Decoding feeds one token per step against a cache. In Transformer-XL keys and values carry no position
(positions enter only through the relative term), so the projected keys/values of the cached states stay
valid as the window slides, and the projected embeddings of distances 0 … W are the same at every step:
both are computed once (:class:`IncrementalDecoder`), unlike the 2019 code, which re-projects the whole
window for every token. The optional ``warmup`` text is read first to fill the memory (the "cold start" of
the seed chapter on the limits of recurrent memory); the prompt follows, then the samples.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import Tensor

from xl.build import ConfigError, build_datamodule
from xl.checkpoint import Checkpoint
from xl.config import entry_point
from xl.model import TransformerXL, check_context, sinusoid

log = logging.getLogger("generate")


class IncrementalDecoder:
    """Keys/values of the last ``window`` positions, the projected relative embeddings and the stacked
    query/key/value weight, per layer. All are computed from the weights at construction: build a new
    decoder after changing them."""

    def __init__(self, model: TransformerXL, batch_size: int, window: int, clamp_len: int = -1) -> None:
        check_context(window, clamp_len, False)
        if window < 1:
            raise ValueError("generation needs a memory: set mem_len >= 1")
        self.model, self.window = model.eval(), window
        cfg, p = model.config, model.anchor
        distances = torch.arange(window, -1, -1, device=p.device)  # window .. 0: the longest key row
        if clamp_len > 0:
            distances = distances.clamp(max=clamp_len)
        pos_emb = sinusoid(distances, cfg.d_model).to(p.dtype)
        with torch.no_grad():
            # [H, D, W+1] per layer; a step with M cached keys uses the last M+1 columns (distances M .. 0).
            # Multiplied by the attention scale once here, so that no step scales its position scores.
            self.r = [(layer.attn.r_net(pos_emb) * layer.attn.scale).view(window + 1, cfg.n_head, cfg.d_head)
                      .permute(1, 2, 0) for layer in model.layers]
            self.qkv_weight = [layer.attn.qkv_weight() for layer in model.layers]
        # Keys/values live in buffers twice the window long: appending writes in place, and only when a
        # buffer is full is its window moved back to the front (once every `window` steps).
        shape = (batch_size, cfg.n_head, 2 * window, cfg.d_head)
        self.k_buf = [p.new_zeros(shape) for _ in range(cfg.n_layer)]
        self.v_buf = [p.new_zeros(shape) for _ in range(cfg.n_layer)]
        self.start = self.end = 0

    def _make_room(self, t: int) -> None:
        """Ensure ``t`` free slots after the window, moving the window to the front when the buffer is full."""
        if self.end + t > self.k_buf[0].size(2):
            keep = min(self.end - self.start, self.window - t)
            for buf in self.k_buf + self.v_buf:
                buf[:, :, :keep] = buf[:, :, self.end - keep:self.end].clone()
            self.start, self.end = 0, keep

    def _advance(self, t: int) -> None:
        self.end += t
        self.start = max(self.start, self.end - self.window)

    @torch.no_grad()
    def prefill(self, tokens: Tensor, seg_len: int) -> Tensor:
        """Read ``tokens`` [B, T] segment by segment (memory ``window``); return the last position's logits."""
        mems, kv, logits = None, None, None
        for start in range(0, tokens.size(1), seg_len):
            out = self.model(tokens[:, start:start + seg_len], mems, mem_len=self.window, cache_kv=True, kv=kv)
            mems, kv, logits = out.mems, out.kv, out.logits[:, -1]
        # The cache starts as the final memory's keys and values (the last `window` positions read).
        self.start = self.end = 0
        for n, (k, v) in enumerate(kv):
            self.k_buf[n][:, :, :k.size(2)] = k
            self.v_buf[n][:, :, :v.size(2)] = v
        self._advance(kv[0][0].size(2))
        return logits

    @torch.no_grad()
    def step(self, token: Tensor) -> Tensor:
        """Feed one token per row [B]; return next-token logits [B, vocab]."""
        model = self.model
        h = model.embed(token[:, None]) * model.emb_scale
        self._make_room(1)
        m, window = self.end - self.start, slice(self.start, self.end + 1)  # the cache plus the new slot
        for n, layer in enumerate(model.layers):
            h = layer.attn.step(h, self.k_buf[n][:, :, window], self.v_buf[n][:, :, window],
                                self.r[n][..., self.window - m:], self.qkv_weight[n])
            h = layer.ff.step(h)
        self._advance(1)
        return model.head(model.final_norm(h))[:, -1]


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> Tensor:
    """Greedy at temperature 0; else sampling, restricted to the top-k and to the top-p probability mass."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def generate(model: TransformerXL, prompt: Tensor, max_new_tokens: int, window: int, *, seg_len: int = 128,
             clamp_len: int = -1, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0) -> Tensor:
    """Continue ``prompt`` [B, T] by ``max_new_tokens`` tokens with the memory carried; returns the new tokens."""
    decoder = IncrementalDecoder(model, prompt.size(0), window, clamp_len)
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    logits = decoder.prefill(prompt, seg_len)
    new = []
    for _ in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, generator)
        new.append(token)
        logits = decoder.step(token)
    return torch.stack(new, dim=1) if new else prompt[:, :0]


@entry_point("generate")
def main(cfg: DictConfig) -> None:
    tokenizer = build_datamodule(cfg).tokenizer
    model = Checkpoint.open(cfg.ckpt, setting="ckpt").load_model(tokenizer.vocab_size)
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1 or cfg.top_k < 0 or cfg.max_new_tokens < 0:
        raise ConfigError("temperature must be >= 0, top_p in (0, 1], top_k and max_new_tokens >= 0")
    warmup = Path(cfg.warmup).read_text() if cfg.warmup and Path(cfg.warmup).is_file() else (cfg.warmup or "")
    text = warmup + cfg.prompt
    if not text:
        raise ConfigError("give a prompt (prompt=\"...\") or a warm-up text (warmup=PATH or text)")
    window = cfg.mem_len or model.config.mem_len
    ids = torch.as_tensor(tokenizer.encode(text), dtype=torch.long)[None]
    try:
        new = generate(model, ids, cfg.max_new_tokens, window, seg_len=cfg.seg_len, clamp_len=cfg.clamp_len,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed)
    except ValueError as err:  # the decoder's context checks name mem_len / clamp_len
        raise ConfigError(str(err)) from err
    print(cfg.prompt + tokenizer.decode(new[0].numpy()))


if __name__ == "__main__":
    main()
