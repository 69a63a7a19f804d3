"""The files of a shared model: what each holds, and how it is written and read (JSON and safetensors only).

``config.json`` holds ``format``/``format_version`` (a config.json of another project is refused by them), the model
config (:meth:`xl.model.transformer.XLConfig.to_dict`), the tokenizer (its kind, settings and fingerprint) and what the
saved model knew of its evaluation context and training. The word vocabulary is ``vocab.json`` (the format
``data.tokenizer_file`` reads); a subword vocabulary is Hugging Face's ``tokenizer.json``, renumbered so that
``tokenizers`` itself gives the model's ids.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from xl.data.errors import DataError
from xl.data.subwords import SubwordTokenizer
from xl.data.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer, WordTokenizer, make_tokenizer
from xl.data.words import vocabulary_json
from xl.hub.access import HubError
from xl.model.config import XLConfig

FORMAT, FORMAT_VERSION = "xl-pretrained", 1  # config.json's "format" and "format_version"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
TOKENIZER_FILES = {"word": "vocab.json", "bpe": "tokenizer.json", "unigram": "tokenizer.json"}


# ---- config.json ---------------------------------------------------------------------------------------------------
def is_pretrained_config(path: Path) -> bool:
    """Whether ``path`` is the config.json of a model saved here (:class:`PretrainedXL`)."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(values, dict) and values.get("format") == FORMAT


def read_config(path: Path, src: str) -> tuple[dict[str, Any], XLConfig]:
    """config.json of a saved model, refused in one sentence where another project wrote it."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise HubError(f"{src}'s {CONFIG} is not JSON ({err})") from None
    if not isinstance(values, dict) or values.get("format") != FORMAT:
        hint = ("; it is a transformers Transformer-XL, which python -m xl.convert turns into a run folder"
                if isinstance(values, dict) and values.get("model_type") == "transfo-xl" else "")
        raise HubError(f"{src}'s {CONFIG} was not written by this project's save_pretrained (it has no "
                       f"\"format\": \"{FORMAT}\"){hint}")
    if values.get("format_version") != FORMAT_VERSION:
        raise HubError(f"{src}'s {CONFIG} has format_version {values.get('format_version')}; this version of the "
                       f"project reads {FORMAT_VERSION}")
    if not isinstance(values.get("model"), dict):
        raise HubError(f"{src}'s {CONFIG} has no model settings")
    try:
        return values, XLConfig.from_dict(values["model"])
    except (TypeError, ValueError) as err:
        raise HubError(f"{src}'s {CONFIG} gives a model this project cannot build ({err})") from None



# ---- the tokenizer's files ----------------------------------------------------------------------------------------
def renumbered(tokenizer: SubwordTokenizer) -> str:
    """The tokenizer's ``tokenizer.json`` with each token at the model's id: ``tokenizers`` numbers a vocabulary in
    training order, and this project ranks the ids by frequency (``order``)."""
    layout = json.loads(tokenizer.hf.to_str())
    order = [int(i) for i in tokenizer.order]
    if order == list(range(len(order))):
        return tokenizer.hf.to_str()
    if layout.get("post_processor") is not None:
        raise HubError("the tokenizer has a post-processor, whose token ids cannot be renumbered to the model's")
    new_id = {old: new for new, old in enumerate(order)}
    model = layout["model"]
    if model["type"] == "BPE":
        model["vocab"] = dict(sorted(((piece, new_id[i]) for piece, i in model["vocab"].items()), key=lambda p: p[1]))
    else:  # Unigram: pieces and scores in id order
        model["vocab"] = [model["vocab"][old] for old in order]
        if model.get("unk_id") is not None:
            model["unk_id"] = new_id[model["unk_id"]]
    for added in layout.get("added_tokens", []):
        added["id"] = new_id[added["id"]]
    return json.dumps(layout, ensure_ascii=False)


def tokenizer_files(tokenizer: Tokenizer) -> tuple[dict[str, Any], dict[str, str]]:
    """config.json's tokenizer entry (its fingerprint still to add) and the files that hold its vocabulary."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"name": "byte"}, {}
    if isinstance(tokenizer, CharTokenizer):
        return {"name": "char", "chars": "".join(tokenizer.chars)}, {}
    if isinstance(tokenizer, WordTokenizer):
        text = vocabulary_json(tokenizer.itos, tokenizer.eos, tokenizer.unk, tokenizer.lower_case,
                               tokenizer.punctuation)
        return {"name": "word"}, {TOKENIZER_FILES["word"]: text}
    if isinstance(tokenizer, SubwordTokenizer):
        return ({"name": tokenizer.name, "special_tokens": list(tokenizer.special_tokens)},
                {TOKENIZER_FILES[tokenizer.name]: renumbered(tokenizer)})
    raise HubError(f"a {type(tokenizer).__name__} cannot be saved with the model; use one of xl.data.tokenizers")


