"""Map a Hugging Face Transformer-XL (``TransfoXLLMHeadModel``: config.json and its weights) onto this project's model.

config.json is read as transformers 4.57.6 reads it (TransfoXLConfig's defaults where it is silent). Every option of
the published configs has a counterpart here, or the conversion stops with one sentence naming it; so does a source
that transformers would read otherwise than this model can (a legacy ``tie_weight`` that it ignores, stored sinusoid
frequencies other than the formula's, a stored copy of a tied tensor with other values).
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
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.checkpoints.torch_errors import load_failure

LAYER_NORM_EPS = 1e-5  # torch's default, which this project's layer norms use
# What transformers 4.57.6 (the last release with Transformer-XL) reads where config.json is silent: the arguments
# of TransfoXLConfig.__init__, and PretrainedConfig's tie_word_embeddings.
TRANSFORMERS_DEFAULTS = {
    "vocab_size": 267735, "cutoffs": [20000, 40000, 200000], "d_model": 1024, "d_embed": 1024, "n_head": 16,
    "d_head": 64, "d_inner": 4096, "div_val": 4, "pre_lnorm": False, "n_layer": 18, "mem_len": 1600,
    "clamp_len": 1000, "same_length": True, "proj_share_all_but_first": True, "attn_type": 0, "sample_softmax": -1,
    "adaptive": True, "dropout": 0.1, "dropatt": 0.0, "untie_r": True, "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
}
# TransfoXLConfig.attribute_map: these keys of config.json set the field they name (and win over it).
TRANSFORMERS_ALIASES = {"n_token": "vocab_size", "hidden_size": "d_model", "num_attention_heads": "n_head",
                        "num_hidden_layers": "n_layer"}
INV_FREQ = "transformer.pos_emb.inv_freq"


class ConversionError(ValueError):
    """A source this converter cannot turn into an exact model of ours; the message names the option."""


def read_config(path: Path) -> dict[str, Any]:
    """config.json as transformers 4 reads it (:func:`transformers_config`)."""
    try:
        given = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConversionError(f"{path} is not JSON ({err})") from None
    if not isinstance(given, dict):
        raise ConversionError(f"{path} holds a {type(given).__name__}, not the JSON object of a model config")
    return transformers_config(given)


def transformers_config(given: dict[str, Any]) -> dict[str, Any]:
    """A config.json's keys over :data:`TRANSFORMERS_DEFAULTS`, its aliases resolved, as TransfoXLConfig reads them.
    The original code's ``tie_weight``, which transformers ignores, is refused where it says otherwise."""
    hf = {**TRANSFORMERS_DEFAULTS, **{k: v for k, v in given.items() if k not in TRANSFORMERS_ALIASES}}
    hf.update({TRANSFORMERS_ALIASES[k]: v for k, v in given.items() if k in TRANSFORMERS_ALIASES})
    if "tie_weight" in given and bool(given["tie_weight"]) != bool(hf["tie_word_embeddings"]):
        raise ConversionError(
            f"config.json sets tie_weight={json.dumps(given['tie_weight'])}, which transformers 4 ignores: it reads "
            f"tie_word_embeddings ({json.dumps(hf['tie_word_embeddings'])}) and ties the word vectors by that; set "
            "tie_word_embeddings to what the weights are, and remove tie_weight")
    return hf


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file's tensors, read by the ``safetensors`` library, which refuses a header whose offsets
    do not cover the file exactly, overlap, or disagree with the shapes and dtypes."""
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as err:
        raise ConversionError(f"{path} is not a readable safetensors file ({err}); it is damaged or not the "
                              "model's weights") from None


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The source's tensors, from model.safetensors or pytorch_model.bin (read with ``weights_only``)."""
    safetensors, binary = folder / "model.safetensors", folder / "pytorch_model.bin"
    if safetensors.is_file():
        return read_safetensors(safetensors), safetensors.name
    if not binary.is_file():
        raise ConversionError(f"{folder} has neither model.safetensors nor pytorch_model.bin")
    try:
        state = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses pickled code; a damaged file raises many types
        raise ConversionError(f"{binary} cannot be read as weights: {load_failure(err)}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ConversionError(f"{binary} does not hold a dict of named tensors; it is not a model's weights")
    return dict(state), binary.name


def model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Our XLConfig fields for a Hugging Face Transformer-XL config (:func:`read_config`); an option we cannot
    reproduce is refused."""
    if hf.get("model_type", "transfo-xl") != "transfo-xl":
        raise ConversionError(f"config.json describes a {hf.get('model_type')} model, not transfo-xl")
    vocab, cutoffs, d_model, d_embed = hf["vocab_size"], list(hf["cutoffs"]), hf["d_model"], hf["d_embed"]
    refusals = [
        (hf["attn_type"] != 0, f"attn_type={hf['attn_type']}: only relative attention (0) exists here"),
        (hf["sample_softmax"] > 0, f"sample_softmax={hf['sample_softmax']}: sampled softmax is not supported"),
        (hf.get("ext_len", 0) > 0, f"ext_len={hf.get('ext_len')}: extended context is not supported"),
        (hf["pre_lnorm"], "pre_lnorm=true: the original has no final layer norm after pre-norm layers and ours has "
                          "one"),
        (not hf["adaptive"], "adaptive=false: its meaning differs between implementations (this format's model "
                             "ignores it); set it true if the weights have cutoffs"),
        (not cutoffs, "cutoffs=[]: one softmax with output biases has no counterpart here"),
        (hf["layer_norm_epsilon"] != LAYER_NORM_EPS,
         f"layer_norm_epsilon={hf['layer_norm_epsilon']}: our layer norms use {LAYER_NORM_EPS}"),
    ]
    for refused, reason in refusals:
        if refused:
            raise ConversionError(f"unsupported option {reason}")
    clamp_len = hf["clamp_len"]
    values = {
        "vocab_size": vocab, "n_layer": hf["n_layer"], "n_head": hf["n_head"], "d_model": d_model,
        "d_head": hf["d_head"], "d_inner": hf["d_inner"], "dropout": hf["dropout"], "dropatt": hf["dropatt"],
        "mem_len": hf["mem_len"], "clamp_len": clamp_len if clamp_len > 0 else -1,
        "same_length": bool(hf["same_length"]), "pre_lnorm": False, "tie_weights": tied_words(hf),
        "cutoffs": cutoffs, "div_val": hf["div_val"],
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
    return bool(hf["tie_word_embeddings"])


def projected(hf: dict[str, Any]) -> bool:
    """Whether the original projects its word vectors (every cluster, or the one table) to d_model."""
    return hf["div_val"] > 1 or hf["d_embed"] != hf["d_model"]


def tie_projections(hf: dict[str, Any]) -> list[bool]:
    """Which output projections the original shares with the input side: config.json's tie_projs, else every one
    but the first's where proj_share_all_but_first (TransfoXLConfig's rule)."""
    n = len(hf["cutoffs"]) + 1
    if "tie_projs" not in hf:
        return [False] + [bool(hf["proj_share_all_but_first"])] * (n - 1)
    if not isinstance(hf["tie_projs"], list) or len(hf["tie_projs"]) != n:
        raise ConversionError(f"config.json's tie_projs={hf['tie_projs']} does not give one flag for each of the "
                              f"{n} clusters its cutoffs make")
    return [bool(t) for t in hf["tie_projs"]]


def check_stored_copy(source: dict[str, torch.Tensor], copy: str, original: str) -> None:
    """A tensor that the config ties to another may be stored under its own name too (save_pretrained without
    safetensors keeps both); transformers then uses the other one, so the copy must hold the same values."""
    if copy in source and original in source and not torch.equal(source[copy], source[original]):
        raise ConversionError(f"the weights hold {copy} with values other than {original}, which config.json ties "
                              "it to; transformers would use the latter and drop them, so the source is refused "
                              "(set tie_word_embeddings or tie_projs to what the weights are)")


def check_frequencies(hf: dict[str, Any], source: dict[str, torch.Tensor]) -> None:
    """The stored sinusoid frequencies (transformers loads them) must be those this model computes,
    1/10000^(2i/d_model), up to their dtype's rounding."""
    if INV_FREQ not in source:
        return
    stored, d_model = source[INV_FREQ], hf["d_model"]
    wanted = 1 / (10000 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model))
    if stored.shape != wanted.shape or not stored.is_floating_point():
        raise ConversionError(f"the weights' {INV_FREQ} has shape {list(stored.shape)} and dtype {stored.dtype}; "
                              f"the sinusoid of d_model={d_model} has {len(wanted)} floating-point frequencies")
    error = ((stored.double() - wanted).abs() / wanted).max().item()
    if error > 16 * torch.finfo(stored.dtype).eps:
        raise ConversionError(f"the weights' {INV_FREQ} differs from the sinusoid's frequencies 1/10000^(2i/d_model) "
                              f"by up to {error:.2g} (relative); this model computes them by that formula, so a "
                              "source with other frequencies is refused")


