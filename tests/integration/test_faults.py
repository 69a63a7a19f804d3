"""Non-finite steps are skipped and counted; too many in a row stop the run, keeping the last checkpoint."""

from __future__ import annotations

import math
from contextlib import nullcontext

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins.precision import MixedPrecision
from omegaconf import open_dict

from tests.conftest import compose_config, tiny_overrides
from xl.training.build import build_callbacks, build_run
from xl.training.loop.nonfinite import NonFiniteError


class PoisonGradients(L.Callback):
    """Makes one parameter's gradient NaN on the chosen steps."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.weights[trainer.global_step] = {k: v.clone() for k, v in module.model.state_dict().items()}
        if trainer.global_step in self.steps:
            param = module.model.layers[0].ff.net[0].weight
            handle = param.register_hook(lambda grad: grad * float("nan"))
            self.handle = handle

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if getattr(self, "handle", None) is not None:
            self.handle.remove()
            self.handle = None


def test_nonfinite_gradient_step_is_skipped_and_counted(tmp_path, corpus):
    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=6", "logger=csv"))
    poison = PoisonGradients({3})
    run.trainer.callbacks.append(poison)
    skipped = r"1 step\(s\) with a non-finite loss or gradient were skipped \(found by step 4\)"
    with pytest.warns(UserWarning, match=skipped):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    after_poisoned_step = poison.weights[4]
    for name, before in poison.weights[3].items():
        assert torch.equal(before, after_poisoned_step[name]), f"{name} changed in the skipped step"
    assert not torch.equal(poison.weights[4]["embed.weight"], poison.weights[5]["embed.weight"])
    assert run.module.nonfinite.total == 1 and run.module.nonfinite.in_row == 0
    assert all(torch.isfinite(p).all() for p in run.module.parameters())


def test_too_many_nonfinite_steps_stop_the_run_keeping_the_checkpoint(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=20", "max_nonfinite_steps=3",
                         "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.every_n_train_steps=2")
    run = build_run(cfg)
    poison = PoisonGradients(set(range(4, 20)))
    run.trainer.callbacks.append(poison)
    with pytest.raises(NonFiniteError, match=r"3 steps in a row \(found by step 7\).*lower optim.lr"):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    # Checkpoints written during the skipped steps hold the last good weights (those before step 4).
    assert last["global_step"] == 6
    for name, value in poison.weights[4].items():
        assert torch.equal(last["state_dict"][f"model.{name}"], value)


class PoisonMemory(L.Callback):
    """Puts an inf into the training memory before one step, so that step's loss is not finite."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.losses: dict[int, float] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.weights[trainer.global_step] = {k: v.clone() for k, v in module.model.state_dict().items()}
        if trainer.global_step == self.step:
            module.memory.mems["train"][0][0, -1, 0] = float("inf")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = float(outputs["loss"])
        self.memory_finite = all(torch.isfinite(m).all() for m in module.memory.mems["train"])


def test_nonfinite_loss_is_skipped_and_its_memory_cleaned(tmp_path, corpus):
    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=6"))
    poison = PoisonMemory(3)
    run.trainer.callbacks.append(poison)
    with pytest.warns(UserWarning, match=r"1 step\(s\) with a non-finite loss"):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    assert not math.isfinite(poison.losses[3])
    assert all(math.isfinite(poison.losses[s]) for s in (4, 5)), "the poisoned memory reached later steps"
    for name, before in poison.weights[3].items():
        assert torch.equal(before, poison.weights[4][name]), f"{name} changed in the skipped step"
    assert not torch.equal(poison.weights[4]["embed.weight"], poison.weights[5]["embed.weight"])
    assert poison.memory_finite and run.module.nonfinite.total == 1


def precision_run(tmp_path, corpus, precision: str, *extra: str):
    """A tiny run through the real precision plugin of ``precision``, with the default clipping (0.25).

    16-mixed is what ``precision=auto`` picks on GPUs without bf16; train.py refuses it on a CPU (Lightning would
    switch to bf16 there), so the test hands the Trainer the real 16-mixed plugin with a CPU GradScaler.
    """
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=6", *extra)
    with open_dict(cfg):
        cfg.trainer.precision = "32-true" if precision == "16-mixed" else precision
    run = build_run(cfg)
    if precision == "16-mixed":
        with open_dict(cfg):
            del cfg.trainer.precision
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        run.trainer = instantiate(cfg.trainer, plugins=[plugin], logger=False, callbacks=build_callbacks(cfg, False))
    assert run.trainer.gradient_clip_val == 0.25
    return run


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_every_automatic_precision_steps_with_clipping_and_skips_overflow(tmp_path, corpus, precision):
    """Real optimizer steps with clipping through each plugin ``precision=auto`` can pick; an overflowing gradient
    is skipped under each (by the fused AdamW's flag, or by the GradScaler, which then lowers its scale and does
    not count it as a fault)."""
    run = precision_run(tmp_path, corpus, precision)
    poison = PoisonGradients({3})
    run.trainer.callbacks.append(poison)
    warns = pytest.warns(UserWarning, match="non-finite") if precision != "16-mixed" else nullcontext()
    with warns:
        run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 6
    optimizer = run.trainer.optimizers[0]
    assert optimizer.defaults["fused"] == (precision != "16-mixed")
    for name, before in poison.weights[3].items():
        assert torch.equal(before, poison.weights[4][name]), f"{name} changed in the skipped step"
    for step in (1, 2, 4):
        assert not torch.equal(poison.weights[step]["embed.weight"], poison.weights[step + 1]["embed.weight"])
    scaler = getattr(run.trainer.precision_plugin, "scaler", None)
    if precision == "16-mixed":
        assert scaler.get_scale() == 2.0**15 and run.module.nonfinite.total == 0  # halved once, not a fault
    else:
        assert scaler is None and run.module.nonfinite.total == 1


def test_nonfinite_loss_under_a_grad_scaler_is_a_fault(tmp_path, corpus):
    """The GradScaler would skip it too, but a non-finite loss is no scale search: it is counted."""
    run = precision_run(tmp_path, corpus, "16-mixed")
    poison = PoisonMemory(3)
    run.trainer.callbacks.append(poison)
    with pytest.warns(UserWarning, match=r"1 step\(s\) with a non-finite loss"):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    for name, before in poison.weights[3].items():
        assert torch.equal(before, poison.weights[4][name]), f"{name} changed in the skipped step"
    assert run.module.nonfinite.total == 1