def read_tokenizer(entry: Any, file: Callable[[str], Path], src: str) -> Tokenizer:
    """The tokenizer config.json's ``entry`` describes, its vocabulary read from ``file(name)``."""
    name = entry.get("name") if isinstance(entry, dict) else None
    try:
        if name == "byte":
            return ByteTokenizer()
        if name == "char" and isinstance(entry.get("chars"), str):
            return CharTokenizer(entry["chars"])
        if name == "word":
            return make_tokenizer("word", file(TOKENIZER_FILES["word"]))
        if name in ("bpe", "unigram"):
            return make_tokenizer(name, file(TOKENIZER_FILES[name]), special_tokens=entry.get("special_tokens", []))
    except DataError as err:
        raise HubError(f"the tokenizer of {src} cannot be read: {err}") from None
    raise HubError(f"{src}'s config.json describes no tokenizer this project has (tokenizer: {json.dumps(entry)})")


def data_settings(tokenizer: Tokenizer, folder: str | os.PathLike) -> str:
    """The data settings that read text with ``tokenizer`` from the files in ``folder`` (a run folder or a shared
    model's), for ``train.py``, ``xl.evaluate`` and ``xl.generate``, quoted for the shell."""
    words = [f"data.tokenizer={tokenizer.name}"]
    if tokenizer.name in TOKENIZER_FILES:
        words.append(f"data.tokenizer_file={Path(folder) / TOKENIZER_FILES[tokenizer.name]}")
    if isinstance(tokenizer, SubwordTokenizer) and tokenizer.special_tokens:
        words.append(f"+data.tokenizer_kwargs.special_tokens={json.dumps(list(tokenizer.special_tokens))}")
    return " ".join(shlex.quote(w) for w in words)


# ---- weights ------------------------------------------------------------------------------------------------------
def load_weights(model: torch.nn.Module, path: Path, src: str) -> None:
    """``path``'s tensors into ``model``, every name and shape checked first. Tied tensors are stored once
    (safetensors' ``save_model``): each group of names that share a tensor needs one of them, and two given must
    agree."""
    try:
        saved = load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise HubError(f"{src}'s {WEIGHTS} is not a readable safetensors file ({err})") from None
    wanted = model.state_dict()
    groups: dict[tuple, list[str]] = {}
    for name, tensor in wanted.items():
        groups.setdefault((tensor.data_ptr(), tuple(tensor.shape)) if tensor.data_ptr() else (name,), []).append(name)
    problems = [f"holds {n}, which this model does not have" for n in saved if n not in wanted]
    state = {}
    for names in groups.values():
        given = [n for n in names if n in saved]
        if not given:
            problems.append(f"lacks {names[0]}")
            continue
        first = saved[given[0]]
        if first.shape != wanted[names[0]].shape or first.is_floating_point() != wanted[names[0]].is_floating_point():
            problems.append(f"has {given[0]} of shape {list(first.shape)} and dtype {first.dtype} (this model: "
                            f"{list(wanted[names[0]].shape)}, {wanted[names[0]].dtype})")
        elif any(not torch.equal(saved[n], first) for n in given[1:]):
            problems.append(f"holds {given[0]} and {given[1]} with other values, though the model ties them")
        state.update({n: first for n in names})
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise HubError(f"{src}'s {WEIGHTS} {problems[0]}{more}; it does not fit its config.json")
    model.load_state_dict(state)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through a temporary file beside it, renamed into place once complete."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(temporary)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o666 & ~umask)  # a file like any other (safetensors writes its own privately)
    os.replace(temporary, path)
