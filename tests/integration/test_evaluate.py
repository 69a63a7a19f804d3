"""python -m xl.evaluate: train.py's own numbers, warm-up, the vanilla baseline, the context's precedence, errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import xl.evaluate
import xl.evaluation
from tests.conftest import CONF_DIR, compose_config, run_hydra_main, tiny_overrides
from xl.config.rules import ConfigError
from xl.evaluation import eval_context, evaluate, vanilla_nll
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> dict:
    """A tiny run trained for 20 steps: its folder, and train.py's test metrics on the whole test split."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = compose_config(*tiny_overrides(tmp, corpus), "trainer.limit_test_batches=1.0")
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    last = str(tmp / "run" / "checkpoints" / "last.ckpt")
    (metrics,) = run.trainer.test(run.module, datamodule=run.datamodule, ckpt_path=last, verbose=False,
                                  weights_only=True)
    return {"tmp": tmp, "run": tmp / "run", "test": metrics}


def eval_overrides(trained: dict, corpus, *extra: str) -> list[str]:
    return [
        f"ckpt={trained['run']}", "data=text", f"data.train={corpus['train']}", f"data.val={corpus['val']}",
        f"data.test={corpus['test']}", f"data.cache_dir={trained['tmp'] / 'cache'}", "data.batch_size=4",
        "data.tgt_len=16", f"paths.output_dir={trained['tmp'] / 'eval'}", "+trainer.enable_progress_bar=false",
        "+trainer.enable_model_summary=false", "logger=none", *extra,
    ]


