"""A trained model shared as the Hugging Face ecosystem shares one: a folder, or a repository on the hub, holding

    model.safetensors   the weights, in the safetensors format (tensors only: loading runs nothing); tied tensors once
    config.json         the model config (XLConfig.to_dict), the tokenizer, the evaluation context, where it came from
    vocab.json          the word vocabulary (word tokenizer), or
    tokenizer.json      the Hugging Face tokenizers file, its ids the model's (bpe, unigram tokenizers)
    README.md           the model card: YAML metadata (library, tags, pipeline) and what the model is

:class:`PretrainedXL` is the model (a :class:`~xl.model.transformer.TransformerXL`, with its tokenizer) and
huggingface_hub's ``PyTorchModelHubMixin``: ``save_pretrained(folder)``, ``PretrainedXL.from_pretrained(folder or
"org/name")``, ``push_to_hub("org/name")``. Loading reads JSON and safetensors only, never a pickle, checks every
weight's name and shape, and checks the tokenizer file against the fingerprint config.json records. A config.json that
another project wrote is refused in one sentence, and so is a hub call that cannot succeed (``HF_HUB_OFFLINE`` set, or
the endpoint out of reach), at once rather than after huggingface_hub's retries. :meth:`PretrainedXL.to_run` writes a
run folder (:mod:`xl.training.checkpoints.run_folder`) that ``train.py init_from=…`` fine-tunes from (``python -m
xl.convert`` calls it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, PyTorchModelHubMixin, constants, hf_hub_download
from safetensors.torch import save_model

from xl.data.tokenizers import Tokenizer, fingerprint
from xl.hub.access import HUB_ERRORS, HubError, check_hub, check_repo_id, hub_failure, locate
from xl.hub.card import model_card
from xl.hub.files import (
    CONFIG,
    FORMAT,
    FORMAT_VERSION,
    TOKENIZER_FILES,
    WEIGHTS,
    load_weights,
    read_config,
    read_tokenizer,
    tokenizer_files,
    write_atomic,
)
from xl.model.config import XLConfig
from xl.model.memory_settings import eval_overrides
from xl.model.transformer import TransformerXL
from xl.training.checkpoints.checkpoint import Checkpoint
from xl.training.checkpoints.run_folder import run_state, sha256, write_run_folder


def model_file(model_id: str, name: str, **hub: Any) -> Path:
    """The file ``name`` of a saved model: in its folder, or fetched from the hub (huggingface_hub's cache;
    ``hub``: hf_hub_download's arguments)."""
    if os.path.isdir(model_id):
        path = Path(model_id) / name
        if not path.is_file():
            raise HubError(f"{model_id} has no {name}; give a folder that save_pretrained wrote")
        return path
    return Path(hf_hub_download(model_id, name, **hub))


class PretrainedXL(TransformerXL, PyTorchModelHubMixin):
    """A :class:`~xl.model.transformer.TransformerXL` with its ``tokenizer`` and ``about`` (config.json's evaluation
    context and training record), saved, loaded and pushed through huggingface_hub's ``PyTorchModelHubMixin``;
    ``files``: the files :meth:`from_pretrained` read it from.

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
        evaluation = eval_overrides(saved)
        if "doc_boundaries" in saved:
            evaluation["doc_boundaries"] = saved["doc_boundaries"]
        model.about = {"evaluation": evaluation, "training": {
            "steps": checkpoint.global_step, "tgt_len": checkpoint.train_tgt_len,
            "corpus": (checkpoint.data_identity or {}).get("corpus")}}
        return model.eval()

    @classmethod
    def from_run(cls, path: str | os.PathLike) -> PretrainedXL:
        """A run folder's (or checkpoint's) model, with the tokenizer of the run's data."""
        from xl.training.runs import TrainedRun

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
        folder = locate(src)
        if folder is None and not kwargs.get("local_files_only"):
            check_hub(src, f"download its files from {constants.ENDPOINT}/{src}/tree/main into one folder and "
                           "load that folder")
        hub = {k: kwargs[k] for k in ("revision", "cache_dir", "force_download", "token", "local_files_only")
               if k in kwargs}
        try:
            read_config(model_file(src, CONFIG, **hub), src)  # refused here, before the mixin reads it
            return super().from_pretrained(src, **kwargs)
        except HUB_ERRORS as err:
            raise HubError(f"{src} cannot be loaded from the hub ({hub_failure(err)})") from None

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: str | None, cache_dir: str | Path | None,
                         force_download: bool, local_files_only: bool, token: str | bool | None,
                         config: Any = None) -> PretrainedXL:
        # ``config`` is the mixin's reading of config.json: read here again, checked, from the same file.
        def file(name: str) -> Path:
            return model_file(model_id, name, revision=revision, cache_dir=cache_dir, token=token,
                              force_download=force_download, local_files_only=local_files_only)

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
        check_hub(f"pushing to {repo_id}", "save the model to a folder with save_pretrained and upload it later")
        try:
            return str(super().push_to_hub(repo_id, **kwargs))
        except HUB_ERRORS as err:
            raise HubError(f"pushing to {repo_id} failed ({hub_failure(err)}); log in (hf auth login, or set "
                           "HF_TOKEN) with a token that may write to it") from None

    def generate_model_card(self) -> ModelCard:
        """README.md: the hub's metadata, what the model is, how to load and fine-tune it, its config."""
        return model_card(self)

    # -- back into a run folder
    def to_run(self, out: Path, origin: str) -> Path:
        """Write the run folder OUT (checked new by :func:`xl.training.checkpoints.run_folder.check_new_folder`) that
        ``train.py init_from=OUT`` fine-tunes from: the model loaded from the files of a shared model, with its
        tokenizer file copied as it is (a run reading it records the fingerprint config.json gives)."""
        if not self.files:
            raise HubError("to_run writes a run folder for a model that from_pretrained read")
        provenance = {"source": origin, "files": {f.name: sha256(f) for f in self.files},
                      "training": self.about.get("training")}
        state = run_state(self.config.to_dict(), self.state_dict(), self.tokenizer.unit, fingerprint(self.tokenizer),
                          self.about.get("evaluation", {}), provenance)
        copies = {f.name: f.read_bytes() for f in self.files[2:]}  # the tokenizer file, as read
        return write_run_folder(out, state, copies)
