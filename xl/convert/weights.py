"""Map a Hugging Face Transformer-XL (``TransfoXLLMHeadModel``: config.json and its weights) onto this project's model.

Every option of the published configs has a counterpart here, or the conversion stops with one sentence naming it.
The layers map one to one (the query/key/value projection is split into ours). The adaptive input and softmax map
one to one too: ``d_embed`` is the width of the first cluster, ``proj_all`` gives every cluster a projection where
the original projects every cluster (``div_val > 1``, or ``d_embed`` other than ``d_model``), ``tie_weights`` and the
per-cluster ``tie_projs`` share what the original shares, and with ``div_val = 1`` the original's one table is cut
into its clusters (its one input projection shared by all of them, as here). A source whose word vectors are not
tied but whose projections are gets separate copies of the tied projections (``tie_projs`` acts with ``tie_weights``
here): the same values, trained apart.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from xl.model import TransformerXL, XLConfig

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32}
LAYER_NORM_EPS = 1e-5  # torch's default, which this project's layer norms use


class ConversionError(ValueError):
    """A source this converter cannot turn into an exact model of ours; the message names the option."""


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file's tensors (an 8-byte header length, a JSON header, the raw data): no code runs."""
    data = path.read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
    except (struct.error, ValueError) as err:
        raise ConversionError(f"{path} is not a safetensors file ({err})") from None
    base, tensors = 8 + size, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ConversionError(f"{path}: tensor {name} has dtype {info.get('dtype')}, unknown to this reader")
        begin, end = info["data_offsets"]
        raw = bytearray(data[base + begin : base + end])
        tensors[name] = torch.frombuffer(raw, dtype=dtype).reshape(info["shape"]) if raw else \
            torch.zeros(info["shape"], dtype=dtype)
    return tensors


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The source's tensors, from model.safetensors or pytorch_model.bin (read with ``weights_only``)."""
    safetensors, binary = folder / "model.safetensors", folder / "pytorch_model.bin"
    if safetensors.is_file():
        return read_safetensors(safetensors), safetensors.name
    if binary.is_file():
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as err:  # weights_only refuses pickled code; a damaged file raises many types
            raise ConversionError(f"{binary} cannot be read as weights only ({str(err).splitlines()[0][:200]})") \
                from None
        return dict(state), binary.name
    raise ConversionError(f"{folder} has neither model.safetensors nor pytorch_model.bin")


def model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Our XLConfig fields for a Hugging Face Transformer-XL config; an option we cannot reproduce is refused."""
    if hf.get("model_type", "transfo-xl") != "transfo-xl":
        raise ConversionError(f"config.json describes a {hf.get('model_type')} model, not transfo-xl")
    vocab, cutoffs = hf.get("vocab_size", hf.get("n_token")), list(hf.get("cutoffs", []))
    d_model, d_embed, div_val = hf["d_model"], hf.get("d_embed", hf["d_model"]), hf.get("div_val", 1)
    refusals = [
        (hf.get("attn_type", 0) != 0, f"attn_type={hf.get('attn_type')}: only relative attention (0) exists here"),
        (hf.get("sample_softmax", -1) > 0, f"sample_softmax={hf.get('sample_softmax')}: sampled softmax is not "
                                           "supported"),
        (hf.get("ext_len", 0) > 0, f"ext_len={hf.get('ext_len')}: extended context is not supported"),
        (hf.get("pre_lnorm", False), "pre_lnorm=true: the original has no final layer norm after pre-norm layers "
                                     "and ours has one"),
        (not hf.get("adaptive", True), "adaptive=false: its meaning differs between implementations (this format's "
                                       "model ignores it); set it true if the weights have cutoffs"),
        (not cutoffs, "cutoffs=[]: one softmax with output biases has no counterpart here"),
        (hf.get("layer_norm_epsilon", LAYER_NORM_EPS) != LAYER_NORM_EPS,
         f"layer_norm_epsilon={hf.get('layer_norm_epsilon')}: our layer norms use {LAYER_NORM_EPS}"),
    ]
    for refused, reason in refusals:
        if refused:
            raise ConversionError(f"unsupported option {reason}")
    clamp_len = hf.get("clamp_len", -1)
    values = {
        "vocab_size": vocab, "n_layer": hf["n_layer"], "n_head": hf["n_head"], "d_model": d_model,
        "d_head": hf["d_head"], "d_inner": hf["d_inner"], "dropout": hf.get("dropout", 0.1),
        "dropatt": hf.get("dropatt", 0.0), "mem_len": hf.get("mem_len", 0),
        "clamp_len": clamp_len if clamp_len > 0 else -1, "same_length": hf.get("same_length", False),
        "pre_lnorm": False, "tie_weights": tied_words(hf), "cutoffs": cutoffs, "div_val": div_val,
        "tie_projs": tie_projections(hf) if tied_words(hf) else False,
        "d_embed": None if d_embed == d_model else d_embed, "proj_all": projected(hf),
    }
    try:
        XLConfig.from_dict(values)
    except (TypeError, ValueError) as err:
        raise ConversionError(f"config.json gives a model this project cannot build: {err}") from None
    return values


def tied_words(hf: dict[str, Any]) -> bool:
    """Whether the original's output word vectors are its input ones."""
    return bool(hf.get("tie_word_embeddings", hf.get("tie_weight", True)))