def compose_eval(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


def test_default_evaluation_reproduces_train_py_test_metrics(trained, corpus):
    results = evaluate(compose_eval(*eval_overrides(trained, corpus, "splits=[test]")))["test"]
    assert results["test/loss"] == pytest.approx(trained["test"]["test/loss"], abs=1e-6)
    assert results["test/bpb"] == pytest.approx(trained["test"]["test/bpb"], abs=1e-6)
    assert results["test/tokens"] > 1000 and results["test/tok_s"] > 0


def checkpoint_model(trained: dict) -> TransformerXL:
    saved = torch.load(trained["run"] / "checkpoints" / "last.ckpt", weights_only=True)
    model = TransformerXL(XLConfig.from_dict(saved["xl"]["model_config"])).eval()
    model.load_state_dict({k.removeprefix("model."): v for k, v in saved["state_dict"].items()})
    return model


def test_warmup_fills_the_memory_without_scoring(trained, corpus):
    segments, warmup, mem_len = 6, 2, 24
    cfg = compose_eval(*eval_overrides(trained, corpus, "splits=[val]", f"warmup={warmup}",
                                       f"memory.eval_mem_len={mem_len}", f"trainer.limit_val_batches={segments}"))
    results = evaluate(cfg)["val"]

    text = corpus["val"].read_bytes()
    rows = torch.tensor(list(text[: len(text) // 4 * 4])).view(4, -1)
    model, mems, losses = checkpoint_model(trained), None, []
    with torch.no_grad():
        for t in range(segments):
            x, y = rows[:, 16 * t:16 * t + 16], rows[:, 16 * t + 1:16 * t + 17]
            out = model(x, mems, targets=y, mem_len=mem_len)
            mems = out.mems
            if t >= warmup:
                losses.append(out.loss)
    assert results["val/tokens"] == (segments - warmup) * 4 * 16
    assert results["val/loss"] == pytest.approx(torch.stack(losses).mean().item(), abs=1e-5)


def test_vanilla_window_over_the_whole_prefix_equals_one_long_segment(trained, corpus):
    """With a window that holds every earlier token, recomputation sees what one causal segment sees."""
    vanilla = evaluate(compose_eval(*eval_overrides(
        trained, corpus, "splits=[test]", "vanilla=true", "attn_len=48", "data.eval_tgt_len=8",
        "trainer.limit_test_batches=6")))["test"]
    whole = evaluate(compose_eval(*eval_overrides(
        trained, corpus, "splits=[test]", "memory.eval_mem_len=0", "data.eval_tgt_len=48",
        "trainer.limit_test_batches=1")))["test"]
    assert vanilla["test/tokens"] == whole["test/tokens"] == 4 * 48
    assert vanilla["test/loss"] == pytest.approx(whole["test/loss"], abs=1e-5)


def test_vanilla_window_slides():
    """Each prediction sees exactly the last attn_len inputs: the loss of a token depends on nothing older."""
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(vocab_size=11, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32,
                                   dropout=0.0, mem_len=0)).eval()
    tokens = torch.randint(0, 11, (2, 13))
    context, x, y = tokens[:, :6], tokens[:, 6:12], tokens[:, 7:13]
    with torch.no_grad():
        total = vanilla_nll(model, context, x, y, attn_len=4, clamp_len=-1)
        expected = sum(
            torch.nn.functional.cross_entropy(model(tokens[:, 6 + i - 3:6 + i + 1], mem_len=0).logits[:, -1], y[:, i],
                                              reduction="sum") for i in range(6))
        older_changed = tokens.clone()
        older_changed[:, :2] = (older_changed[:, :2] + 1) % 11
        same = vanilla_nll(model, older_changed[:, :6], x, y, attn_len=4, clamp_len=-1)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    assert same.item() == pytest.approx(total.item(), rel=1e-6)


def test_context_comes_from_eval_settings_then_memory_then_checkpoint():
    checkpoint = Checkpoint(Path("x.ckpt"), {
        "xl": {"model_config": {"mem_len": 16, "clamp_len": -1, "same_length": False}},
        "hyper_parameters": {"eval_mem_len": 64, "eval_same_length": None, "eval_clamp_len": None}})
    cfg = compose_eval("ckpt=x")
    assert eval_context(cfg, checkpoint).attention() == {"mem_len": 64, "clamp_len": -1, "same_length": False}
    cfg = compose_eval("ckpt=x", "memory.mem_len=32", "memory.clamp_len=8", "memory.eval_same_length=true")
    assert eval_context(cfg, checkpoint).attention() == {"mem_len": 32, "clamp_len": 8, "same_length": True}
    cfg = compose_eval("ckpt=x", "memory.mem_len=32", "memory.eval_mem_len=128")
    assert eval_context(cfg, checkpoint).mem_len == 128
    # doc_boundaries: memory.doc_boundaries, else the checkpoint's, else ignore (a checkpoint without the setting)
    assert eval_context(compose_eval("ckpt=x"), checkpoint).doc_boundaries == "ignore"
    checkpoint.hyper_parameters["doc_boundaries"] = "reset"
    assert eval_context(compose_eval("ckpt=x"), checkpoint).doc_boundaries == "reset"
    assert eval_context(compose_eval("ckpt=x", "memory.doc_boundaries=ignore"), checkpoint).doc_boundaries == "ignore"


def test_errors_name_the_setting(trained, corpus, tmp_path):
    with pytest.raises(CheckpointError, match=r"^ckpt=.*nowhere does not exist"):
        evaluate(compose_eval(*eval_overrides(trained, corpus, f"ckpt={tmp_path / 'nowhere'}")))
    with pytest.raises(CheckpointError, match="vocabulary of 256 but this data gives"):
        evaluate(compose_eval(*eval_overrides(trained, corpus, "data.tokenizer=char",
                                              f"data.cache_dir={tmp_path / 'cache'}")))
    with pytest.raises(ConfigError, match="warmup=99 leaves no val segment"):
        evaluate(compose_eval(*eval_overrides(trained, corpus, "warmup=99", "trainer.limit_val_batches=4")))
    with pytest.raises(ConfigError, match="same_length=True needs mem_len > 0"):
        evaluate(compose_eval(*eval_overrides(trained, corpus, "memory.eval_mem_len=0",
                                              "memory.eval_same_length=true")))


def test_command_line_prints_the_table(trained, corpus, tmp_path, monkeypatch):
    run_dir = tmp_path / "cli"
    overrides = eval_overrides(trained, corpus, "memory.eval_mem_len=32", "warmup=1", "trainer.limit_val_batches=5",
                               "trainer.limit_test_batches=5", f"hydra.run.dir={run_dir}")
    run_hydra_main(xl.evaluate.main, ["xl/evaluate.py", *overrides], monkeypatch)
    out = (run_dir / "evaluate.log").read_text()
    assert "mem_len=32" in out and "warmup=1 segments" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith(("val ", "test "))]
    assert [row[0] for row in lines] == ["val", "test"]
    assert all(row[3] == f"{4 * 16 * 4:,}" for row in lines)  # 5 segments, 1 of them warm-up


def test_results_go_to_json_and_to_a_new_wandb_run_when_the_run_has_none(trained, corpus, tmp_path):
    """A checkpoint whose folder records no W&B run: the evaluation gets a W&B run of its own (offline)."""
    out = tmp_path / "eval"
    results = evaluate(compose_eval(*eval_overrides(trained, corpus, "splits=[test]", "trainer.limit_test_batches=2",
                                                    "logger=wandb", f"paths.output_dir={out}")))
    saved = json.loads((out / "results.json").read_text())
    assert saved["test/loss"] == results["test"]["test/loss"] and saved["run_data"] is False
    assert saved["step"] == 20 and saved["ckpt"] == str((trained["run"] / "checkpoints" / "last.ckpt").resolve())
    (offline,) = (out / "wandb").glob("offline-run-*")
    assert list(offline.glob("*.wandb")) and not (trained["run"] / "wandb_id").exists()


def test_other_data_outside_a_run_folder_keeps_the_checkpoints_segments(trained, corpus, tmp_path, monkeypatch):
    """A checkpoint without its run folder still records its training segment length and batch."""
    overrides = [o for o in eval_overrides(trained, corpus)
                 if not o.startswith(("data.batch_size=", "data.tgt_len=", "paths.output_dir="))]
    run_hydra_main(xl.evaluate.main, ["xl/evaluate.py", *overrides, "splits=[val]", "trainer.limit_val_batches=2",
                                      f"hydra.run.dir={tmp_path / 'ev'}"], monkeypatch)
    saved = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert (saved["tgt_len"], saved["batch_size"]) == (16, 4)
    assert "tgt_len=16 clamp_len=-1 batch=4 (the checkpoint's training segments)" in (
        tmp_path / "ev" / "evaluate.log").read_text()


def test_the_first_split_is_timed_as_the_second(trained, corpus, tmp_path, monkeypatch):
    """The first segment an evaluation runs pays for warming up (allocations, kernels: here a second more); it is
    scored but not timed, so the tokens/s of the first split are those of the second."""
    real = xl.evaluation.Evaluator.segment_loss
    first = []

    def slow_first(self, *args, **kwargs):
        if not first:
            first.append(True)
            time.sleep(1.0)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(xl.evaluation.Evaluator, "segment_loss", slow_first)
    results = evaluate(compose_eval(*eval_overrides(trained, corpus, "trainer.limit_val_batches=8",
                                                    "trainer.limit_test_batches=8")))
    val, test = results["val"], results["test"]
    assert val["val/tokens"] == test["test/tokens"] == 8 * 4 * 16  # every segment is scored
    assert val["val/tok_s"] > 0.3 * test["test/tok_s"], (val["val/tok_s"], test["test/tok_s"])
