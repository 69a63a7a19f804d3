"""Write the Transformer-XL parity fixture (tests/fixtures/transfo_xl/) with transformers' own implementation.

The reference is ``TransfoXLLMHeadModel`` of transformers 4.x (5.x deleted it). transformers 4.x needs
huggingface-hub<1.0, which the project's datasets cannot share an environment with, so run this in a venv of its own:

    python -m venv /tmp/hfref
    /tmp/hfref/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors sacremoses
    /tmp/hfref/bin/python scripts/make_transfo_xl_fixture.py tests/fixtures/transfo_xl

It builds a small randomly initialised model with the WikiText-103 model's architecture (three cutoffs, div_val 4,
projections shared for every cluster but the first, per-layer biases, same_length, clamp_len), saves it with
``save_pretrained`` (config.json, model.safetensors), writes a vocabulary in the original format (vocab.pkl: the
original ``Vocab`` object's attributes, written by ``torch.save`` in its legacy format like the published file), the
same vocabulary as ``TransfoXLTokenizer.save_pretrained`` pickles it (save_pretrained_vocab.pkl: the whole tokenizer
object, which the converter refuses) and a text, and records in float64 (reference.safetensors, reference.json):

- ``ids``: the text's ids by the original rule (the file read line by line in text mode, each line stripped and
  split on whitespace, ``<eos>`` after every line, an unknown word ``<unk>``'s id), cut into ``batch`` equal rows
  as the evaluation streams are;
- ``logprobs`` [batch, T, vocab] and ``nll`` [batch, T]: every position of the rows read in segments of ``tgt_len``
  with a memory of ``mem_len``, starting from an empty memory (the original PyTorch evaluation's start);
- ``greedy``: the greedy continuation of the first ``prompt_len`` tokens of each row, the prompt read in segments of
  ``seg_len``, then one token per step, each over the memory carried.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import shutil
import sys
import tempfile
import textwrap
import warnings
from collections import Counter, OrderedDict
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import TransfoXLConfig, TransfoXLLMHeadModel, TransfoXLTokenizer
from transformers.models.deprecated.transfo_xl import modeling_transfo_xl as modeling

SEED = 1
BATCH, TGT_LEN, SEG_LEN, PROMPT_LEN, NEW_TOKENS = 2, 5, 4, 9, 12
ARCH = dict(vocab_size=100, cutoffs=[20, 40, 70], d_model=64, d_embed=64, n_head=2, d_head=16, d_inner=64, div_val=4,
            pre_lnorm=False, n_layer=2, mem_len=7, clamp_len=4, same_length=True, proj_share_all_but_first=True,
            attn_type=0, sample_softmax=-1, adaptive=True, dropout=0.0, dropatt=0.0, untie_r=True)
# Words with several UTF-8 lengths, WikiText's escapes, a case pair, and <unk> where the original vocabulary has
# it: by frequency, not at a fixed id.
WORDS = ["the", ",", ".", "of", "<unk>", "and", "in", "@-@", "to", "a", "=", "was", "The", "Zürich", "naïve", "—",
         "São", "1", "@,@", "日本"]


def vocabulary() -> dict:
    """The attributes of the original ``Vocab`` (kimiyoung/transformer-xl, pytorch/data_utils.py) for WikiText:
    ``<eos>`` is its one special symbol, the words follow by decreasing count."""
    words = WORDS + [f"w{i}" for i in range(ARCH["vocab_size"] - 1 - len(WORDS))]
    counter = Counter({w: 1000 - i for i, w in enumerate(words)})
    idx2sym = ["<eos>"] + words
    return {"counter": counter, "special": ["<eos>"], "min_freq": 0, "max_size": None, "lower_case": False,
            "delimiter": None, "vocab_file": None, "idx2sym": idx2sym,
            "sym2idx": OrderedDict((w, i) for i, w in enumerate(idx2sym)), "eos_idx": 0}


def text(rng: random.Random, words: list[str]) -> str:
    """WikiText-like lines: a heading with its leading space, empty lines, words unknown to the vocabulary."""
    lines = [" = Zürich = ", " "]
    for _ in range(15):
        n = rng.randrange(0, 9)
        line = [rng.choice(words) if rng.random() > 0.08 else rng.choice(["xyzzy", "Ωmega", "<formula>"])
                for _ in range(n)]
        lines.append(" " + " ".join(line) + " " if line else " ")
    return "\n".join(lines) + "\n"


def encode(path: Path, vocab: dict) -> list[int]:
    """The original rule, line by line as it reads the file (text mode: a line ends at \\n, \\r\\n or \\r;
    Vocab.tokenize with add_eos, then get_idx)."""
    ids = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip().lower() if vocab["lower_case"] else line.strip()
            for sym in line.split(vocab["delimiter"]) + ["<eos>"]:
                ids.append(vocab["sym2idx"].get(sym, vocab["sym2idx"]["<unk>"]))
    return ids


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights far from the library's small initialisation, so that every part of the model matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm.weight" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1 or "bias" in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
            elif "emb_layers" in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.7 * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def patched(cls: type, method: str, edits: dict[str, str]) -> None:
    """Replace ``cls.method`` by its own source with ``edits`` (regular expression: replacement; each must match)
    applied, compiled in its module's namespace; a method already replaced is left as it is."""
    if getattr(cls, method).__code__.co_filename.startswith("<patched"):
        return
    source = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    source = source[source.index("def "):]  # without its decorators (they only add to the docstring)
    for pattern, new in edits.items():
        source, n = re.subn(pattern, new, source)
        if not n:
            raise RuntimeError(f"{cls.__name__}.{method} no longer matches {pattern!r}; update this script")
    namespace: dict = {}
    exec(compile(source, f"<patched {cls.__name__}.{method}>", "exec"), vars(sys.modules[cls.__module__]), namespace)
    setattr(cls, method, namespace[method])


