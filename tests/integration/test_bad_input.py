"""Bad input, key by key: one sentence naming the setting, before any work, nothing half-written."""

from __future__ import annotations

import dataclasses
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError

import xl.evaluate
import xl.footprint
import xl.training.build
from tests.conftest import CONF_DIR, compose_config, run_hydra_main, tiny_overrides
from tests.helpers.paths import ROOT
from xl.config.compose import compose as compose_or_explain
from xl.config.compose import entry_point
from xl.config.compose_errors import describe_error
from xl.config.machine import run_estimate
from xl.config.rules import ConfigError, check_config
from xl.data import DataError
from xl.settings.bounds import describe_type, schema_bounds
from xl.training.build import build_run, check_fits
from xl.training.checkpoints.checkpoint import CheckpointError

SHORT = 200  # characters: a refusal is one sentence a reader takes in at a glance


def files(tmp_path: Path, train: bytes | None = None, val: bytes | None = None) -> dict[str, Path]:
    text = (ROOT / "xl" / "model" / "transformer.py").read_bytes()
    paths = {}
    for split, content in (("train", train), ("val", val), ("test", None)):
        paths[split] = tmp_path / f"{split}.txt"
        if content != b"MISSING":
            paths[split].write_bytes(text if content is None else content)
    return paths


def assert_nothing_written(tmp_path: Path, cache_too: bool = False) -> None:
    assert not (tmp_path / "run").exists(), "nothing may be written before the input is known to be good"
    if cache_too:
        assert not (tmp_path / "cache").exists(), "refused before the corpus is read"
    # No temporary or partial file is left; a cache without meta.json (written last) is never trusted.
    assert [p.name for p in tmp_path.rglob("*") if "tmp" in p.name or p.name.startswith(".")] == []


ROWS = {
    # name: (overrides, corpus (train, val) or None, error type, text the message must contain)
    "negative memory": (["memory.mem_len=-1"], None, ConfigError, "memory.mem_len must be an integer >= 0"),
    "zero batch": (["data.batch_size=0"], None, ConfigError, "data.batch_size must be at least 1, got 0"),
    "zero heads": (["model.n_head=0"], None, ConfigError, "model.n_head must be a positive integer"),
    "odd width": (["model.d_model=31"], None, ConfigError, "model.d_model must be even"),
    "dropout out of range": (["model.dropout=1.0"], None, ConfigError, "model.dropout must be in [0, 1)"),
    "same_length without memory": (["memory.mem_len=0", "memory.same_length=true"], None, ConfigError,
                                   "same_length=True needs mem_len > 0"),
    "evaluation memory negative": (["memory.eval_mem_len=-1"], None, ConfigError,
                                   "memory.eval_mem_len must be null or an integer >= 0, got -1"),
    "evaluation clamp 0": (["memory.eval_clamp_len=0"], None, ConfigError, "memory.eval_clamp_len must be"),
    "evaluation same_length without evaluation memory": (
        ["memory.eval_mem_len=0", "memory.eval_same_length=true"], None, ConfigError,
        "memory.eval_same_length=True needs mem_len > 0 (the window is memory.eval_mem_len keys wide)"),
    "bad cache dtype": (["memory.mem_dtype=int8"], None, ConfigError, "memory.mem_dtype must be one of"),
    "compression rate that does not divide the segment": (
        ["memory=compressive", "memory.cmem_rate=3"], None, ConfigError, "memory.cmem_rate=3 must divide data.tgt_len"),
    "compressive memory with same_length": (["memory=compressive", "memory.eval_same_length=true"], None, ConfigError,
                                            "would hide the compressed memory"),
    "cutoffs beyond the vocabulary": (["model.cutoffs=[100,300]"], None, ConfigError,
                                      "model.cutoffs must be strictly increasing"),
    "missing corpus": ([], (b"MISSING", None), DataError, "data.train"),
    "empty corpus": ([], (b"", None), DataError, "data.train"),
    "binary garbage for char data": (["data.tokenizer=char"], (None, b"\x00\x01\x02" * 50), DataError, "data.val"),
    "corpus too short for one batch": ([], (None, b"tiny"), DataError, "data.eval_batch_size"),
    "half precision on CPU": (["precision=16-mixed"], None, ConfigError, "use precision=32-true on CPU"),
    "GPU asked, none present": (["trainer=gpu"], None, ConfigError, "use trainer=cpu"),
    "missing checkpoint": (["ckpt_path=/nonexistent/last.ckpt"], None, CheckpointError, "ckpt_path="),
}


