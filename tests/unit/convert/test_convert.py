"""python -m xl.convert: a Hugging Face Transformer-XL converts, and matches the reference in float64.

The fixture (tests/fixtures/transfo_xl, written by scripts/make_transfo_xl_fixture.py with transformers 4.57.6 in a
venv of its own) holds a small random model with the WikiText-103 model's architecture and the reference's float64
log-probabilities, losses and greedy continuation. The converted model must give them through its forward, through
xl.evaluate's path and through its decoder; where transformers with Transformer-XL is importable, also live.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import CONF_DIR
from tests.helpers.hub_env import hub_offline, hub_online
from tests.helpers.paths import FIXTURES, ROOT
from xl.convert import ConversionError, RunFolderError, convert
from xl.convert.cli import main as convert_main
from xl.convert.fetch import FetchError
from xl.convert.weights import model_config, read_safetensors, transformers_config
from xl.data.words import WordTokenizer
from xl.evaluation import build_evaluator, evaluate
from xl.generation import generate
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL, count_parameters
from xl.training.build import build_datamodule, build_trainer
from xl.training.checkpoints.checkpoint import Checkpoint

FIXTURE = FIXTURES / "transfo_xl"
SCRIPT = ROOT / "scripts" / "make_transfo_xl_fixture.py"
REF = read_safetensors(FIXTURE / "reference.safetensors")
META = json.loads((FIXTURE / "reference.json").read_text())


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "wt"
    convert(FIXTURE, out)
    return out


def float64_model(run: Path) -> TransformerXL:
    checkpoint = Checkpoint.open(run)
    model = TransformerXL(XLConfig.from_dict(checkpoint.model_config)).double().eval()
    checkpoint.check_weights(model)
    model.load_state_dict(checkpoint.model_weights())
    return model


def segment_logprobs(model: TransformerXL, rows: torch.Tensor, tgt_len: int) -> torch.Tensor:
    """Log-probabilities of every position of ``rows`` read in segments with the memory carried."""
    mems, out = None, []
    with torch.no_grad():
        for start in range(0, rows.size(1) - 1, tgt_len):
            result = model(rows[:, start:min(start + tgt_len, rows.size(1) - 1)], mems)
            mems = result.mems
            out.append(result.logits)
    return torch.cat(out, dim=1)


def test_converted_model_gives_the_reference_log_probabilities_in_float64(converted):
    model = float64_model(converted)
    assert model.config.cutoffs == (20, 40, 70) and model.config.div_val == 4 and model.config.same_length
    assert (model.config.mem_len, model.config.clamp_len) == (META["mem_len"], META["clamp_len"])
    logprobs = segment_logprobs(model, REF["rows"], META["tgt_len"])
    torch.testing.assert_close(logprobs, REF["logprobs"], rtol=0, atol=1e-10)
    nll = -logprobs.gather(-1, REF["rows"][:, 1:, None])[..., 0]
    torch.testing.assert_close(nll, REF["nll"], rtol=0, atol=1e-10)
    assert model.config.clamp_len < META["mem_len"] + META["tgt_len"]  # the clamp is exercised


def test_converted_model_ties_what_the_original_ties(converted):
    """One to one: the converted model has exactly the source's parameters (the tied ones stored once in its
    safetensors file), its word vectors tied and the projections of the clusters the source ties."""
    model = float64_model(converted)
    cfg = model.config
    assert cfg.tie_weights and cfg.tie_projs == (False, True, True, True) and cfg.proj_all and cfg.d_embed is None
    source = read_safetensors(FIXTURE / "model.safetensors")
    assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for k, v in source.items()
                                                               if k != "transformer.pos_emb.inv_freq")
    embed, head = model.embed, model.head
    assert all(head.tables[i].weight is embed.tables[i].weight for i in range(4))
    assert [head.projs[i] is embed.projs[i] for i in range(4)] == [False, True, True, True]
    assert torch.equal(head.projs[0].weight, source["crit.out_projs.0"].double())


def wt103_parameters(hf: dict) -> int:
    """The published WikiText-103 model's parameters, counted from its layout as the original builds it: per cluster
    a table and an input projection, output biases, the untied output projections, the cluster scores; per layer the
    attention (qkv, r, o, u, v), the feed-forward and two layer norms."""
    d, inner, bounds = hf["d_model"], hf["n_head"] * hf["d_head"], [0, *hf["cutoffs"], hf["vocab_size"]]
    total = hf["vocab_size"] + (len(bounds) - 2) * (d + 1)
    for i in range(len(bounds) - 1):
        w = d // hf["div_val"] ** i
        total += (bounds[i + 1] - bounds[i]) * w + d * w + (0 if hf["tie_projs"][i] else d * w)
    layer = 5 * inner * d + 2 * inner + 2 * d * hf["d_inner"] + hf["d_inner"] + d + 4 * d
    return total + hf["n_layer"] * layer


def test_the_converted_wikitext_103_model_has_the_originals_parameter_count():
    """Counted on the meta device from the published model's config.json (nothing allocated): 285.2M, as the
    original's own count; the paper's 257M leaves out what it does not count."""
    hf = dict(vocab_size=267735, cutoffs=[20000, 40000, 200000], d_model=1024, d_embed=1024, n_head=16, d_head=64,
              d_inner=4096, div_val=4, n_layer=18, mem_len=1600, clamp_len=1000, same_length=True, untie_r=True,
              tie_projs=[False, True, True, True], dropout=0.1, dropatt=0.0, adaptive=True)
    ours = count_parameters(XLConfig.from_dict(model_config(transformers_config(hf))))
    assert ours == wt103_parameters(hf)
    assert round(ours / 1e6, 1) == 285.2


def test_converted_decoder_continues_greedily_like_the_reference(converted):
    model = float64_model(converted)
    prompt = REF["rows"][:, : META["prompt_len"]]
    new = generate(model, prompt, META["new_tokens"], window=META["mem_len"], seg_len=META["seg_len"],
                   temperature=0.0)
    assert torch.equal(new, REF["greedy"])


def test_word_tokenizer_gives_the_original_ids_and_decodes_back(converted):
    tokenizer = WordTokenizer(file=converted / "vocab.json")
    text = (FIXTURE / "text.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    assert ids.tolist() == REF["ids"].tolist()  # the script encodes by the original rule, line by line
    assert tokenizer.eos_id == 0 and tokenizer.unk_id == 5 and tokenizer.vocab_size == 100
    decoded = tokenizer.decode(ids)
    words = [w if w in tokenizer.itos else "<unk>" for w in text.split()]  # unknown words read back as <unk>
    assert decoded.split() == [w for w in (tokenizer.itos[i] for i in ids) if w != "<eos>"] == words
    assert decoded.count("\n") == text.count("\n")


def eval_config(run: Path, tmp_path: Path, *extra: str):
    text = FIXTURE / "text.txt"
    overrides = [f"ckpt={run}", "data=text", f"data.train={text}", f"data.val={text}", f"data.test={text}",
                 "data.tokenizer=word", f"data.tokenizer_file={run / 'vocab.json'}", f"data.cache_dir={tmp_path}",
                 f"data.batch_size={META['batch']}", f"data.tgt_len={META['tgt_len']}", "splits=[test]",
                 f"paths.output_dir={tmp_path / 'eval'}", "logger=none", "+trainer.enable_progress_bar=false",
                 "+trainer.enable_model_summary=false", *extra]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=overrides)


def test_evaluate_scores_the_reference_total(converted, tmp_path):
    """xl.evaluate with the checkpoint's own evaluation context (memory 7, clamp 4, same_length) and the converted
    vocabulary: float32 as run, then its module in float64 through the same Lightning test loop."""
    cfg = eval_config(converted, tmp_path)
    results = evaluate(cfg)["test"]
    tokens = REF["nll"].numel()
    assert results["test/tokens"] == tokens
    assert results["test/loss"] * tokens == pytest.approx(META["total_nll"], rel=1e-5)
    cfg = eval_config(converted, tmp_path, "trainer.precision=64-true")
    checkpoint = Checkpoint.open(converted)
    datamodule = build_datamodule(cfg)
    module = build_evaluator(cfg, checkpoint, datamodule).double()
    module.load_state_dict(checkpoint.state["state_dict"])  # the float64 tables unrounded
    (results,) = build_trainer(cfg).test(module, datamodule=datamodule, verbose=False)
    assert results["test/loss"] * tokens == pytest.approx(META["total_nll"], rel=0, abs=1e-9)


def test_pytorch_model_bin_with_tied_copies_converts_to_the_same_weights(converted, tmp_path):
    source = tmp_path / "bin"
    source.mkdir()
    for name in ("config.json", "vocab.pkl"):
        shutil.copy(FIXTURE / name, source / name)
    state = read_safetensors(FIXTURE / "model.safetensors")
    for i in range(4):  # save_pretrained(safe_serialization=False) keeps the tied tensors under both names
        state[f"crit.out_layers.{i}.weight"] = state[f"transformer.word_emb.emb_layers.{i}.weight"]
    for i in range(1, 4):
        state[f"crit.out_projs.{i}"] = state[f"transformer.word_emb.emb_projs.{i}"]
    torch.save(state, source / "pytorch_model.bin")
    convert(source, tmp_path / "out")
    a, b = Checkpoint.open(converted).model_weights(), Checkpoint.open(tmp_path / "out").model_weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def edited_source(tmp_path: Path, **changes) -> Path:
    source = tmp_path / "src"
    shutil.copytree(FIXTURE, source)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (source / "config.json").write_text(json.dumps(config))
    return source


@pytest.mark.parametrize("change, named", [
    (dict(attn_type=1), "attn_type=1"), (dict(sample_softmax=100), "sample_softmax=100"),
    (dict(pre_lnorm=True), "pre_lnorm=true"), (dict(adaptive=False), "adaptive=false"),
    (dict(layer_norm_epsilon=1e-12), "layer_norm_epsilon=1e-12"),
    (dict(ext_len=16), "ext_len=16"), (dict(cutoffs=[]), "cutoffs=[]"),
])
def test_unsupported_options_are_refused_naming_them_and_nothing_is_written(tmp_path, change, named):
    with pytest.raises(ConversionError, match=f"unsupported option {re.escape(named)}"):
        convert(edited_source(tmp_path, **change), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_shared_biases_and_untied_projections_map_too(tmp_path):
    """untie_r=false: one (u, v) pair for every layer; proj_share_all_but_first=false: separate output projections."""
    state = read_safetensors(FIXTURE / "model.safetensors")
    state["transformer.r_w_bias"] = state.pop("transformer.layers.0.dec_attn.r_w_bias")
    state["transformer.r_r_bias"] = state.pop("transformer.layers.0.dec_attn.r_r_bias")
    for name in ("r_w_bias", "r_r_bias"):
        del state[f"transformer.layers.1.dec_attn.{name}"]
    for i in range(1, 4):
        state[f"crit.out_projs.{i}"] = 2 * state[f"transformer.word_emb.emb_projs.{i}"]
    source = edited_source(tmp_path, untie_r=False, tie_projs=[False, False, False, False])
    (source / "model.safetensors").unlink()
    torch.save(state, source / "pytorch_model.bin")
    weights = Checkpoint.open(convert(source, tmp_path / "out")[0]).model_weights()
    for layer in range(2):
        assert torch.equal(weights[f"layers.{layer}.attn.r_w_bias"], state["transformer.r_w_bias"])
    assert torch.equal(weights["head.projs.2.weight"], state["crit.out_projs.2"])
    assert torch.equal(weights["embed.projs.2.weight"], state["transformer.word_emb.emb_projs.2"])


def test_a_stray_weight_or_a_vocabulary_of_another_size_is_refused(tmp_path):
    state = read_safetensors(FIXTURE / "model.safetensors")
    state["transformer.extra.weight"] = torch.zeros(2)
    source = edited_source(tmp_path)
    (source / "model.safetensors").unlink()
    torch.save(state, source / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"transformer\.extra\.weight.*does not explain"):
        convert(source, tmp_path / "out")
    with pytest.raises(ConversionError, match=r"vocab\.pkl has 100 words but config\.json a vocabulary of 120"):
        convert(edited_source(tmp_path / "b", vocab_size=120, cutoffs=[20, 40, 70]), tmp_path / "out")


def test_a_hub_id_offline_says_what_to_fetch_and_where(tmp_path, monkeypatch):
    hub_offline(monkeypatch)
    with pytest.raises(FetchError, match=r"download config\.json, pytorch_model\.bin .* vocab\.pkl .* from "
                                         r"https://huggingface\.co/transfo-xl/transfo-xl-wt103/tree/main into one "
                                         r"folder, and give that folder as SRC"):
        convert("transfo-xl/transfo-xl-wt103", tmp_path / "out")
    hub_online(monkeypatch)

    def unreachable(*args, **kwargs):
        raise OSError("no route to host")

    monkeypatch.setattr("socket.create_connection", unreachable)
    with pytest.raises(FetchError, match=r"huggingface\.co cannot be reached \(no route to host\); download config"):
        convert("transfo-xl/transfo-xl-wt103", tmp_path / "out")
    with pytest.raises(SystemExit, match=r"error: SRC=.*nowhere is neither a folder nor a hub id"):
        convert_main([str(tmp_path / "a" / "nowhere"), str(tmp_path / "out")])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(RunFolderError, match=r"OUT=.* exists and is not empty"):
        convert(FIXTURE, tmp_path / "full")


def reference_module():
    """scripts/make_transfo_xl_fixture.py, where transformers with Transformer-XL is importable."""
    pytest.importorskip("transformers.models.deprecated.transfo_xl.modeling_transfo_xl",
                        reason="transformers 4.x (Transformer-XL) is not installed")
    spec = importlib.util.spec_from_file_location("make_transfo_xl_fixture", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_logprobs(ref, hf, rows: torch.Tensor, tgt_len: int) -> torch.Tensor:
    mems, out = ref.empty_mems(hf, rows.size(0)), []
    with torch.no_grad():
        for start in range(0, rows.size(1) - 1, tgt_len):
            result = hf(rows[:, start:min(start + tgt_len, rows.size(1) - 1)], mems=mems)
            mems = result.mems
            out.append(result.prediction_scores)
    return torch.cat(out, 1)


def float64_reference_model(ref, folder: Path):
    return ref.float64_model(ref.TransfoXLLMHeadModel.from_pretrained(folder))


@pytest.mark.parametrize("variant", [
    {}, dict(div_val=1, d_embed=48), dict(div_val=1), dict(div_val=2, proj_share_all_but_first=False),
    dict(untie_r=False, same_length=False, clamp_len=-1), dict(div_val=2, d_embed=32), dict(div_val=2, d_embed=96),
    dict(div_val=1, d_embed=48, tie_projs=[True, False, True, False]), dict(tie_word_embeddings=False),
    dict(drop=("same_length", "mem_len", "clamp_len")),  # config.json silent: both read transformers' defaults
])
def test_live_comparison_with_transformers(converted, tmp_path, variant):
    """The fixture, and models of other options made here, against transformers itself (where version 4 is
    importable): the same log-probabilities in float64, and as many parameters (tied ones counted once)."""
    ref = reference_module()
    ref.float64_reference()
    source, out, built = FIXTURE, converted, None
    if variant:
        options = {k: v for k, v in variant.items() if k != "drop"}
        hf = ref.TransfoXLLMHeadModel(ref.TransfoXLConfig(**{**ref.ARCH, **options})).eval()
        ref.randomize(hf, torch.Generator().manual_seed(7))
        built = hf
        source, out = tmp_path / "source", tmp_path / "out"
        hf.save_pretrained(source, safe_serialization="untie_r" not in variant)  # shared biases: torch.save only
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                        if k not in variant.get("drop", ())}))
        shutil.copy(FIXTURE / "vocab.pkl", source / "vocab.pkl")
        convert(source, out)
    rows = torch.randint(0, 100, (3, 23), generator=torch.Generator().manual_seed(os.getpid()))
    hf = float64_reference_model(ref, source)
    theirs = reference_logprobs(ref, hf, rows, 6)
    ours = float64_model(out)
    torch.testing.assert_close(segment_logprobs(ours, rows, 6), theirs, rtol=0, atol=1e-10)
    # Copies here of what the original shares: with untie_r=false its one (u, v) pair is a pair per layer here; with
    # untied word vectors its tied projections are separate (tie_projs acts with tie_weights here).
    cfg, copies = ours.config, 0
    if not variant.get("untie_r", True):
        copies = (cfg.n_layer - 1) * 2 * cfg.n_head * cfg.d_head
    if not variant.get("tie_word_embeddings", True):
        copies = sum(ours.head.projs[i].weight.numel() for i in range(1, 4))  # the source ties clusters 1 to 3
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in (built or hf).parameters()) + copies


def test_live_the_reference_needs_float64_frequencies():
    """The third float64 edit (docs/pretrained.md): with its frequencies left as the library computes them (float32,
    widened), the reference misses its own float64 log-probabilities by 3e-9, over the tolerance of 1e-10."""
    ref = reference_module()
    ref.float64_reference()
    widened = ref.TransfoXLLMHeadModel.from_pretrained(FIXTURE).double().eval()
    rows = REF["rows"]
    error = (reference_logprobs(ref, widened, rows, META["tgt_len"]) - REF["logprobs"]).abs().max().item()
    assert 1e-9 < error < 1e-8
    exact = reference_logprobs(ref, float64_reference_model(ref, FIXTURE), rows, META["tgt_len"])
    torch.testing.assert_close(exact, REF["logprobs"], rtol=0, atol=1e-10)


def test_the_published_evaluation_config_sets_the_papers_context(converted, tmp_path, monkeypatch):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["+experiment=wt103_published", f"ckpt={converted}"])
    assert cfg.data.source.name == "wikitext-103" and cfg.data.tokenizer_file == f"{converted}/vocab.json"
    assert (cfg.data.eval_tgt_len, cfg.memory.eval_mem_len, cfg.memory.eval_clamp_len) == (128, 1600, 1000)
    assert cfg.memory.eval_same_length and cfg.data.batch_size == 10
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(Exception, match=r"wikitext-103 is not in the datasets cache.*data=text data\.train=PATH"):
        build_datamodule(cfg)