def convert_weights(hf: dict[str, Any], source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our model's state dict from the original's tensors (tied tensors may be stored once, under the input's name)."""
    check_frequencies(hf, source)
    used: set[str] = {INV_FREQ}  # checked above; this model computes it

    def take(name: str) -> torch.Tensor:
        if name not in source:
            raise ConversionError(f"the weights lack {name}, which this config needs")
        if not source[name].is_floating_point():
            raise ConversionError(f"the weights' {name} has dtype {source[name].dtype}; a model's weights are "
                                  "floating point")
        used.add(name)
        return source[name]

    div_val = hf["div_val"]
    tied, tie_projs, proj = tied_words(hf), tie_projections(hf), projected(hf)
    n_clusters = len(hf["cutoffs"]) + 1
    bounds = [0, *hf["cutoffs"], hf["vocab_size"]]

    ours: dict[str, torch.Tensor] = {}
    for i in range(n_clusters):
        # div_val 1: one table (and one input projection) in the original, cut here into the clusters' rows
        layer, rows = (i, slice(0, None)) if div_val > 1 else (0, slice(bounds[i], bounds[i + 1]))
        table = f"transformer.word_emb.emb_layers.{layer}.weight"
        ours[f"embed.tables.{i}.weight"] = take(table)[rows]
        if tied:
            check_stored_copy(source, f"crit.out_layers.{layer}.weight", table)
            used.add(f"crit.out_layers.{layer}.weight")
        ours[f"head.tables.{i}.weight"] = take(table if tied else f"crit.out_layers.{layer}.weight")[rows]
        ours[f"head.tables.{i}.bias"] = take(f"crit.out_layers.{layer}.bias")[rows]
        if proj:
            ours[f"embed.projs.{i}.weight"] = take(f"transformer.word_emb.emb_projs.{layer}")
            if tie_projs[i]:
                check_stored_copy(source, f"crit.out_projs.{i}", f"transformer.word_emb.emb_projs.{layer}")
                used.add(f"crit.out_projs.{i}")
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
            if not hf["untie_r"]:  # shared: pytorch_model.bin also stores it under each layer's name
                check_stored_copy(source, per_layer, f"transformer.{bias}")
                used.add(per_layer)
            ours[f"{layer}.attn.{bias}"] = take(per_layer if hf["untie_r"] else f"transformer.{bias}")
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