@pytest.mark.parametrize("row", ROWS)
def test_bad_input_is_one_sentence_naming_the_setting(row, tmp_path, corpus):
    overrides, data, error, text = ROWS[row]
    if data is not None:
        corpus = files(tmp_path, *data)
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), *overrides)
    with pytest.raises(error) as info:
        build_run(cfg)
    message = str(info.value)
    assert text in message and "\n" not in message
    assert_nothing_written(tmp_path)


def test_a_folder_given_as_a_corpus_file_is_called_a_folder(tmp_path, corpus):
    (tmp_path / "texts").mkdir()
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), f"data.train={tmp_path / 'texts'}")
    with pytest.raises(DataError, match=r"^data.train=\S+texts is a folder; set data.train=PATH to a text file$"):
        build_run(cfg)
    assert_nothing_written(tmp_path)


# ---- every key: a value of the wrong type stops composition with one sentence ----------------------------------
def schema_fields(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(full key, type) of every leaf under ``node`` that a schema dataclass types."""
    schema = OmegaConf.get_type(node)
    hints = get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
    for name in node:
        child = node._get_node(name)
        if isinstance(child, DictConfig):
            yield from schema_fields(child, f"{prefix}{name}.")
        elif name in hints and not str(name).startswith("_"):
            yield f"{prefix}{name}", hints[name]


def typed_leaves() -> list[tuple[str, str]]:
    """(key, expected words) for every leaf of the full config whose type a word cannot satisfy."""
    cfg = compose_config("data=text", "logger=wandb", "data.train=a", "data.val=b", "data.test=c")
    leaves = [(key, describe_type(hint)) for key, hint in schema_fields(cfg)]
    return [(key, words) for key, words in leaves if "a string" not in words and words != "a value"]


LEAVES = typed_leaves()


def test_every_group_has_typed_keys():
    groups = {key.split(".")[0] for key, _ in LEAVES if "." in key}
    assert groups == {"model", "memory", "data", "optim", "trainer", "callbacks", "logger", "compile"}
    assert {"seed", "test", "train", "max_nonfinite_steps", "tags"} <= {key for key, _ in LEAVES}


@pytest.mark.parametrize("key,expected", LEAVES, ids=[key for key, _ in LEAVES])
def test_a_word_where_a_number_goes_is_one_sentence(key, expected):
    with pytest.raises(ConfigError) as info:
        compose_or_explain("config", ["data=text", "logger=wandb", f"{key}=abc"])
    assert str(info.value) == f"{key} must be {expected}, got 'abc'"


@pytest.mark.parametrize("override,sentence", [
    ("memory.mem_lenn=3", "memory.mem_lenn is not a setting; did you mean memory.mem_len?"),
    ("model.n_layers=3", "model.n_layers is not a setting; did you mean model.n_layer?"),
    ("optim.learning_rate=3", "optim.learning_rate is not a setting; optim has lr, weight_decay, betas, eps, "
                              "warmup_steps, min_lr_ratio"),
    ("sed=3", "sed is not a setting; did you mean seed?"),
    ("model=smal", "model=smal is not an option of the model group; choose one of base, small, tiny"),
    ("precision=fp16", "precision=fp16 is not an option of the precision group; choose one of 16-mixed, 32-true, "
                       "auto, bf16-mixed, bf16-true"),
    ("memory.mem_len=null", "memory.mem_len must be an integer, got 'null'"),
    ("memory.eval_same_length=maybe", "memory.eval_same_length must be true, false or null, got 'maybe'"),
    ("model.cutoffs=[20000,a]", "model.cutoffs must be a list of integers, got 'a' at position 1"),
    ("optim.betas=0.9", "optim.betas must be a list of numbers, got '0.9'"),
    ("~model.n_layer", "model.n_layer cannot be removed; set it to another value"),
    ("memory.mem_len=0,64", "memory.mem_len=0,64 gives several values: add -m to run one job for each, or write "
                            "memory.mem_len=[0,64] for a list"),
    ("data.tokenizer_kwargs.vocab_size=8000", "data.tokenizer_kwargs.vocab_size is not in the config yet; add it with "
                                              "a + in front, +data.tokenizer_kwargs.vocab_size=8000 (Hydra's prefix "
                                              "for a new key)"),
    ("model.n_layer=[1,", "the command line cannot be read (no viable alternative at input '[1,'); see Hydra's "
                          "override grammar"),
])
def test_composition_errors_are_one_sentence(override, sentence):
    with pytest.raises(ConfigError) as info:
        compose_or_explain("config", [override])
    assert str(info.value) == sentence


def test_a_misspelt_key_in_a_config_file_names_the_file(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "mine.yaml").write_text("defaults:\n  - /model_schema@_here_\nn_layers: 3\n")
    (conf / "model" / "wrong.yaml").write_text("defaults:\n  - /model_schema@_here_\nd_model: wide\n")
    for option, sentence in [
        ("mine", "model.n_layers is not a setting (in conf/model/mine.yaml); did you mean model.n_layer?"),
        ("wrong", "model.d_model must be an integer, got 'wide' (in conf/model/wrong.yaml)"),
    ]:
        with pytest.raises(ConfigCompositionException) as info:
            with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
                compose("config", overrides=[f"model={option}"])
        assert describe_error(info.value) == sentence


# ---- every key: a value out of range is one sentence before any work -----------------------------------------
BAD_VALUES = {
    "memory.mem_len": -1, "memory.eval_mem_len": -2, "memory.clamp_len": 0, "memory.eval_clamp_len": -3,
    "memory.mem_dtype": "float8", "memory.doc_boundaries": "sometimes", "memory.grad_segments": 0,
    "optim.weight_decay": -0.1, "optim.eps": 0.0, "optim.betas": "[0.9,1.5]",
    "trainer.accelerator": "abacus", "trainer.devices": 0, "trainer.num_nodes": 0, "trainer.precision": "fp8",
    "trainer.max_steps": -2, "trainer.max_epochs": -5, "trainer.limit_train_batches": 1.5,
    "trainer.limit_val_batches": -1, "trainer.limit_test_batches": 2.0, "trainer.val_check_interval": 0,
    "trainer.check_val_every_n_epoch": 0, "trainer.gradient_clip_val": -1.0, "trainer.accumulate_grad_batches": 0,
    "trainer.log_every_n_steps": 0, "trainer.num_sanity_val_steps": -2, "trainer.deterministic": "always",
    "callbacks.model_checkpoint.mode": "lowest", "callbacks.model_checkpoint.save_top_k": -2,
    "callbacks.model_checkpoint.save_last": "always", "callbacks.model_checkpoint.every_n_train_steps": -1,
    "callbacks.lr_monitor.logging_interval": "batch", "callbacks.progress_bar.refresh_rate": -1,
    "compile.mode": "fastest", "seed": -1, "max_nonfinite_steps": 0,
    "model.n_layer": 0, "model.n_head": -1, "model.d_model": 0, "model.d_head": 0, "model.d_inner": 0,
    "model.dropout": 1.0, "model.dropatt": -0.1, "model.init_std": 0, "model.div_val": 0, "model.d_embed": 0,
    "model.tie_projs": "some",
    "optim.lr": -1.0, "optim.warmup_steps": -1,
    "optim.min_lr_ratio": 1.5, "data.tokenizer": "sentencepiece", "data.batch_size": 0, "data.eval_batch_size": 0,
    "data.tgt_len": -1, "data.eval_tgt_len": 0,
}


def test_every_range_rule_is_tested():
    """Every key whose schema field declares a bound has a bad value here (the full config: every group)."""
    cfg = compose_config("data=text", "logger=wandb", "data.train=a", "data.val=b", "data.test=c")
    assert set(BAD_VALUES) == {key for key, *_ in schema_bounds(cfg)}


# Each memory variant's own settings, with the option that has them.
VARIANT_BAD_VALUES = {"memory.cmem_len": ("compressive", 0), "memory.cmem_rate": ("compressive", 0),
                      "memory.cmem_fn": ("compressive", "max"), "memory.num_tokens": ("tokens", 0)}


def test_every_range_rule_of_every_memory_is_tested():
    for option in ("compressive", "tokens"):
        cfg = compose_config(f"memory={option}")
        keys = {key for key, *_ in schema_bounds(cfg) if key.startswith("memory.")}
        assert keys - set(BAD_VALUES) == {k for k, (o, _) in VARIANT_BAD_VALUES.items() if o == option}


@pytest.mark.parametrize("key", [*BAD_VALUES, *VARIANT_BAD_VALUES])
def test_a_value_out_of_range_is_one_sentence_before_any_work(key, tmp_path, corpus):
    option, value = VARIANT_BAD_VALUES.get(key, (None, BAD_VALUES.get(key)))
    memory = [f"memory={option}"] if option else []
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), *memory, f"{key}={value}")
    with pytest.raises(ConfigError) as info:
        build_run(cfg)
    assert str(info.value).startswith(f"{key} must be ") and "\n" not in str(info.value)
    assert_nothing_written(tmp_path, cache_too=True)


@pytest.mark.parametrize("override,error,text", [
    ("optim.lr=0", ConfigError, "optim.lr must be a finite number > 0, got 0"),
    ("optim.warmup_steps=-1", ConfigError, "optim.warmup_steps must be an integer >= 0, got -1"),
    ("optim.min_lr_ratio=2", ConfigError, "optim.min_lr_ratio must be a number in [0, 1], got 2"),
    ("model.div_val=0", ConfigError, "model.div_val must be a positive integer"),
    ("data.tgt_len=0", ConfigError, "data.tgt_len must be at least 1"),
    ("data.eval_tgt_len=0", ConfigError, "data.eval_tgt_len must be at least 1"),
    ("data.eval_batch_size=0", ConfigError, "data.eval_batch_size must be at least 1"),
    ("data.tokenizer=sentencepiece", ConfigError,
     "data.tokenizer must be one of byte, char, word, bpe, unigram, got 'sentencepiece'"),
    ("data.tokenizer=word data.tokenizer_kwargs={min_freq:0}", DataError,
     "data.tokenizer_kwargs.min_freq must be at least 1"),
    ("+model.n_layers=5", ConfigError, "model.n_layers is not a setting; model has n_layer, n_head"),
    ("+optim.momentum=0.9", ConfigError, "optim.momentum is not a setting; optim has lr"),
    ("+trainer.max_step=5", ConfigError, "trainer.max_step is not an argument of lightning.pytorch.Trainer"),
    ("+callbacks.model_checkpoint.every_n_step=5", ConfigError,
     "callbacks.model_checkpoint.every_n_step is not an argument of "
     "xl.training.checkpoints.model_checkpoint.ModelCheckpoint"),
    ("trainer=ddp trainer.strategy._target_=lightning.pytorch.strategies.Nope", ConfigError,
     "trainer.strategy._target_=lightning.pytorch.strategies.Nope cannot be imported"),
    ("compile.enabled=true compile.backend=warp", ConfigError, "compile.backend must be one of"),
])
def test_other_settings_checked_before_any_work(override, error, text, tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), *override.split())
    with pytest.raises(error) as info:
        build_run(cfg)
    assert text in str(info.value) and "\n" not in str(info.value)
    assert_nothing_written(tmp_path, cache_too=True)


# ---- sizes that cannot fit -------------------------------------------------------------------------------------
@pytest.mark.parametrize("override,setting", [("memory.mem_len=1000000000", "memory.mem_len"),
                                              ("data.tgt_len=1000000", "data.tgt_len"),
                                              ("memory.eval_mem_len=1000000000", "memory.eval_mem_len"),
                                              ("model.d_inner=100000000", "model.d_inner")])
def test_a_run_too_big_for_the_machine_is_refused_at_once(override, setting, tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), override)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        build_run(cfg)
    message = str(info.value)
    assert time.perf_counter() - start < 5
    assert message.startswith("this run needs about ") and "\n" not in message
    assert setting in message.split("; lower ")[1]
    assert "of this machine's available RAM" in message
    assert_nothing_written(tmp_path, cache_too=True)


def test_a_run_close_to_the_limit_warns(tmp_path, corpus, monkeypatch, caplog):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus))
    need = run_estimate(cfg)[0].total
    monkeypatch.setattr(xl.training.build, "available_memory", lambda cuda: (int(need / 0.9), "a test device"))
    check_fits(cfg)
    assert "close to the limit" in caplog.text
    monkeypatch.setattr(xl.training.build, "available_memory", lambda cuda: (need - 1, "a test device"))
    with pytest.raises(ConfigError, match="against 0.0 GiB of a test device; lower"):
        check_fits(cfg)


def test_cpu_processes_share_the_machines_memory(tmp_path, corpus):
    one, processes = run_estimate(compose_config(*tiny_overrides(tmp_path, corpus)))
    ddp = compose_config(*tiny_overrides(tmp_path, corpus), "trainer=ddp")
    two, processes_ddp = run_estimate(ddp)
    assert (processes, processes_ddp) == (1, 2) and one == two


def test_char_vocabulary_gap_is_reported_and_read_as_unknown(tmp_path, caplog):
    corpus = files(tmp_path, b"abc abc\n" * 200, b"abz \xc3\xa9\xc3\xa9\n" * 50)
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "data.tokenizer=char", "data.batch_size=2")
    run = build_run(cfg)
    assert run.datamodule.vocab_size == len(set("abc \n")) + 1
    assert "150 char symbols of the val split are not in the vocabulary" in caplog.text


# ---- the entry points ------------------------------------------------------------------------------------------
def run_in_process(main, argv: list[str], monkeypatch, capsys) -> str:
    """The ``error: ...`` a command exits with; nothing else may have been printed to stderr."""
    with pytest.raises(SystemExit) as info:
        run_hydra_main(main, argv, monkeypatch)
    assert capsys.readouterr().err == ""
    assert len(str(info.value.code)) < SHORT, info.value.code
    return info.value.code


def train_main() -> None:
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


@pytest.mark.parametrize("argv,sentence", [
    (["model.n_layer=abc"], "error: model.n_layer must be an integer, got 'abc'"),
    (["memory.mem_lenn=3"], "error: memory.mem_lenn is not a setting; did you mean memory.mem_len?"),
    (["data=text"], "error: data.test, data.train, data.val have no value; set data.test=... data.train=... "
                    "data.val=... on the command line"),
    (["memory=longest"], "error: memory=longest is not an option of the memory group; choose one of "
                         + ", ".join(sorted(p.stem for p in (CONF_DIR / "memory").glob("*.yaml")))),
    (["run_name=${nowhere}"], "error: run_name cannot be resolved (Interpolation key 'nowhere' not found)"),
])
def test_train_command_reports_one_sentence(argv, sentence, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_in_process(train_main, ["train.py", "logger=none", *argv], monkeypatch, capsys) == sentence
    assert "HYDRA_FULL_ERROR" not in os.environ
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "outputs"])  # Hydra's run folder at most, no checkpoint
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_failure_inside_a_command_keeps_its_traceback(tmp_path, monkeypatch):
    """Only composition errors become one sentence: a bug in the command itself still raises."""
    monkeypatch.chdir(tmp_path)

    @entry_point("config")
    def broken(cfg: DictConfig) -> None:
        return cfg.no_such_key

    with pytest.raises(ConfigAttributeError):
        run_hydra_main(broken, ["broken.py", "logger=none"], monkeypatch)


def test_evaluate_command_without_a_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sentence = run_in_process(xl.evaluate.main, ["xl/evaluate.py", "warmup=x"], monkeypatch, capsys)
    assert sentence == "error: warmup must be an integer, got 'x'"
    sentence = run_in_process(xl.evaluate.main, ["xl/evaluate.py"], monkeypatch, capsys)
    assert sentence == "error: ckpt has no value; set ckpt=... on the command line"


def test_footprint_command_refuses_a_bad_setting(capsys):
    with pytest.raises(SystemExit) as info:
        xl.footprint.main(["--run", "memory.mem_len=abc"])
    assert info.value.code == "error: memory.mem_len must be an integer, got 'abc'"


def run_train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_unknown_key_and_unwritable_output_folder_from_the_command_line(tmp_path):
    result = run_train(tmp_path, "memory.mem_lenn=3")
    assert result.returncode == 1
    assert result.stderr == "error: memory.mem_lenn is not a setting; did you mean memory.mem_len?\n"
    result = run_train(tmp_path, "hydra.run.dir=/etc/hostname/run")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "cannot write to the output folder /etc/hostname/run" in result.stderr and "hydra.run.dir" in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_the_composed_config_keeps_its_types_for_the_run(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus))
    assert OmegaConf.get_type(cfg.model).__name__ == "ModelSchema"
    assert OmegaConf.get_type(cfg.trainer).__name__ == "TrainerSchema"


# ---- docs/bad-input.md: every row is true ------------------------------------------------------------------------
BAD_INPUT_PAGE = ROOT / "docs" / "bad-input.md"


def test_every_sentence_of_the_bad_input_page_is_short():
    sentences = re.findall(r"`(error: [^`]+)`", BAD_INPUT_PAGE.read_text())
    assert len(sentences) > 30
    assert [s for s in sentences if len(s) >= SHORT] == []


def page_rows(columns: int) -> list[tuple[str, ...]]:
    """The rows of the page's tables with ``columns`` cells, each cell a code span."""
    cell = r"\s*`([^`]+)`\s*"
    return [m.groups() for line in BAD_INPUT_PAGE.read_text().splitlines()
            if (m := re.fullmatch(r"\|" + r"\|".join([cell] * columns) + r"\|", line))]


def settings_rows() -> list[Any]:
    page = BAD_INPUT_PAGE.read_text()
    without_gpu = page.split("Without a CUDA GPU", 1)[1].split("##", 1)[0]
    rows = []
    for given, seen in page_rows(2):
        marks = [pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")] if given in without_gpu \
            else []
        rows.append(pytest.param(given, seen, marks=marks, id=given))
    return rows


@pytest.mark.parametrize("given,seen", settings_rows())
def test_each_row_of_the_bad_input_page_is_what_the_run_says(given, seen, tmp_path, corpus):
    with pytest.raises((ConfigError, DataError, CheckpointError)) as info:
        cfg = compose_or_explain("config", [*tiny_overrides(tmp_path, corpus), *shlex.split(given)])
        build_run(cfg)
    sentence = "error: " + str(info.value)
    pattern = ".*".join(re.escape(part.strip()) for part in seen.split("…"))  # "…": the run's own figures
    assert re.fullmatch(pattern, sentence), sentence
    assert len(sentence) < SHORT, sentence
    assert_nothing_written(tmp_path)


def test_each_other_row_of_the_bad_input_page_names_a_test_that_exists():
    rows = [row for row in BAD_INPUT_PAGE.read_text().splitlines() if row.count("|") == 4 and "::test_" in row]
    assert len(rows) >= 8
    for row in rows:
        path, name = re.search(r"`(tests/\S+\.py)::(test_\w+)`", row).groups()
        assert f"def {name}(" in (ROOT / path).read_text(), row


@pytest.mark.parametrize("argv,sentence", [
    (["warmup=-1"], "error: warmup must be an integer >= 0, got -1"),
    (["splits=[val,train]"], "error: splits must be a list of val and test, got ['val', 'train']"),
    (["memory.eval_mem_len=-2"], "error: memory.eval_mem_len must be null or an integer >= 0, got -2"),
    (["memory.doc_boundaries=sometimes"],
     "error: memory.doc_boundaries must be reset, ignore or null, got 'sometimes'"),
    (["vanilla=true", "per_document=true"],
     "error: per_document=true reports the cached evaluation; set vanilla=false"),
])
def test_evaluate_settings_are_checked_before_the_checkpoint_is_read(argv, sentence, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["xl/evaluate.py", "logger=none", f"ckpt={tmp_path / 'nowhere'}", *argv]
    assert run_in_process(xl.evaluate.main, argv, monkeypatch, capsys) == sentence


# ---- settings that used to end in a traceback, or in a false sentence --------------------------------------------
def test_a_checkpoint_monitor_that_no_metric_matches_is_refused_before_training(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "callbacks.model_checkpoint.monitor=val/acc")
    with pytest.raises(ConfigError) as info:
        build_run(cfg)
    assert str(info.value) == ("callbacks.model_checkpoint.monitor=val/acc is not a metric of this run; choose one "
                               "of val/loss, val/bpb, train/loss, train/bpb, or null (the latest checkpoint)")
    assert_nothing_written(tmp_path, cache_too=True)


@pytest.mark.parametrize("tokenizer,metrics", [("char", ["val/bpc", "val/unk_share"]),
                                               ("word", ["val/ppl", "val/unk_share"]), ("bpe", ["val/ppl"])])
def test_the_monitor_may_be_any_metric_the_run_logs(tokenizer, metrics, tmp_path, corpus):
    for monitor in ("val/loss", "val/bpb", "train/loss", *metrics):
        cfg = compose_config(*tiny_overrides(tmp_path, corpus), f"data.tokenizer={tokenizer}",
                             f"callbacks.model_checkpoint.monitor={monitor}")
        check_config(cfg)
    with pytest.raises(ConfigError, match=f"choose one of val/loss, {metrics[0]}, val/bpb, "):
        check_config(compose_config(*tiny_overrides(tmp_path, corpus), f"data.tokenizer={tokenizer}",
                                    "callbacks.model_checkpoint.monitor=val/bpx"))


def float_leaves() -> list[str]:
    """Every key of the full config whose schema type takes a number with a fraction."""
    cfg = compose_config("data=text", "logger=wandb", "data.train=a", "data.val=b", "data.test=c")
    return [key for key, hint in schema_fields(cfg) if "a number" in describe_type(hint)]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", float_leaves())
def test_a_number_that_is_not_finite_is_refused(key, value, tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), f"{key}={value}")
    with pytest.raises(ConfigError) as info:
        build_run(cfg)
    assert str(info.value).startswith(f"{key} must be ") and str(info.value).endswith(f", got {value}")
    assert_nothing_written(tmp_path, cache_too=True)


@pytest.mark.parametrize("override", ["model.n_head=100000", "data.batch_size=100000", "model.d_head=100000"])
def test_the_fit_check_names_the_setting_that_makes_the_run_big(override, tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(xl.training.build, "available_memory", lambda cuda: (2**30, "a test device of 1 GiB"))
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), override)
    with pytest.raises(ConfigError) as info:
        build_run(cfg)
    key, value = override.split("=")
    assert str(info.value).split("; lower ")[1].startswith(f"{key} ({value}; ")
    assert_nothing_written(tmp_path, cache_too=True)


def test_an_unknown_strategy_is_one_sentence_with_the_choices(tmp_path, corpus):
    from lightning.pytorch.strategies import StrategyRegistry

    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "trainer.strategy=ddpp")
    with pytest.raises(ConfigError) as info:
        build_run(cfg)
    names = sorted(StrategyRegistry.available_strategies())
    families = [name for name in names if not any(name.startswith(f"{other}_") for other in names)]
    assert "ddp" in families and "ddp_spawn" not in families
    assert str(info.value) == (f"trainer.strategy must be auto, a mapping with a _target_ or a Lightning strategy "
                               f"({', '.join(families)}, and variants), got 'ddpp'; did you mean ddp?")
    assert len(str(info.value)) < 200
    assert_nothing_written(tmp_path, cache_too=True)


