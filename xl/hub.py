"""A trained model shared as the Hugging Face ecosystem shares one: a folder, or a repository on the hub, holding

    model.safetensors   the weights, in the safetensors format (tensors only: loading runs nothing); tied tensors once
    config.json         the model config (XLConfig.to_dict), the tokenizer, the evaluation context, where it came from
    vocab.json          the word vocabulary (word tokenizer), or
    tokenizer.json      the Hugging Face tokenizers file, its ids the model's (bpe, unigram tokenizers)
    README.md           the model card: YAML metadata (library, tags, pipeline) and what the model is

:class:`PretrainedXL` is the model (a :class:`~xl.model.TransformerXL`, with its tokenizer) and huggingface_hub's
``PyTorchModelHubMixin``: ``save_pretrained(folder)``, ``PretrainedXL.from_pretrained(folder or "org/name")``,
``push_to_hub("org/name")``. Loading reads JSON and safetensors only, never a pickle, checks every weight's name and
shape, and checks the tokenizer file against the fingerprint config.json records. A config.json that another project
wrote is refused in one sentence, and so is a hub call that cannot succeed (``HF_HUB_OFFLINE`` set, or the endpoint
out of reach), at once rather than after huggingface_hub's retries. :meth:`PretrainedXL.to_run` writes a run folder
(:mod:`xl.run_folder`) that ``train.py init_from=…`` fine-tunes from (``python -m xl.convert`` calls it).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from huggingface_hub import ModelCard, ModelCardData, PyTorchModelHubMixin, constants, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError, LocalTokenNotFoundError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from safetensors.torch import load_file, save_model

from xl.checkpoint import Checkpoint
from xl.data.errors import DataError
from xl.data.subwords import SubwordTokenizer
from xl.data.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer, WordTokenizer, fingerprint, make_tokenizer
from xl.data.words import vocabulary_json
from xl.model import TransformerXL, XLConfig
from xl.run_folder import run_state, sha256, write_run_folder

FORMAT, FORMAT_VERSION = "xl-pretrained", 1  # config.json's "format" and "format_version"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
TOKENIZER_FILES = {"word": "vocab.json", "bpe": "tokenizer.json", "unigram": "tokenizer.json"}
TAGS = ["model_hub_mixin", "pytorch_model_hub_mixin", "text-generation", "transformer-xl"]
HUB_ERRORS = (HfHubHTTPError, EntryNotFoundError, HFValidationError, LocalTokenNotFoundError)


class HubError(ValueError):
    """A model that cannot be saved, loaded or pushed as asked; the message says what to change."""


# ---- where a model is, and whether the hub can be reached ---------------------------------------------------------
def locate(src: str, setting: str, example: str = "org/name") -> Path | None:
    """The folder ``src`` names, or None where it is a hub id (``org/name``); refused where it is neither."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists() or src.count("/") != 1 or src.startswith((".", "/", "~")):
        raise HubError(f"{setting}={src} is neither a folder nor a hub id like {example}")
    return None


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def check_hub(subject: str, advice: str) -> None:
    """Refuse at once a hub call that cannot succeed: offline mode, or an endpoint that does not answer
    (huggingface_hub would retry it for half a minute). ``subject`` names what needs the hub."""
    if offline():
        raise HubError(f"{subject} needs the Hugging Face hub but HF_HUB_OFFLINE is set; {advice}")
    host = urlparse(constants.ENDPOINT)
    try:
        port = host.port or (443 if host.scheme == "https" else 80)
        socket.create_connection((host.hostname, port), timeout=10).close()
    except OSError as err:
        raise HubError(f"{subject} needs the Hugging Face hub but {host.hostname} cannot be reached ({err}); "
                       f"{advice}") from None


def hub_failure(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else 'no detail'}"


