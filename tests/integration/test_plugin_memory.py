"""A memory variant defined outside the package (tests/helpers/plugin_memory.py) trains, resumes, evaluates,
decodes and is sized through the normal entry points, with no change to ``xl/``."""

from __future__ import annotations

import math

import torch

from tests.conftest import compose_config, tiny_overrides
from tests.helpers.plugin_memory import MaxPoolMemory
from xl.training.build import build_run
from xl.training.checkpoint import Checkpoint
from xl.training.footprint import run_estimate

TARGET = "tests.helpers.plugin_memory.MaxPoolConfig"


def overrides(tmp_path, corpus, folder, *extra):
    return [*tiny_overrides(tmp_path / folder, corpus), "memory=compressive", f"memory._target_={TARGET}",
            "memory.mem_len=8", "memory.cmem_len=4", "memory.cmem_rate=2", *extra]


def test_a_memory_from_outside_the_package_trains_resumes_decodes_and_is_sized(tmp_path, corpus):
    cfg = compose_config(*overrides(tmp_path, corpus, "first", "trainer.max_steps=3", "test=false",
                                    "trainer.val_check_interval=3", "callbacks.model_checkpoint.every_n_train_steps=3"))
    run = build_run(cfg)
    assert isinstance(run.module.model.memory, MaxPoolMemory) and run.module.model.memory.settings.name == "maxpool"
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert math.isfinite(float(run.trainer.callback_metrics["train/loss"]))
    folder = tmp_path / "first" / "run"
    checkpoint = Checkpoint.open(folder, "ckpt_path")
    assert checkpoint.model_config["memory"]["_target_"] == TARGET  # the checkpoint names the variant
    # The checkpoint is read back with its variant, and its decoder gives each token the logits of the forward pass
    # of that one token over the memory (the decoder's contract: xl.model.decoding).
    model = checkpoint.load_model().double()
    assert isinstance(model.memory, MaxPoolMemory)
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mems, expected = None, []
        for start in range(40):
            out = model(tokens[:, start:start + 1], mems)
            mems, _ = out.mems, expected.append(out.logits)
        expected = torch.cat(expected, 1)
        decoder = model.decoder(2)
        fed = torch.stack([decoder.feed(tokens[:, t]) for t in range(40)], 1)
    torch.testing.assert_close(fed, expected, rtol=1e-9, atol=1e-10)
    # Resumed through the same entry point, with its memory state.
    resumed = build_run(compose_config(*overrides(tmp_path, corpus, "second", "trainer.max_steps=5", "test=false",
                                                  f"ckpt_path={folder}")))
    resumed.trainer.fit(resumed.module, datamodule=resumed.datamodule, ckpt_path=str(checkpoint.path))
    assert resumed.trainer.global_step == 5
    # Sized by the run's footprint check: slots and states of each layer.
    footprint, _ = run_estimate(cfg)
    assert footprint.train_memory == (4 + 8) * 32 * 2 * 4 * 4  # (slots + states) × d_model × layers × batch × float32