@pytest.mark.parametrize("main,argv,sentence", [
    ("xl.generate", ["ckpt=RUN", "temprature=0.5"], "error: temprature is not a setting; did you mean temperature?"),
    ("xl.generate", ["ckpt=RUN", "top_p=1.5"], "error: top_p must be a number in (0, 1], got 1.5"),
    ("xl.generate", ["ckpt=RUN", "temperature=inf"], "error: temperature must be a finite number >= 0, got inf"),
    ("xl.evaluate", ["ckpt=RUN", "warmpu=1"], "error: warmpu is not a setting; did you mean warmup?"),
    ("train", ["optim.lrr=1"], "error: optim.lrr is not a setting; did you mean optim.lr?"),
])
def test_a_misspelt_key_gets_did_you_mean_on_every_entry_point(main, argv, sentence, tmp_path, monkeypatch, capsys):
    import xl.generate

    monkeypatch.chdir(tmp_path)
    command = {"xl.generate": xl.generate.main, "xl.evaluate": xl.evaluate.main, "train": train_main}[main]
    argv = [a.replace("RUN", str(tmp_path / "nowhere")) for a in argv]
    assert run_in_process(command, [f"{main}.py", "logger=none" if main != "xl.generate" else "seed=1", *argv],
                          monkeypatch, capsys) == sentence