def is_pretrained_config(path: Path) -> bool:
    """Whether ``path`` is the config.json of a model saved here (:class:`PretrainedXL`)."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(values, dict) and values.get("format") == FORMAT


# ---- the tokenizer's files -----------------------------------------------------------------------------------------
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
        text = vocabulary_json(tokenizer.itos, tokenizer.eos, tokenizer.unk, tokenizer.lower_case)
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


# ---- weights -----------------------------------------------------------------------------------------------------
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
    os.replace(temporary, path)


# ---- the model ---------------------------------------------------------------------------------------------------
class PretrainedXL(TransformerXL, PyTorchModelHubMixin):
    """A :class:`~xl.model.TransformerXL` with its ``tokenizer`` and ``about`` (config.json's evaluation context
    and training record), saved, loaded and pushed through huggingface_hub's ``PyTorchModelHubMixin``; ``files``:
    the files :meth:`from_pretrained` read it from.

    >>> model = PretrainedXL.from_run("outputs/2026-01-01/12-00-00")  # doctest: +SKIP
    >>> model.save_pretrained("shared")  # doctest: +SKIP
    >>> model = PretrainedXL.from_pretrained("shared")  # or "org/name"  # doctest: +SKIP
    """

    def __init__(self, config: XLConfig) -> None:
        super().__init__(config)
        self.tokenizer: Tokenizer | None = None
        self.about: dict[str, Any] = {}
        self.files: list[Path] = []

    # -- from a run of this project
    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, tokenizer: Tokenizer, setting: str = "ckpt") -> PretrainedXL:
        """The checkpoint's model with the tokenizer it was trained with (checked by its fingerprint)."""
        checkpoint.check_tokenizer(tokenizer.vocab_size, fingerprint(tokenizer), setting)
        model = cls(XLConfig.from_dict(checkpoint.model_config))
        checkpoint.check_weights(model, setting)
        model.load_state_dict(checkpoint.model_weights())
        model.tokenizer = tokenizer
        saved = checkpoint.hyper_parameters
        evaluation = {k: saved.get(f"eval_{k}") for k in ("mem_len", "clamp_len", "same_length")}
        if "doc_boundaries" in saved:
            evaluation["doc_boundaries"] = saved["doc_boundaries"]
        model.about = {"evaluation": evaluation, "training": {
            "steps": checkpoint.global_step, "tgt_len": checkpoint.train_tgt_len,
            "corpus": (checkpoint.data_identity or {}).get("corpus")}}
        return model.eval()

    @classmethod
    def from_run(cls, path: str | os.PathLike) -> PretrainedXL:
        """A run folder's (or checkpoint's) model, with the tokenizer of the run's data."""
        from xl.runs import TrainedRun

        run = TrainedRun.open(path)
        return cls.from_checkpoint(run.checkpoint, run.tokenizer)

    # -- the mixin's hooks
    def _save_pretrained(self, save_directory: Path) -> None:
        if self.tokenizer is None:
            raise HubError("the model has no tokenizer to save with it; set model.tokenizer to the one it was "
                           "trained with")
        if self.tokenizer.vocab_size != self.config.vocab_size:
            raise HubError(f"model.tokenizer has {self.tokenizer.vocab_size} ids but the model a vocabulary of "
                           f"{self.config.vocab_size}; set model.tokenizer to the one it was trained with")
        entry, files = tokenizer_files(self.tokenizer)
        write_atomic(save_directory / WEIGHTS, lambda p: save_model(self, str(p)))
        for name, text in files.items():
            write_atomic(save_directory / name, lambda p, text=text: p.write_text(text, encoding="utf-8"))
        read_back = read_tokenizer(entry, lambda name: save_directory / name, str(save_directory))
        entry["fingerprint"] = fingerprint(read_back)  # what a run reading these files records
        values = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": self.config.to_dict(),
                  "tokenizer": entry, **self.about}
        write_atomic(save_directory / CONFIG, lambda p: p.write_text(json.dumps(values, indent=2) + "\n"))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> PretrainedXL:
        """A model saved by :meth:`save_pretrained`: a folder, or a hub id (``org/name``) where a network exists;
        ``kwargs`` are huggingface_hub's (``revision``, ``cache_dir``, ``token``, ``local_files_only``, ...)."""
        src = str(pretrained_model_name_or_path)
        folder = locate(src, "the model")
        if folder is not None and not (folder / CONFIG).is_file():
            raise HubError(f"{folder} has no {CONFIG}; give a folder that save_pretrained wrote")
        if folder is None and not kwargs.get("local_files_only"):
            check_hub(src, f"download its files from {constants.ENDPOINT}/{src}/tree/main into one folder and "
                           "load that folder")
        try:
            return super().from_pretrained(src, **kwargs)
        except HUB_ERRORS as err:
            raise HubError(f"{src} cannot be loaded from the hub ({hub_failure(err)})") from None

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: str | None, cache_dir: str | Path | None,
                         force_download: bool, local_files_only: bool, token: str | bool | None,
                         config: Any = None) -> PretrainedXL:
        # ``config`` is the mixin's reading of config.json: read here again, checked, from the same file.
        def file(name: str) -> Path:
            if os.path.isdir(model_id):
                path = Path(model_id) / name
                if not path.is_file():
                    raise HubError(f"{model_id} has no {name}; give a folder that save_pretrained wrote")
                return path
            return Path(hf_hub_download(model_id, name, revision=revision, cache_dir=cache_dir, token=token,
                                        force_download=force_download, local_files_only=local_files_only))

        values, config = read_config(file(CONFIG), model_id)
        model = cls(config)
        load_weights(model, file(WEIGHTS), model_id)
        tokenizer = read_tokenizer(values["tokenizer"], file, model_id)
        if tokenizer.vocab_size != model.config.vocab_size or fingerprint(tokenizer) != values["tokenizer"].get(
                "fingerprint"):
            raise HubError(f"the tokenizer file of {model_id} is not the one the model was saved with (its "
                           "fingerprint or size differs from config.json's); save the model again")
        model.tokenizer = tokenizer
        model.about = {k: v for k, v in values.items() if k not in ("format", "format_version", "model", "tokenizer")}
        model.files = [file(CONFIG), file(WEIGHTS)] + ([file(TOKENIZER_FILES[tokenizer.name])]
                                                       if tokenizer.name in TOKENIZER_FILES else [])
        return model.eval()

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> str:
        """Upload the model (what :meth:`save_pretrained` writes) to the hub repository ``repo_id``, made if new;
        returns the commit's URL. ``kwargs`` are huggingface_hub's (``private``, ``token``, ``commit_message``,
        ...)."""
        check_repo_id(repo_id)
        check_hub(f"push={repo_id}", "save the model to a folder and upload it later")
        try:
            return str(super().push_to_hub(repo_id, **kwargs))
        except HUB_ERRORS as err:
            raise HubError(f"pushing to {repo_id} failed ({hub_failure(err)}); log in (hf auth login, or set "
                           "HF_TOKEN) with a token that may write to it") from None

    def generate_model_card(self) -> ModelCard:
        """README.md: the hub's metadata, what the model is, how to load and fine-tune it, its config."""
        metadata = ModelCardData(library_name="xl", pipeline_tag="text-generation", tags=TAGS)
        return ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n{card_text(self)}")

    # -- back into a run folder
    def to_run(self, out: Path, origin: str) -> Path:
        """Write the run folder OUT (checked new by :func:`xl.run_folder.check_new_folder`) that ``train.py
        init_from=OUT`` fine-tunes from: the model loaded from the files of a shared model, with its tokenizer file
        copied as it is (a run reading it records the fingerprint config.json gives)."""
        if not self.files:
            raise HubError("to_run writes a run folder for a model that from_pretrained read")
        provenance = {"source": origin, "files": {f.name: sha256(f) for f in self.files},
                      "training": self.about.get("training")}
        state = run_state(self.config.to_dict(), self.state_dict(), self.tokenizer.unit, fingerprint(self.tokenizer),
                          self.about.get("evaluation", {}), provenance)
        copies = {f.name: f.read_bytes() for f in self.files[2:]}  # the tokenizer file, as read
        return write_run_folder(out, state, copies)


