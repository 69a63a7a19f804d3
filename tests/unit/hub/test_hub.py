"""xl.hub: a model saved as model.safetensors + config.json + its tokenizer + a card, and read back exactly.

Round trips compare, in this process, the saved model with the one read back: every weight, the logits of two
segments with the memory carried, and the tokenizer's ids, text and byte lengths. Bad folders and hub calls that
cannot succeed are refused in one sentence; nothing is ever unpickled.
"""

from __future__ import annotations

import inspect
import json
import pickle
import shutil
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.helpers.hub_env import hub_offline, hub_unreachable
from tests.helpers.paths import FIXTURES
from xl.data.tokenizers import fingerprint, make_tokenizer
from xl.hub import PretrainedXL
from xl.hub.access import HubError
from xl.hub.files import FORMAT, read_tokenizer, tokenizer_files
from xl.model.config import XLConfig

FIXTURE = FIXTURES / "transfo_xl"
TEXT = textwrap.dedent(inspect.getsource(textwrap)) + "\nZürich — naïve café, 東京.\n<|endoftext|>\n" * 3
TOKENIZERS = {"byte": {}, "char": {}, "word": {}, "bpe": {"vocab_size": 400, "special_tokens": ["<|endoftext|>"]},
              "unigram": {"vocab_size": 400}}


def fitted(name: str):
    """A tokenizer fitted on TEXT as the token cache fits one (subword ids then ranked by frequency)."""
    tokenizer = make_tokenizer(name, **TOKENIZERS[name])
    tokenizer.fit([TEXT])
    if hasattr(tokenizer, "rank_by_frequency"):
        tokenizer.rank_by_frequency(tokenizer.encode(TEXT))
        assert not np.array_equal(tokenizer.order, np.arange(len(tokenizer.order)))  # the renumbering is exercised
    return tokenizer