@pytest.mark.parametrize("group", ["model", "memory", "data", "optim", "trainer", "callbacks", "logger"])
def test_a_schema_is_not_an_option_of_its_group(group):
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        listed = GlobalHydra.instance().config_loader().get_group_options(group)  # what --help lists
    assert listed == sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for option in ("schema", "files_schema", "wandb_schema"):
        with pytest.raises(ConfigError, match=f"^{group}={option} is not an option of the {group} group; choose "):
            compose_or_explain("config", [f"{group}={option}"])


def test_the_strategy_names_known_for_this_lightning_release_are_its_registry(monkeypatch):
    """A misspelt strategy is refused from the list known for the installed Lightning release (no Lightning import);
    the list must be that release's registry, and another release reads its registry."""
    from importlib.metadata import version

    from lightning.pytorch.strategies import StrategyRegistry

    from xl.config import rules

    release = ".".join(version("lightning").split(".")[:2])
    assert rules.strategy_names() == sorted(StrategyRegistry.available_strategies())
    if release in rules.STRATEGIES:
        assert sorted(rules.STRATEGIES[release]) == sorted(StrategyRegistry.available_strategies())
    monkeypatch.setattr(rules, "STRATEGIES", {})  # a release without a known list
    assert rules.strategy_names() == sorted(StrategyRegistry.available_strategies())
