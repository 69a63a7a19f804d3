"""The sampling behind the generate command (:mod:`xl.generate`, whose help describes its settings): the
incremental decoder's sampling loop, its window, the warm-up and the prompt's tokens."""


from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch import Tensor

from xl.config.rules import ConfigError
from xl.data.sources import decode
from xl.data.tokenizers import Tokenizer, WordTokenizer
from xl.model import memory_settings
from xl.model.memory_settings import MemoryContext
from xl.model.transformer import TransformerXL
from xl.training.build import build_datamodule
from xl.training.checkpoints.checkpoint import Checkpoint
from xl.training.runs import use_run_data
from xl.training.services.console import errors_logged, quiet_warnings


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


def generate(model: TransformerXL, prompt: Tensor, max_new_tokens: int, window: int | None = None, *,
             seg_len: int = 128, clamp_len: int | None = None, same_length: bool | None = None,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> Tensor:
    """Continue ``prompt`` [B, T] by ``max_new_tokens`` tokens with a memory of ``window`` positions (None: the
    model's mem_len, clamp_len, same_length); returns the new tokens [B, max_new_tokens]."""
    decoder = model.decoder(prompt.size(0), window, clamp_len=clamp_len, same_length=same_length)
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    logits = decoder.prefill(prompt, seg_len)
    new = []
    for _ in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, generator)
        new.append(token)
        logits = decoder.feed(token)
    return torch.stack(new, dim=1) if new else prompt[:, :0]


def decoding_context(cfg: DictConfig, checkpoint: Checkpoint) -> tuple[MemoryContext, str]:
    """The decoder's context (its ``mem_len`` the decoder's window, with clamp_len and same_length), and a line saying
    where the window comes from.

    Each is the generate config's value if set, else the checkpoint's. A model trained without memory
    (mem_len=0, no memory tokens) gets the window with which each new token attends over as many tokens as the
    last token of a training segment did: its training segment length, itself included.
    """
    saved = checkpoint.model_config
    resolved = MemoryContext.of(cfg, saved)
    clamp_len, same_length = resolved.clamp_len, resolved.same_length
    if cfg.mem_len is not None:
        window, source = cfg.mem_len, "mem_len"
    elif saved["mem_len"] > 0 or not memory_settings.variant(saved.get("memory")).reads_afresh:  # memory tokens alone
        window, source = saved["mem_len"], "the checkpoint's mem_len"
    else:
        tgt_len, origin = checkpoint.train_tgt_len, "the training segment length, data.tgt_len"
        if tgt_len is None:
            tgt_len, origin = cfg.seg_len, "seg_len (the checkpoint does not record its training segment length)"
        window = tgt_len if same_length else max(1, tgt_len - 1)  # same_length counts the new token in the window
        source = (f"the checkpoint was trained without memory: each new token attends over "
                  f"{window if same_length else window + 1} tokens, {origin}={tgt_len}; set mem_len=N to change")
    context = dataclasses.replace(resolved, mem_len=window)
    return context, (f"decoding with mem_len={window} ({source}), clamp_len={clamp_len}, "
                     f"same_length={same_length}")


def warmup_text(cfg: DictConfig) -> str:
    """The warm-up: ``warmup`` is a file, read as the corpus sources read files (bytes kept exactly, \\r\\n included)
    so that its tokens are those the model was trained on; ``warmup_text`` is the text itself."""
    if not cfg.warmup:
        return cfg.get("warmup_text") or ""
    path = Path(str(cfg.warmup)).expanduser()
    if not path.is_file():
        raise ConfigError(f"warmup={cfg.warmup} is not a file; give the path of a text file, or the text itself "
                          "as warmup_text=...")
    return decode(path.read_bytes())


def prompt_ids(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """The ids of the warm-up and prompt as the start of a text that the samples continue. A word tokenizer closes
    every line of a corpus with its end-of-line symbol, the last one too; a prompt's last line is left open."""
    if isinstance(tokenizer, WordTokenizer):
        return tokenizer.encode(text, close_last_line=False)
    return tokenizer.encode(text)


def continuation(tokenizer: Tokenizer, ids: np.ndarray, new: np.ndarray) -> str:
    """The new tokens' text as it follows the prompt's: the two decoded as one text, less the prompt's decoding,
    so that what joins them (a word tokenizer's space before the first new word) is written. Where the prompt's
    decoding is not the start of the whole one (bytes of a character cut at the warm-up's end), the new tokens'
    own decoding."""
    head, whole = tokenizer.decode(ids), tokenizer.decode(np.concatenate([ids, new]))
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new)




def run(cfg: DictConfig) -> None:
    """The command (:func:`xl.generate.main`), once its command line has composed."""
    with errors_logged():
        sample_text(cfg)


def sample_text(cfg: DictConfig) -> None:
    """The command: read the run, decode, print the prompt and the new text."""
    quiet_warnings()
    text = warmup_text(cfg) + cfg.prompt
    use_run_data(cfg, cfg.ckpt)  # data=run: the run's tokenizer
    datamodule = build_datamodule(cfg)
    tokenizer = datamodule.tokenizer
    checkpoint = Checkpoint.open(cfg.ckpt, setting="ckpt")
    checkpoint.check_tokenizer(tokenizer.vocab_size, datamodule.tokenizer_fingerprint)
    model = checkpoint.load_model()
    context, described = decoding_context(cfg, checkpoint)
    del checkpoint  # the weights are in the model; free the optimizer state
    ids = prompt_ids(tokenizer, text)
    try:
        new = generate(model, torch.tensor(ids, dtype=torch.long)[None], cfg.max_new_tokens, seg_len=cfg.seg_len,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed,
                       window=context.mem_len, clamp_len=context.clamp_len, same_length=context.same_length)
    except ValueError as err:  # the decoder's context checks name mem_len / clamp_len
        raise ConfigError(str(err)) from err
    print(described, file=sys.stderr)  # stdout holds only the text; log lines go to stderr too (conf/generate.yaml)
    print(cfg.prompt + continuation(tokenizer, ids, new[0].numpy()))