def small_model(tokenizer, **settings) -> PretrainedXL:
    """A small model whose weights no fresh initialisation gives (each weight moved off its initial values)."""
    config = XLConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32,
                      mem_len=6, dropout=0.0, **settings)
    model = PretrainedXL(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model.tokenizer = tokenizer
    model.about = {"evaluation": {"mem_len": 9, "clamp_len": None, "same_length": True}}
    return model.eval()


def two_segments(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The logits of x's two halves, the second over the memory the first left."""
    with torch.no_grad():
        first = model(x[:, :7])
        return [first.logits, model(x[:, 7:], first.mems).logits]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_save_then_load_gives_the_same_weights_logits_and_tokenizer(name, tmp_path):
    tokenizer = fitted(name)
    settings = {"cutoffs": (20, 60), "div_val": 2, "tie_projs": (False, True, True)} if name == "word" else {}
    model = small_model(tokenizer, **settings)
    model.save_pretrained(tmp_path / "shared")
    loaded = PretrainedXL.from_pretrained(tmp_path / "shared")

    assert loaded.config == model.config
    saved, read = model.state_dict(), loaded.state_dict()
    assert saved.keys() == read.keys() and all(torch.equal(saved[k], read[k]) for k in saved)
    x = torch.tensor(tokenizer.encode(TEXT)[:28].astype(np.int64)).view(2, 14)
    assert all(torch.equal(a, b) for a, b in zip(two_segments(model, x), two_segments(loaded, x), strict=True))

    ids, again = tokenizer.encode(TEXT), loaded.tokenizer.encode(TEXT)
    assert type(loaded.tokenizer) is type(tokenizer) and np.array_equal(ids, again)
    assert loaded.tokenizer.decode(again) == tokenizer.decode(ids)
    assert np.array_equal(loaded.tokenizer.token_bytes(), tokenizer.token_bytes())
    values = json.loads((tmp_path / "shared" / "config.json").read_text())
    assert values["format"] == FORMAT and values["tokenizer"]["fingerprint"] == fingerprint(loaded.tokenizer)
    assert loaded.about == {"evaluation": {"mem_len": 9, "clamp_len": None, "same_length": True}}
    if name in ("bpe", "unigram"):  # the ecosystem's own reader gives the model's ids
        plain = tokenizers.Tokenizer.from_file(str(tmp_path / "shared" / "tokenizer.json"))
        assert plain.encode(TEXT[:3000], add_special_tokens=False).ids == tokenizer.encode(TEXT[:3000]).tolist()


def test_the_folder_holds_safetensors_json_and_a_card_with_the_hubs_metadata(tmp_path):
    model = small_model(fitted("word"), cutoffs=(20, 60))  # tied input and output word vectors
    model.save_pretrained(tmp_path / "shared")
    folder = tmp_path / "shared"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors", "vocab.json"]
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        stored = set(f.keys())
    tied = {k for k in model.state_dict() if k.startswith("head.tables.") and k.endswith(".weight")}
    assert tied and not tied & stored and set(model.state_dict()) - tied == stored  # each tied tensor once
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "xl" and card.data.pipeline_tag == "text-generation"
    assert {"pytorch_model_hub_mixin", "model_hub_mixin", "transformer-xl"} <= set(card.data.tags)
    assert f"{sum(p.numel() for p in model.parameters()):,} parameters" in card.text
    assert "data.tokenizer=word data.tokenizer_file=START/vocab.json" in card.text
    assert oct((folder / "model.safetensors").stat().st_mode & 0o777) == oct((folder / "config.json").stat().st_mode
                                                                              & 0o777)


def test_a_hub_id_loads_through_huggingface_hubs_cache(tmp_path):
    """By hub id, the files come from hf_hub_download: here from a cache laid out as huggingface_hub keeps one
    (refs/main naming a snapshot), with local_files_only so that no network is needed."""
    model = small_model(fitted("bpe"))
    snapshot = tmp_path / "cache" / "models--me--tiny-xl" / "snapshots" / ("0" * 40)
    model.save_pretrained(snapshot)
    (tmp_path / "cache" / "models--me--tiny-xl" / "refs").mkdir()
    (tmp_path / "cache" / "models--me--tiny-xl" / "refs" / "main").write_text("0" * 40)
    loaded = PretrainedXL.from_pretrained("me/tiny-xl", cache_dir=tmp_path / "cache", local_files_only=True)
    x = torch.tensor(model.tokenizer.encode(TEXT)[:28].astype(np.int64)).view(2, 14)
    assert all(torch.equal(a, b) for a, b in zip(two_segments(model, x), two_segments(loaded, x), strict=True))
    assert [f.name for f in loaded.files] == ["config.json", "model.safetensors", "tokenizer.json"]
    with pytest.raises(HubError, match=r"^me/absent cannot be loaded from the hub \(LocalEntryNotFoundError: "):
        PretrainedXL.from_pretrained("me/absent", cache_dir=tmp_path / "cache", local_files_only=True)


class Marker:
    """Unpickling this writes a file: proof that a loader ran the pickle's code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "ran"))


def saved(tmp_path: Path, name: str = "word") -> Path:
    folder = tmp_path / "shared"
    small_model(fitted(name)).save_pretrained(folder)
    return folder


def test_folders_it_cannot_trust_or_read_are_refused_in_one_sentence(tmp_path):
    folder = saved(tmp_path)
    with pytest.raises(HubError, match=r"transfo_xl's config\.json was not written by this project's save_pretrained "
                                       r"\(it has no \"format\": \"xl-pretrained\"\); it is a transformers "
                                       r"Transformer-XL, which python -m xl.convert turns into a run folder$"):
        PretrainedXL.from_pretrained(FIXTURE)
    cases = {
        "not JSON": ("{", r"config\.json is not JSON"),
        "another project": (json.dumps({"model_type": "bert", "hidden_size": 8}), r"has no \"format\""),
        "a newer format": (None, r"has format_version 2; this version of the project reads 1"),
        "a field we lack": (None, r"gives a model this project cannot build \(unknown XLConfig field\(s\) \['wings'\]"),
    }
    original = (folder / "config.json").read_text()
    for case, (text, message) in cases.items():
        if text is None:
            values = json.loads(original)
            values["format_version" if case == "a newer format" else "model"] = (
                2 if case == "a newer format" else {**values["model"], "wings": 2})
            text = json.dumps(values)
        (folder / "config.json").write_text(text)
        with pytest.raises(HubError, match=message):
            PretrainedXL.from_pretrained(folder)
    (folder / "config.json").write_text(original)

    # The weights only ever come from safetensors: a pytorch_model.bin, which a pickle loader would run, is not read.
    marker = tmp_path / "ran"
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump(Marker(str(marker)), f)
    (folder / "model.safetensors").rename(tmp_path / "weights")
    with pytest.raises(HubError, match=r"shared has no model\.safetensors; give a folder that save_pretrained wrote"):
        PretrainedXL.from_pretrained(folder)
    assert not marker.exists()
    (tmp_path / "weights").rename(folder / "model.safetensors")

    weights = load_file(folder / "model.safetensors")
    edits = [
        ({k: v for k, v in weights.items() if k != "layers.0.ff.net.0.bias"}, r"lacks layers\.0\.ff\.net\.0\.bias"),
        ({**weights, "wings.weight": torch.zeros(2)}, r"holds wings\.weight, which this model does not have"),
        ({**weights, "embed.weight": torch.zeros(3, 16)}, r"has embed\.weight of shape \[3, 16\]"),
    ]
    for tensors, message in edits:
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(HubError, match=message + r".*; it does not fit its config\.json$"):
            PretrainedXL.from_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HubError, match=r"model\.safetensors is not a readable safetensors file"):
        PretrainedXL.from_pretrained(folder)
    save_file(weights, folder / "model.safetensors")

    vocabulary = json.loads((folder / "vocab.json").read_text())  # the same size, two words swapped
    vocabulary["words"][2], vocabulary["words"][3] = vocabulary["words"][3], vocabulary["words"][2]
    (folder / "vocab.json").write_text(json.dumps(vocabulary))
    with pytest.raises(HubError, match=r"the tokenizer file of .*shared is not the one the model was saved with"):
        PretrainedXL.from_pretrained(folder)
    (folder / "vocab.json").unlink()
    with pytest.raises(HubError, match=r"shared has no vocab\.json"):
        PretrainedXL.from_pretrained(folder)
    shutil.rmtree(folder)
    folder.mkdir()
    with pytest.raises(HubError, match=r"shared has no config\.json; give a folder that save_pretrained wrote$"):
        PretrainedXL.from_pretrained(folder)
    with pytest.raises(HubError, match=r"^\./nowhere is neither a folder nor a hub id like org/name$"):
        PretrainedXL.from_pretrained("./nowhere")


def test_a_model_without_its_tokenizer_is_not_saved(tmp_path):
    model = small_model(fitted("byte"))
    model.tokenizer = None
    with pytest.raises(HubError, match=r"the model has no tokenizer to save with it; set model\.tokenizer"):
        model.save_pretrained(tmp_path / "a")
    model.tokenizer = fitted("char")
    with pytest.raises(HubError, match=r"model\.tokenizer has \d+ ids but the model a vocabulary of 256"):
        model.save_pretrained(tmp_path / "b")
    assert not (tmp_path / "a" / "config.json").exists() and not (tmp_path / "b" / "model.safetensors").exists()


@pytest.mark.parametrize("cause", ["offline", "unreachable"])
def test_a_hub_call_that_cannot_succeed_fails_at_once_in_one_sentence(cause, tmp_path, monkeypatch):
    if cause == "offline":
        hub_offline(monkeypatch)
        reason = r"HF_HUB_OFFLINE is set"
    else:
        hub_unreachable(monkeypatch)
        reason = r"127\.0\.0\.1 cannot be reached \(\[Errno 111\] Connection refused\)"
    model = small_model(fitted("byte"))
    start = time.perf_counter()
    with pytest.raises(HubError, match=rf"^me/tiny-xl needs the Hugging Face hub but {reason}; download its files "
                                       r"from .*/me/tiny-xl/tree/main into one folder and load that folder$"):
        PretrainedXL.from_pretrained("me/tiny-xl")
    with pytest.raises(HubError, match=rf"^pushing to me/tiny-xl needs the Hugging Face hub but {reason}; save the "
                                       r"model to a folder with save_pretrained and upload it later$"):
        model.push_to_hub("me/tiny-xl")
    with pytest.raises(HubError, match=r"^me is not a hub repository id like org/name$"):
        model.save_pretrained(tmp_path / "pushed", push_to_hub=True, repo_id="me")  # the mixin's own path
    assert time.perf_counter() - start < 5  # not huggingface_hub's half a minute of retries


def test_the_tokenizer_entry_reads_back_what_it_wrote(tmp_path):
    """tokenizer_files and read_tokenizer are inverse for every kind (the fingerprint a fine-tune records)."""
    for name in TOKENIZERS:
        tokenizer = fitted(name)
        entry, files = tokenizer_files(tokenizer)
        for file, text in files.items():
            (tmp_path / file).write_text(text, encoding="utf-8")
        back = read_tokenizer(entry, lambda f: tmp_path / f, "here")
        assert np.array_equal(back.encode(TEXT), tokenizer.encode(TEXT)), name
    with pytest.raises(HubError, match=r"here's config\.json describes no tokenizer this project has"):
        read_tokenizer({"name": "sentencepiece"}, lambda f: tmp_path / f, "here")
