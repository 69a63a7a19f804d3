"""Convert a published Transformer-XL (Hugging Face layout), or a model this project shared, into a run folder.

``python -m xl.convert SRC OUT``: SRC is a local folder holding ``config.json``, ``model.safetensors`` or
``pytorch_model.bin`` and ``vocab.pkl`` or ``vocab.bin``, or a hub id (``transfo-xl/transfo-xl-wt103``) fetched with
``huggingface_hub`` where a network exists; or a folder or hub id that xl.export (or
:meth:`xl.hub.PretrainedXL.save_pretrained`) wrote, read by :meth:`xl.hub.PretrainedXL.from_pretrained`. OUT becomes a
run folder (:mod:`xl.training.checkpoints.run_folder`) that ``xl.evaluate``, ``xl.generate``, ``train.py init_from=…``
and :class:`xl.training.checkpoints.checkpoint.Checkpoint` read like one of ours::

    OUT/checkpoints/last.ckpt   the model config, the weights, the vocabulary's fingerprint and text, provenance
    OUT/vocab.json              the word vocabulary (data.tokenizer=word data.tokenizer_file=OUT/vocab.json)

(a shared model's run folder holds its own tokenizer file, if it has one). Nothing in the source runs: weights are
read by the ``safetensors`` library or with ``torch.load(weights_only=True)``, and the vocabulary pickle by a reader
that builds plain data and refuses anything else (:mod:`xl.convert.vocab`, :mod:`xl.convert.plain_pickle`).
config.json reads as transformers 4 reads it; the mapping and its refusals are in :mod:`xl.convert.weights`. OUT is
written in a temporary folder and renamed into place when complete.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import torch

from xl.convert.fetch import fetch
from xl.convert.vocab import VocabularyError, vocabulary_from_pickle
from xl.convert.weights import ConversionError, check_fits, convert_weights, model_config, read_config, read_weights
from xl.data.tokenizers import fingerprint
from xl.data.words import WordTokenizer, read_vocabulary
from xl.hub import PretrainedXL
from xl.hub.access import HubError
from xl.hub.files import data_settings, is_pretrained_config
from xl.training.checkpoints.run_folder import RunFolderError, check_new_folder, run_state, sha256, write_run_folder

__all__ = ["ConversionError", "HubError", "RunFolderError", "VocabularyError", "convert"]


def find_vocabulary(folder: Path) -> Path:
    for name in ("vocab.pkl", "vocab.bin"):
        if (folder / name).is_file():
            return folder / name
    raise ConversionError(f"{folder} has neither vocab.pkl nor vocab.bin (the word vocabulary)")


def checkpoint_state(values: dict[str, Any], weights: dict[str, torch.Tensor], vocab_text: str,
                     provenance: dict[str, Any]) -> dict[str, Any]:
    """The run folder's checkpoint (:func:`xl.training.checkpoints.run_folder.run_state`): the word tokenizer of the
    vocabulary,
    whose text the record keeps, and the source's own evaluation context (memory, clamp_len, same_length) as the
    evaluation defaults."""
    tokenizer = WordTokenizer(vocabulary=read_vocabulary(vocab_text, "the converted vocabulary"))
    evaluation = {k: values[k] for k in ("mem_len", "clamp_len", "same_length")}
    return run_state(values, weights, "word", fingerprint(tokenizer), evaluation, provenance, vocabulary=vocab_text)


def convert(src: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, str]:
    """Convert SRC (a folder or a hub id) into the run folder OUT; returns the checkpoint's path and the data
    settings that read text with the model's tokenizer."""
    out = check_new_folder(out)
    folder, origin = fetch(str(src))
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{folder} has no config.json; SRC must be a Hugging Face Transformer-XL folder")
    if is_pretrained_config(config_path):  # a model that xl saved (xl.hub)
        model = PretrainedXL.from_pretrained(str(src))
        return model.to_run(out, origin), data_settings(model.tokenizer, out)
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
    ckpt = write_run_folder(out, state, {"vocab.json": vocab_text.encode("utf-8")})
    return ckpt, shlex.join(["data.tokenizer=word", f"data.tokenizer_file={out / 'vocab.json'}"])
