"""python -m xl.convert on sources that could mislead: each matches what transformers 4.57.6 (or the original code)
makes of the same folder, or is refused in one sentence, with nothing written. Folders are crafted from the
fixture (tests/fixtures/transfo_xl); where transformers is importable, its own reading is compared too."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import re
import shutil
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.paths import FIXTURES
from xl.convert import ConversionError, convert
from xl.convert.cli import main as convert_main
from xl.convert.vocab import read_pickle
from xl.convert.weights import TRANSFORMERS_DEFAULTS
from xl.data.sources import decode
from xl.data.words import WordTokenizer
from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError, read_checkpoint

FIXTURE = FIXTURES / "transfo_xl"
WEIGHTS = "model.safetensors"


def source(tmp_path: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """A copy of the fixture with config.json's ``drop`` keys removed and ``changes`` set."""
    folder = tmp_path / "src"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in drop} | changes
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def refused(folder: Path, out: Path, match: str) -> str:
    """Converting ``folder`` is refused with a message matching ``match``, in one line, and writes nothing."""
    with pytest.raises(ConversionError) as info:
        convert(folder, out)
    message = str(info.value)
    assert re.search(match, message), message
    assert "\n" not in message and not out.exists()
    return message


def header_and_body(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def rewrite(path: Path, header, body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def damage(kind: str, path: Path) -> None:
    """The fixture's model.safetensors, damaged as ``kind`` says."""
    header, body = header_and_body(path)
    first, second = [k for k in header if k != "__metadata__"][:2]
    begin, end = header[first]["data_offsets"]
    if kind == "truncated":
        os.truncate(path, 201484)  # 256 bytes short: the last tensors' data is missing
        return
    if kind == "reversed":
        header[first]["data_offsets"] = [end, begin]
    elif kind == "negative":
        header[first]["data_offsets"] = [-4, end]
    elif kind == "aliased":  # two tensors on the same bytes
        header[second] = dict(header[first])
    elif kind == "shape":
        header[first]["shape"] = [header[first]["shape"][0] + 1]
    elif kind == "dtype":
        header[first]["dtype"] = "F64"
    elif kind == "not a dict":
        header = [header]
    elif kind == "garbage":
        path.write_bytes(b"not a safetensors file at all")
        return
    rewrite(path, header, body)


@pytest.mark.parametrize("kind", ["truncated", "reversed", "negative", "aliased", "shape", "dtype", "not a dict",
                                  "garbage"])
def test_a_damaged_safetensors_file_is_refused_naming_it(tmp_path, kind):
    folder = source(tmp_path)
    damage(kind, folder / WEIGHTS)
    refused(folder, tmp_path / "out", rf"{folder / WEIGHTS} is not a readable safetensors file \(.+\); it is damaged")
    with pytest.raises(SystemExit, match=r"^error: .*model\.safetensors is not a readable safetensors file"):
        convert_main([str(folder), str(tmp_path / "out")])


def test_a_config_silent_on_the_context_reads_transformers_defaults(tmp_path):
    """transformers reads same_length, mem_len and clamp_len as True, 1600 and 1000 where config.json is silent, and
    so does the converted model's config (and so its evaluation context)."""
    out = tmp_path / "out"
    convert(source(tmp_path, drop=("same_length", "mem_len", "clamp_len")), out)
    config = Checkpoint.open(out).model_config
    assert (config["same_length"], config["mem_len"], config["clamp_len"]) == (True, 1600, 1000)
    hyper = Checkpoint.open(out).state["hyper_parameters"]
    assert (hyper["eval_same_length"], hyper["eval_mem_len"], hyper["eval_clamp_len"]) == (True, 1600, 1000)


def test_config_aliases_and_a_config_that_is_not_an_object(tmp_path):
    """n_token is TransfoXLConfig's alias of vocab_size (and wins over it, as there)."""
    folder = source(tmp_path, vocab_size=120, n_token=100)
    convert(folder, tmp_path / "out")
    assert Checkpoint.open(tmp_path / "out").model_config["vocab_size"] == 100
    (folder / "config.json").write_text("[1, 2]")
    refused(folder, tmp_path / "out2", r"config\.json holds a list, not the JSON object of a model config")
    (folder / "config.json").write_text("{")
    refused(folder, tmp_path / "out2", r"config\.json is not JSON")


def test_the_legacy_tie_weight_is_refused_where_transformers_would_ignore_it(tmp_path):
    """The original code's tie_weight=false unties; transformers 4 ignores the key and ties (tie_word_embeddings
    defaults to true), so the two readings differ and the source is refused. Where they agree it converts."""
    refused(source(tmp_path / "a", tie_weight=False), tmp_path / "out",
            r"tie_weight=false, which transformers 4 ignores: it reads tie_word_embeddings \(true\)")
    refused(source(tmp_path / "b", tie_weight=True, tie_word_embeddings=False), tmp_path / "out",
            r"tie_weight=true, which transformers 4 ignores")
    convert(source(tmp_path / "c", tie_weight=True), tmp_path / "out")
    assert Checkpoint.open(tmp_path / "out").model_config["tie_weights"]


def test_a_stored_copy_of_a_tied_tensor_must_hold_its_values(tmp_path):
    """pytorch_model.bin keeps tied tensors under both names; transformers uses the input's, so a copy with other
    values (a file that is not what its config says) is refused rather than silently dropped."""
    state = load_file(FIXTURE / WEIGHTS)
    for i in range(4):
        state[f"crit.out_layers.{i}.weight"] = state[f"transformer.word_emb.emb_layers.{i}.weight"].clone()
    state["crit.out_layers.2.weight"][0, 0] += 1
    folder = source(tmp_path)
    (folder / WEIGHTS).unlink()
    torch.save(state, folder / "pytorch_model.bin")
    refused(folder, tmp_path / "out", r"crit\.out_layers\.2\.weight with values other than "
                                      r"transformer\.word_emb\.emb_layers\.2\.weight, which config\.json ties it to")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stored_sinusoid_frequencies_are_those_of_the_formula_or_refused(tmp_path, dtype):
    """transformers loads pos_emb.inv_freq from the weights; this model computes 1/10000^(2i/d) itself. The stored
    table (float32, as saved, or float64) converts; another table is refused, naming it."""
    state = load_file(FIXTURE / WEIGHTS)
    exact = 1 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    state["transformer.pos_emb.inv_freq"] = exact.to(dtype)
    folder = source(tmp_path)
    save_file(state, folder / WEIGHTS)
    convert(folder, tmp_path / "out")
    state["transformer.pos_emb.inv_freq"] = (exact * 1.01).to(dtype)
    save_file(state, folder / WEIGHTS)
    refused(folder, tmp_path / "out2", r"transformer\.pos_emb\.inv_freq differs from the sinusoid's frequencies "
                                       r"1/10000\^\(2i/d_model\) by up to 0\.01 \(relative\)")
    state["transformer.pos_emb.inv_freq"] = exact[:-1].to(dtype)
    save_file(state, folder / WEIGHTS)
    refused(folder, tmp_path / "out2", r"inv_freq has shape \[31\]")


def test_integer_weights_are_refused(tmp_path):
    state = load_file(FIXTURE / WEIGHTS)
    state["crit.cluster_bias"] = state["crit.cluster_bias"].to(torch.int32)
    folder = source(tmp_path)
    save_file(state, folder / WEIGHTS)
    refused(folder, tmp_path / "out", r"crit\.cluster_bias has dtype torch\.int32; a model's weights are floating")


class RunsACommand:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("zipped", [True, False])
def test_a_hostile_weights_file_or_checkpoint_is_refused_naming_the_global(tmp_path, zipped):
    """torch.load(weights_only) refuses it with advice around the reason; the one sentence names the global."""
    target = tmp_path / "pwned"
    state = load_file(FIXTURE / WEIGHTS) | {"payload": RunsACommand(target)}
    folder = source(tmp_path)
    (folder / WEIGHTS).unlink()
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=zipped)
    message = refused(folder, tmp_path / "out", r"pytorch_model\.bin cannot be read as weights: it names "
                                                r"posix\.system, which is code rather than data; torch\.load "
                                                r"\(weights_only\) does not run it$")
    assert "PyTorch 2.6" not in message and not target.exists()
    torch.save({"a": torch.zeros(2)} | {"b": RunsACommand(target)}, tmp_path / "hostile.ckpt",
               _use_new_zipfile_serialization=True)
    with pytest.raises(CheckpointError, match=r"hostile\.ckpt cannot be read \(truncated, corrupt or not a "
                                              r"checkpoint\): it names posix\.system, which is code rather than data"):
        read_checkpoint(tmp_path / "hostile.ckpt")
    assert not target.exists()


def test_weights_that_are_not_a_dict_of_tensors_are_refused(tmp_path):
    folder = source(tmp_path)
    (folder / WEIGHTS).unlink()
    torch.save([torch.zeros(2)], folder / "pytorch_model.bin")
    refused(folder, tmp_path / "out", r"pytorch_model\.bin does not hold a dict of named tensors")


def with_both_unknown_symbols(folder: Path, unk_idx: int | None) -> dict:
    """The folder's vocabulary with <unk> at id 1 and <UNK> at id 2, and ``unk_idx`` stored (or none)."""
    vocab = read_pickle(folder / "vocab.pkl")
    words = vocab["idx2sym"]
    at = words.index("<unk>")
    words[1], words[at] = words[at], words[1]
    words[2] = "<UNK>"
    vocab["sym2idx"] = OrderedDict((w, i) for i, w in enumerate(words))
    if unk_idx is not None:
        vocab["unk_idx"] = unk_idx
    torch.save(vocab, folder / "vocab.pkl", _use_new_zipfile_serialization=False)
    return vocab


def original_unknown_id(vocab: dict, word: str) -> int:
    """transformers' TransfoXLTokenizer._convert_token_to_id, written out (the original's get_idx with unk_idx)."""
    if word in vocab["sym2idx"]:
        return vocab["sym2idx"][word]
    if "unk_idx" in vocab:
        return vocab["sym2idx"].get(word, vocab["unk_idx"])
    return vocab["sym2idx"]["<unk>" if "<unk>" in vocab["sym2idx"] else "<UNK>"]


@pytest.mark.parametrize("unk_idx", [2, 1, None])
def test_a_vocabulary_with_both_unknown_symbols_gives_unknown_words_its_unk_idx(tmp_path, unk_idx):
    folder = source(tmp_path)
    vocab = with_both_unknown_symbols(folder, unk_idx)
    convert(folder, tmp_path / "out")
    tokenizer = WordTokenizer(file=tmp_path / "out" / "vocab.json")
    assert tokenizer.encode("xyzzy <UNK> <unk>", close_last_line=False).tolist() == \
        [original_unknown_id(vocab, w) for w in ("xyzzy", "<UNK>", "<unk>")]
    assert tokenizer.unk_id == (1 if unk_idx is None else unk_idx)


def test_a_stored_unk_idx_outside_the_vocabulary_is_refused(tmp_path):
    folder = source(tmp_path)
    with_both_unknown_symbols(folder, 100)
    with pytest.raises(Exception, match="unk_idx=100 is not the id of one of its 100 words"):
        convert(folder, tmp_path / "out")


def original_ids(path: Path, vocab: dict) -> list[int]:
    """The original reader, written out: the file in text mode, line by line, each stripped and split, <eos> after
    each, an unknown word <unk>'s id."""
    ids = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            ids += [vocab["sym2idx"].get(w, vocab["sym2idx"]["<unk>"]) for w in line.strip().split() + ["<eos>"]]
    return ids


def test_text_with_lone_carriage_returns_reads_as_the_original_reads_it(tmp_path):
    """The fixture's text with every other newline a lone \\r (old Mac files; the original's text mode ends a line
    there), read as the corpus sources read files."""
    convert(FIXTURE, tmp_path / "out")
    lines = (FIXTURE / "text.txt").read_text(encoding="utf-8").split("\n")
    path = tmp_path / "text.txt"
    path.write_bytes("".join(line + ("\r" if i % 2 else "\n") for i, line in enumerate(lines)).encode("utf-8"))
    tokenizer = WordTokenizer(file=tmp_path / "out" / "vocab.json")
    ids = tokenizer.encode(decode(path.read_bytes())).tolist()
    assert ids == original_ids(path, read_pickle(FIXTURE / "vocab.pkl"))
    assert ids.count(tokenizer.eos_id) == len(lines)


def transformers_module(name: str):
    return pytest.importorskip(f"transformers.models.deprecated.transfo_xl.{name}",
                               reason="transformers 4.x (Transformer-XL) is not installed")


def test_live_the_defaults_are_transformers_own():
    """Where transformers 4 is importable: TRANSFORMERS_DEFAULTS are TransfoXLConfig's (and PretrainedConfig's
    tie_word_embeddings), and a config.json without same_length, mem_len and clamp_len reads as ours does."""
    config = transformers_module("configuration_transfo_xl")
    signature = inspect.signature(config.TransfoXLConfig.__init__).parameters
    theirs = {k: p.default for k, p in signature.items() if k in TRANSFORMERS_DEFAULTS}
    assert theirs == {k: v for k, v in TRANSFORMERS_DEFAULTS.items() if k != "tie_word_embeddings"}
    assert config.TransfoXLConfig().tie_word_embeddings is TRANSFORMERS_DEFAULTS["tie_word_embeddings"]
    given = {k: v for k, v in json.loads((FIXTURE / "config.json").read_text()).items()
             if k not in ("same_length", "mem_len", "clamp_len")}
    read = config.TransfoXLConfig.from_dict(given)
    assert (read.same_length, read.mem_len, read.clamp_len) == (True, 1600, 1000)


@pytest.mark.parametrize("unk_idx", [2, None])
def test_live_unknown_words_get_the_id_transformers_gives(tmp_path, unk_idx, monkeypatch):
    tokenization = transformers_module("tokenization_transfo_xl")
    pytest.importorskip("sacremoses", reason="TransfoXLTokenizer needs sacremoses")
    folder = source(tmp_path)
    with_both_unknown_symbols(folder, unk_idx)
    convert(folder, tmp_path / "out")
    monkeypatch.setenv("TRUST_REMOTE_CODE", "True")  # our own file, just written
    theirs = tokenization.TransfoXLTokenizer(pretrained_vocab_file=str(folder / "vocab.pkl"))
    ours = WordTokenizer(file=tmp_path / "out" / "vocab.json")
    words = ["xyzzy", "<UNK>", "<unk>", "the"]
    assert ours.encode(" ".join(words), close_last_line=False).tolist() == theirs.convert_tokens_to_ids(words)


def test_live_a_pickle_transformers_writes_is_refused_and_its_attributes_convert(tmp_path):
    """The way out that docs/pretrained.md gives for a vocab.pkl of TransfoXLTokenizer.save_pretrained: its plain
    attributes, pickled on their own where the file is trusted, convert to the same vocabulary."""
    transformers_module("tokenization_transfo_xl")
    pytest.importorskip("sacremoses", reason="TransfoXLTokenizer needs sacremoses")
    with open(FIXTURE / "save_pretrained_vocab.pkl", "rb") as f:
        whole = pickle.load(f)  # our own fixture, trusted
    folder = source(tmp_path)
    with open(folder / "vocab.pkl", "wb") as f:
        pickle.dump({k: whole[k] for k in ("idx2sym", "sym2idx", "lower_case", "delimiter", "unk_idx")
                     if k in whole}, f)
    convert(folder, tmp_path / "out")
    convert(FIXTURE, tmp_path / "reference")
    assert (tmp_path / "out" / "vocab.json").read_text() == (tmp_path / "reference" / "vocab.json").read_text()
