"""Convert a published Transformer-XL (Hugging Face layout) into a run folder of this project.

``python -m xl.convert SRC OUT``: SRC is a local folder holding ``config.json``, ``model.safetensors`` or
``pytorch_model.bin`` and ``vocab.pkl`` or ``vocab.bin``, or a hub id (``transfo-xl/transfo-xl-wt103``) fetched with
``huggingface_hub`` where a network exists. OUT becomes a run folder that ``xl.evaluate``, ``xl.generate``,
``train.py init_from=…`` and :class:`xl.checkpoint.Checkpoint` read like one of ours::

    OUT/checkpoints/last.ckpt   the model config, the weights, the vocabulary's fingerprint and text, provenance
    OUT/vocab.json              the word vocabulary (data.tokenizer=word data.tokenizer_file=OUT/vocab.json)

Nothing in the source runs: weights are read by the ``safetensors`` library or with ``torch.load(weights_only=True)``,
and the vocabulary pickle by a reader that builds plain data and refuses anything else (:mod:`xl.convert.vocab`,
:mod:`xl.convert.plain_pickle`). config.json reads as transformers 4 reads it; the mapping and its refusals are in
:mod:`xl.convert.weights`. OUT is written in a temporary folder and renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from xl.checkpoint import XL_KEY
from xl.convert.fetch import fetch
from xl.convert.vocab import VocabularyError, vocabulary_from_pickle
from xl.convert.weights import ConversionError, check_fits, convert_weights, model_config, read_config, read_weights
from xl.data.tokenizers import fingerprint
from xl.data.words import WordTokenizer, read_vocabulary

__all__ = ["ConversionError", "VocabularyError", "convert"]


def find_vocabulary(folder: Path) -> Path:
    for name in ("vocab.pkl", "vocab.bin"):
        if (folder / name).is_file():
            return folder / name
    raise ConversionError(f"{folder} has neither vocab.pkl nor vocab.bin (the word vocabulary)")


def sha256(path: Path) -> str:
    """The file's SHA-256, read in pieces (a published model's weights take a gigabyte)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(2**24), b""):
            digest.update(piece)
    return digest.hexdigest()


def checkpoint_state(values: dict[str, Any], weights: dict[str, torch.Tensor], vocab_text: str,
                     provenance: dict[str, Any]) -> dict[str, Any]:
    """What train.py's checkpoints hold that evaluation, generation and init_from read: the weights under the
    Lightning module's ``model.`` prefix, and this project's record (model config, tokenizer fingerprint), with the
    source's own evaluation context (memory, clamp_len, same_length) as the evaluation defaults."""
    tokenizer = WordTokenizer(vocabulary=read_vocabulary(vocab_text, "the converted vocabulary"))
    return {
        "state_dict": {f"model.{k}": v for k, v in weights.items()},
        "global_step": 0,
        "epoch": 0,
        "hyper_parameters": {"model": values, "unit": "word", "eval_mem_len": values["mem_len"],
                             "eval_clamp_len": values["clamp_len"], "eval_same_length": values["same_length"]},
        XL_KEY: {"model_config": values, "tokenizer": fingerprint(tokenizer), "vocabulary": vocab_text,
                 "converted_from": provenance},
    }


def convert(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Convert SRC (a folder or a hub id) into the run folder OUT; returns the checkpoint's path."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"OUT={out} exists and is not empty; remove it or give another folder")
    folder, origin = fetch(str(src))
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{folder} has no config.json; SRC must be a Hugging Face Transformer-XL folder")
    hf = read_config(config_path)
    values = model_config(hf)  # refuses unsupported options before the weights are read
    vocab_path = find_vocabulary(folder)
    vocab_text, summary = vocabulary_from_pickle(vocab_path)
    if summary["words"] != values["vocab_size"]:
        raise ConversionError(f"{vocab_path.name} has {summary['words']} words but config.json a vocabulary of "
                              f"{values['vocab_size']}; they come from different models")
    source, weights_name = read_weights(folder)
    weights = convert_weights(hf, source)
    check_fits(values, weights)
    files = [config_path, folder / weights_name, vocab_path]
    provenance = {"source": origin, "files": {f.name: sha256(f) for f in files},
                  "vocabulary": summary}
    state = checkpoint_state(values, weights, vocab_text, provenance)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(work, 0o777 & ~umask)  # a folder like any other, not mkdtemp's private one
    try:
        (work / "checkpoints").mkdir()
        torch.save(state, work / "checkpoints" / "last.ckpt")
        (work / "vocab.json").write_text(vocab_text, encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out / "checkpoints" / "last.ckpt"