def check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        repo_id = ""
    if repo_id.count("/") != 1:
        raise HubError(f"push={repo_id or '...'} is not a hub repository id like org/name")


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


def card_text(model: PretrainedXL) -> str:
    training = model.about.get("training") or {}
    trained = ""
    if training.get("steps") is not None:
        trained = f" It was trained for {training['steps']:,} steps"
        trained += f" on {training['corpus']}" if training.get("corpus") else ""
        trained += f", in segments of {training['tgt_len']} tokens" if training.get("tgt_len") else ""
        trained += "."
    n_params = sum(p.numel() for p in model.parameters())
    name = model.tokenizer.name if model.tokenizer is not None else "no"
    rows = [f"| `{key}` | `{json.dumps(value)}` |" for key, value in flat(model.config.to_dict())]
    rows += [f"| evaluation `{key}` | `{json.dumps(value)}` |" for key, value in
             flat(model.about.get("evaluation") or {})]
    settings = data_settings(model.tokenizer, "START") if model.tokenizer is not None else ""
    return f"""# Transformer-XL language model

A Transformer-XL language model (Dai et al., 2019: segment-level recurrence with relative positions) trained with
xl, a Transformer-XL framework on PyTorch Lightning and Hydra: {n_params:,} parameters, a {name} tokenizer of
{model.config.vocab_size:,} ids.{trained}

## Use

```python
from xl.hub import PretrainedXL

model = PretrainedXL.from_pretrained("REPO")  # this repository's id, or the folder's path
ids = model.tokenizer.encode("Some text")
```

Fine-tune it: `python -m xl.convert REPO START` writes a run folder, then
`python train.py init_from=START data=… {settings}` trains a new run from its weights.

## Config

| setting | value |
|---|---|
{chr(10).join(rows)}
"""


def flat(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A nested config as (dotted key, value) pairs."""
    pairs: list[tuple[str, Any]] = []
    for key, value in values.items():
        pairs += flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return pairs
