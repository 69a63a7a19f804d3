"""Memory variants defined outside the package (tests/helpers/plugin_memory.py, tests/helpers/dilated_memory.py) train,
resume, evaluate, decode and are sized through the normal entry points, with no change to ``xl/``."""

from __future__ import annotations

import json
import math

import torch

from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from tests.helpers.dilated_memory import DilatedMemory
from tests.helpers.paths import ROOT
from tests.helpers.plugin_memory import MaxPoolMemory
from tests.integration.test_evaluate import compose_eval
from xl import train
from xl.config.machine import run_estimate
from xl.evaluation import evaluate
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import Checkpoint

TARGET = "tests.helpers.plugin_memory.MaxPoolConfig"


def decodes_as_forward(model, length: int) -> list[torch.Tensor]:
    """Check that the model's decoder gives each of ``length`` tokens the logits of the forward pass of that one token
    over the memory (the decoder's contract: xl.model.decoding); return the forward's memory after them."""
    tokens = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mems, expected = None, []
        for t in range(length):
            out = model(tokens[:, t:t + 1], mems)
            mems, _ = out.mems, expected.append(out.logits)
        decoder = model.decoder(2)
        fed = torch.stack([decoder.feed(tokens[:, t]) for t in range(length)], 1)
    torch.testing.assert_close(fed, torch.cat(expected, 1), rtol=1e-9, atol=1e-10)
    return mems


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
    decodes_as_forward(model, 40)
    # Resumed through the same entry point, with its memory state.
    resumed = build_run(compose_config(*overrides(tmp_path, corpus, "second", "trainer.max_steps=5", "test=false",
                                                  f"ckpt_path={folder}")))
    resumed.trainer.fit(resumed.module, datamodule=resumed.datamodule, ckpt_path=str(checkpoint.path))
    assert resumed.trainer.global_step == 5
    # Sized by the run's footprint check: slots and states of each layer.
    footprint, _ = run_estimate(cfg)
    assert footprint.train_memory == (4 + 8) * 32 * 2 * 4 * 4  # (slots + states) × d_model × layers × batch × float32


def test_a_memory_written_from_scratch_on_hydras_search_path_runs_through_every_entry_point(tmp_path, corpus,
                                                                                            monkeypatch):
    """The dilated memory (tests/helpers/dilated_memory.py) subclasses no variant of the package and its config file
    is on Hydra's search path, not in conf/: `python train.py hydra.searchpath=[...] memory=dilated` trains it with
    validations, xl.evaluate scores the run, its decoder reads as its forward pass does one token at a time, the run
    resumes exactly, and the footprint check sizes it."""
    plugin = [f"hydra.searchpath=[file://{ROOT / 'tests' / 'helpers' / 'conf'}]", "memory=dilated", "memory.far_len=4",
              "test=false", "trainer.val_check_interval=4", "callbacks.model_checkpoint.monitor=null"]

    def train_py(folder, *extra):
        overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith("paths.output_dir")]
        run_hydra_main(train.main, ["train.py", *overrides, *plugin, f"hydra.run.dir={folder}", *extra], monkeypatch)

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train_py(whole, "trainer.max_steps=8")
    train_py(cut, "trainer.max_steps=4")
    # The resume composes the run's config again: its search path comes back with its other settings.
    run_hydra_main(train.main, ["train.py", f"ckpt_path={cut}", "trainer.max_steps=8"], monkeypatch)
    unbroken, resumed = (torch.load(f / "checkpoints" / "last.ckpt", weights_only=True) for f in (whole, cut))
    assert resumed["global_step"] == unbroken["global_step"] == 8
    for name, weight in unbroken["state_dict"].items():
        assert torch.equal(weight, resumed["state_dict"][name]), f"{name} differs after the resume"
    results = json.loads((whole / "results.json").read_text())
    assert results["memory"] == "dilated(far_len=4, stride=2)" and math.isfinite(results["val/bpb"])

    # Evaluated through xl.evaluate: the checkpoint names its variant, and the run folder its data.
    scores = evaluate(compose_eval(f"ckpt={whole}", "logger=none", f"paths.output_dir={tmp_path / 'eval'}",
                                   "+trainer.enable_progress_bar=false", "splits=[test]"))["test"]
    assert math.isfinite(scores["test/bpb"]) and scores["test/tokens"] > 0

    # Decoded: each fed token gets the logits of the forward pass of that one token over the memory.
    model = Checkpoint.open(whole, "ckpt_path").load_model().double()
    assert isinstance(model.memory, DilatedMemory) and model.config.memory.far_len == 4
    mems = decodes_as_forward(model, 60)
    assert mems[0].size(1) == 4, "the memory's dilated states are full"

    # Sized by the run's footprint check: the dilated states and the window of each layer.
    footprint, _ = run_estimate(compose_config(*tiny_overrides(tmp_path, corpus), *plugin))
    assert footprint.train_memory == (4 + 16) * 32 * 2 * 4 * 4  # (kept + window) × d_model × layers × batch × fp32