def projected(hf: dict[str, Any]) -> bool:
    """Whether the original projects its word vectors (every cluster, or the one table) to d_model."""
    return hf.get("div_val", 1) > 1 or hf.get("d_embed", hf["d_model"]) != hf["d_model"]


def tie_projections(hf: dict[str, Any]) -> list[bool]:
    """Which output projections the original shares with the input side (its own rule when loading)."""
    if "tie_projs" in hf:
        return [bool(t) for t in hf["tie_projs"]]
    n = len(hf.get("cutoffs", [])) + 1
    return [False] + [bool(hf.get("proj_share_all_but_first", True))] * (n - 1)


def convert_weights(hf: dict[str, Any], source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our model's state dict from the original's tensors (tied tensors may be stored once, under the input's name)."""
    used: set[str] = {"transformer.pos_emb.inv_freq"}  # a fixed table, recomputed here

    def take(name: str) -> torch.Tensor:
        if name not in source:
            raise ConversionError(f"the weights lack {name}, which this config needs")
        used.add(name)
        return source[name]

    div_val = hf.get("div_val", 1)
    tied, tie_projs, proj = tied_words(hf), tie_projections(hf), projected(hf)
    n_clusters = len(hf["cutoffs"]) + 1
    bounds = [0, *hf["cutoffs"], hf.get("vocab_size", hf.get("n_token"))]

    ours: dict[str, torch.Tensor] = {}
    for i in range(n_clusters):
        # div_val 1: one table (and one input projection) in the original, cut here into the clusters' rows
        layer, rows = (i, slice(0, None)) if div_val > 1 else (0, slice(bounds[i], bounds[i + 1]))
        ours[f"embed.tables.{i}.weight"] = take(f"transformer.word_emb.emb_layers.{layer}.weight")[rows]
        used.add(f"crit.out_layers.{layer}.weight")  # tied: a stored copy of the input table
        out = f"transformer.word_emb.emb_layers.{layer}.weight" if tied else f"crit.out_layers.{layer}.weight"
        ours[f"head.tables.{i}.weight"] = take(out)[rows]
        ours[f"head.tables.{i}.bias"] = take(f"crit.out_layers.{layer}.bias")[rows]
        if proj:
            ours[f"embed.projs.{i}.weight"] = take(f"transformer.word_emb.emb_projs.{layer}")
            ours[f"head.projs.{i}.weight"] = ours[f"embed.projs.{i}.weight"] if tie_projs[i] else \
                take(f"crit.out_projs.{i}")
    if n_clusters > 1:
        ours["head.cluster.weight"] = take("crit.cluster_weight")
        ours["head.cluster.bias"] = take("crit.cluster_bias")

    inner = hf["n_head"] * hf["d_head"]
    for n in range(hf["n_layer"]):
        hf_layer, layer = f"transformer.layers.{n}", f"layers.{n}"
        qkv = take(f"{hf_layer}.dec_attn.qkv_net.weight")
        ours[f"{layer}.attn.q_net.weight"], ours[f"{layer}.attn.kv_net.weight"] = qkv[:inner], qkv[inner:]
        for ours_name, hf_name in (("attn.r_net.weight", "dec_attn.r_net.weight"),
                                   ("attn.o_net.weight", "dec_attn.o_net.weight"),
                                   ("attn.layer_norm.weight", "dec_attn.layer_norm.weight"),
                                   ("attn.layer_norm.bias", "dec_attn.layer_norm.bias"),
                                   ("ff.net.0.weight", "pos_ff.CoreNet.0.weight"),
                                   ("ff.net.0.bias", "pos_ff.CoreNet.0.bias"),
                                   ("ff.net.3.weight", "pos_ff.CoreNet.3.weight"),
                                   ("ff.net.3.bias", "pos_ff.CoreNet.3.bias"),
                                   ("ff.layer_norm.weight", "pos_ff.layer_norm.weight"),
                                   ("ff.layer_norm.bias", "pos_ff.layer_norm.bias")):
            ours[f"{layer}.{ours_name}"] = take(f"{hf_layer}.{hf_name}")
        for bias in ("r_w_bias", "r_r_bias"):  # untie_r: one pair per layer, else one pair shared by every layer
            per_layer = f"{hf_layer}.dec_attn.{bias}"
            ours[f"{layer}.attn.{bias}"] = take(per_layer if hf.get("untie_r", True) else f"transformer.{bias}")
            used.add(per_layer)  # shared: pytorch_model.bin also stores it under each layer's name
    used |= {f"crit.out_projs.{i}" for i in range(n_clusters) if tie_projs[i]}  # stored copies of tied projections
    unknown = sorted(set(source) - used)
    if unknown:
        raise ConversionError(f"the weights hold {unknown[0]}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1
                              else "") + ", which this config does not explain; they may come from another model")
    return {k: v.contiguous() for k, v in ours.items()}


def check_fits(values: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Every weight of the model our config builds is there, with its shape (checked on the meta device)."""
    with torch.device("meta"):
        wanted = TransformerXL(XLConfig.from_dict(values)).state_dict()
    for name, tensor in wanted.items():
        if name not in weights:
            raise ConversionError(f"the converted weights lack {name}; the source does not fit its own config")
        if weights[name].shape != tensor.shape:
            raise ConversionError(f"{name} has shape {list(weights[name].shape)} but the config gives "
                                  f"{list(tensor.shape)}; the weights do not fit config.json")
    extra = sorted(set(weights) - set(wanted))
    if extra:
        raise ConversionError(f"the converted weights hold {extra[0]}, which the model does not have")