def float64_reference() -> None:
    """The first two of three edits that let transformers 4.57.6 run in float64, its computation otherwise
    unchanged: the position sequence is cast with ``.to(dtype)`` (its ``type_as(dtype=...)`` is rejected by torch
    2.13), and the attention mask is filled in the scores' own dtype (the library rounds the scores to float32
    there, and float64's lowest value does not fit float32). The third is :func:`float64_model`'s."""
    patched(modeling.TransfoXLModel, "forward", {r"\.type_as\(\s*dtype=word_emb\.dtype\s*\)":
                                                 ".to(word_emb.dtype)"})
    patched(modeling.RelPartialLearnableMultiHeadAttn, "forward",
            {r"attn_score\.float\(\)\.masked_fill": "attn_score.masked_fill"})


def float64_model(model: TransfoXLLMHeadModel) -> TransfoXLLMHeadModel:
    """The model in float64 for evaluation, with the third edit: its sinusoid frequencies (a buffer the library
    computes in float32 when it builds the model, which ``.double()`` only widens) computed by the same formula in
    float64, as this project's model computes them. Without it the fixture's log-probabilities move by 3e-9, 30
    times the tests' tolerance."""
    model = model.double().eval()
    pos = model.transformer.pos_emb
    pos.inv_freq = 1 / (10000 ** (torch.arange(0.0, pos.demb, 2.0, dtype=torch.float64) / pos.demb))
    return model


def empty_mems(model: TransfoXLLMHeadModel, batch: int) -> list[torch.Tensor]:
    """An empty memory (the library's own init_mems would give mem_len zero states)."""
    return [torch.zeros(0, batch, model.config.d_model, dtype=torch.float64) for _ in range(model.config.n_layer)]


def main(out: Path) -> None:
    warnings.simplefilter("ignore")  # the library's deprecation notices
    transformers.logging.set_verbosity_error()
    float64_reference()
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**ARCH)).eval()
    randomize(model, gen)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # config.json, model.safetensors (float32; tied tensors stored once)
    vocab = vocabulary()
    torch.save(vocab, out / "vocab.pkl", _use_new_zipfile_serialization=False)  # the published file's format
    os.environ["TRUST_REMOTE_CODE"] = "True"  # the tokenizer unpickles the vocabulary just written
    tokenizer = TransfoXLTokenizer(pretrained_vocab_file=str(out / "vocab.pkl"))
    with tempfile.TemporaryDirectory() as folder:  # the whole tokenizer, pickled by transformers itself
        tokenizer.save_pretrained(folder)
        shutil.copy(Path(folder) / "vocab.pkl", out / "save_pretrained_vocab.pkl")
    corpus = text(random.Random(SEED), vocab["idx2sym"][1:])
    (out / "text.txt").write_text(corpus, encoding="utf-8")

    model = float64_model(model)
    ids = torch.tensor(encode(out / "text.txt", vocab))
    row_len = len(ids) // BATCH
    rows = ids[: BATCH * row_len].view(BATCH, row_len)
    logprobs, nll, mems = [], [], empty_mems(model, BATCH)
    with torch.no_grad():
        for start in range(0, row_len - 1, TGT_LEN):
            end = min(start + TGT_LEN, row_len - 1)
            result = model(rows[:, start:end], mems=mems)
            mems = result.mems
            lp = result.prediction_scores  # log-probabilities [B, L, vocab]
            logprobs.append(lp)
            nll.append(-lp.gather(-1, rows[:, start + 1 : end + 1, None])[..., 0])
        prompt = rows[:, :PROMPT_LEN]
        mems = empty_mems(model, BATCH)
        for start in range(0, PROMPT_LEN, SEG_LEN):
            result = model(prompt[:, start : start + SEG_LEN], mems=mems)
            mems = result.mems
        greedy = []
        for _ in range(NEW_TOKENS):
            token = result.prediction_scores[:, -1].argmax(-1)
            greedy.append(token)
            result = model(token[:, None], mems=mems)
            mems = result.mems
    save_file({"ids": ids, "rows": rows.clone(), "logprobs": torch.cat(logprobs, 1).contiguous(),
               "nll": torch.cat(nll, 1).contiguous(), "greedy": torch.stack(greedy, 1).contiguous()},
              out / "reference.safetensors")
    meta = {"batch": BATCH, "tgt_len": TGT_LEN, "mem_len": ARCH["mem_len"], "clamp_len": ARCH["clamp_len"],
            "same_length": ARCH["same_length"], "seg_len": SEG_LEN, "prompt_len": PROMPT_LEN,
            "new_tokens": NEW_TOKENS, "total_nll": float(torch.cat(nll, 1).sum()),
            "made_with": {"transformers": transformers.__version__, "torch": torch.__version__}}
    (out / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out}: {len(ids)} ids, rows {tuple(rows.shape)}, total NLL {meta['total_nll']:.6f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/transfo_xl"))
