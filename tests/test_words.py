"""Word-level training end to end: word tokenizer, adaptive input and softmax, perplexity, evaluate, generate."""

from __future__ import annotations

import math

import torch

from tests.conftest import compose_config, tiny_overrides
from xl.build import build_run
from xl.checkpoint import Checkpoint
from xl.generate import generate


def test_word_level_adaptive_run_trains_tests_and_generates(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "data.tokenizer=word", "model.cutoffs=[40,200]",
                         "model.div_val=2", "trainer.max_steps=12", "trainer.val_check_interval=6",
                         "trainer.limit_test_batches=1.0")
    run = build_run(cfg)
    vocab = run.datamodule.vocab_size
    assert vocab > 200 and run.datamodule.unit == "word"
    run.trainer.fit(run.module, datamodule=run.datamodule)
    losses = run.trainer.callback_metrics
    assert math.isfinite(float(losses["val/loss"])) and "val/ppl" in losses
    assert math.isclose(float(losses["val/ppl"]), math.exp(float(losses["val/loss"])), rel_tol=1e-5)
    ckpt = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    (test,) = run.trainer.test(run.module, datamodule=run.datamodule, ckpt_path=ckpt, verbose=False,
                               weights_only=True)
    assert math.isfinite(test["test/ppl"]) and test["test/ppl"] < vocab  # better than uniform after 12 steps
    model = Checkpoint.open(ckpt).load_model(vocab)
    assert model.config.cutoffs == (40, 200) and model.head.tables[0].weight is model.embed.tables[0].weight
    prompt = torch.tensor([run.datamodule.tokenizer.encode("def main ( self")])
    sampled = generate(model, prompt, 8, window=16, seg_len=16, temperature=1.0, seed=0)
    assert sampled.shape == (1, 8) and int(sampled.max()) < vocab
