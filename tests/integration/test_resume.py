"""Exact resume: stopping mid-epoch and resuming gives the very losses and weights of an unbroken run."""

from __future__ import annotations

import logging
import os
import re
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import OmegaConf

import xl.training.build
from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from xl import train
from xl.training.build import build_callbacks, build_run
from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError
from xl.training.loop.module import XLLitModule

STEPS, STOP_AT = 12, 7  # epochs of 5 segments: the stop falls in the middle of the second epoch


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()


def resume_cfg(tmp_path: Path, corpus, run: str, *extra: str):
    return compose_config(
        *tiny_overrides(tmp_path / run, corpus), "model.dropout=0.1", "trainer.limit_train_batches=5",
        "trainer.val_check_interval=3", f"trainer.max_steps={STEPS}", "callbacks.model_checkpoint.monitor=null",
        f"callbacks.model_checkpoint.every_n_train_steps={STOP_AT}", "trainer.deterministic=true", *extra,
    )


def fit(cfg) -> tuple:
    run = build_run(cfg)
    recorder = LossRecorder()
    run.trainer.callbacks.append(recorder)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
    return run, recorder.losses


def assert_resumed_as_unbroken(whole, whole_losses: dict, second, second_losses: dict, stop: int = STOP_AT) -> None:
    """A run resumed at ``stop`` trains the remaining steps with the unbroken run's losses and ends with its
    weights."""
    assert sorted(second_losses) == list(range(stop + 1, STEPS + 1))
    for step in second_losses:
        assert second_losses[step] == whole_losses[step], f"step {step} differs after resume"
    for (name, a), b in zip(whole.module.state_dict().items(), second.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_resume_mid_epoch_is_exact(tmp_path, corpus):
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole"))
    assert sorted(whole_losses) == list(range(1, STEPS + 1))

    first, first_losses = fit(resume_cfg(tmp_path, corpus, "first", f"trainer.max_steps={STOP_AT}"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == STOP_AT and saved["xl"]["train_memory"].shape == (1, 2, 4, 16, 32)

    # Resume by naming the run folder: its checkpoints/last.ckpt is found.
    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", f"ckpt_path={tmp_path / 'first' / 'run'}"))
    assert_resumed_as_unbroken(whole, whole_losses, second, second_losses)


def test_a_run_that_ends_between_checkpoints_keeps_its_final_weights(tmp_path, corpus):
    """The last step (8) is neither a validation step (every 3) nor a checkpoint step (every 7): last.ckpt still
    holds it, the run folder names it, and a resume from it goes on as the unbroken run."""
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole"))
    first, _ = fit(resume_cfg(tmp_path, corpus, "first", "trainer.max_steps=8"))
    folder = tmp_path / "first" / "run"
    steps = {p.name: torch.load(p, weights_only=True)["global_step"] for p in (folder / "checkpoints").glob("*.ckpt")}
    assert steps == {"step0000007.ckpt": 7, "last.ckpt": 8}
    assert Checkpoint.open(folder).global_step == 8
    assert first.trainer.checkpoint_callback.last_model_path == str(folder / "checkpoints" / "last.ckpt")
    saved = Checkpoint.open(folder).model_weights()
    assert saved.keys() == first.module.model.state_dict().keys()
    assert all(torch.equal(v, saved[k]) for k, v in first.module.model.state_dict().items())
    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", f"ckpt_path={folder}"))
    assert_resumed_as_unbroken(whole, whole_losses, second, second_losses, stop=8)


def test_the_final_step_is_not_saved_twice(tmp_path, corpus):
    """A run that ends on a checkpoint step writes it once (Lightning's save), not again at the end."""
    writes = []
    cfg = resume_cfg(tmp_path, corpus, "once", f"trainer.max_steps={STOP_AT}")
    run = build_run(cfg)
    save = run.trainer.save_checkpoint
    run.trainer.save_checkpoint = lambda path, *args, **kwargs: (writes.append(Path(path).name),
                                                                  save(path, *args, **kwargs))
    run.trainer.fit(run.module, datamodule=run.datamodule, weights_only=True)
    assert sorted(writes) == ["last.ckpt", "step0000007.ckpt"]


def test_no_last_checkpoint_when_it_is_switched_off(tmp_path, corpus, caplog):
    cfg = resume_cfg(tmp_path, corpus, "off", "trainer.max_steps=8", "callbacks.model_checkpoint.save_last=false")
    caplog.set_level(logging.INFO, logger="xl.training.checkpoints.model_checkpoint")
    fit(cfg)
    assert sorted(p.name for p in (tmp_path / "off" / "run" / "checkpoints").glob("*.ckpt")) == ["step0000007.ckpt"]
    assert "the final step (8) is not saved (callbacks.model_checkpoint.save_last=false)" in caplog.text


def test_resume_with_another_memory_length_is_refused(tmp_path, corpus):
    fit(resume_cfg(tmp_path, corpus, "first", "trainer.max_steps=3",
                   "callbacks.model_checkpoint.every_n_train_steps=3"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    cfg = resume_cfg(tmp_path, corpus, "second", f"ckpt_path={ckpt}", "memory.mem_len=8")
    with pytest.raises(CheckpointError, match=r"mem_len=16 \(this run: 8\)"):
        build_run(cfg)
    cfg = resume_cfg(tmp_path, corpus, "third", f"ckpt_path={ckpt}", "model.d_model=48")
    with pytest.raises(CheckpointError, match=r"d_model=32 \(this run: 48\)"):
        build_run(cfg)


@pytest.mark.parametrize("edit", ["reshaped", "dropped", "added"])
def test_weights_that_do_not_fit_the_model_are_one_sentence(tmp_path, corpus, edit):
    """A checkpoint whose config fits but whose weights do not (edited, or from another version of a module) is
    refused by resume, evaluation and loading, before any work, naming the tensor."""
    from tests.integration.test_evaluate import compose_eval
    from xl.evaluation import evaluate
    from xl.training.checkpoints.checkpoint import Checkpoint

    fit(resume_cfg(tmp_path, corpus, "first", "trainer.max_steps=3",
                   "callbacks.model_checkpoint.every_n_train_steps=3"))
    state = torch.load(tmp_path / "first" / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    weights, name = state["state_dict"], "model.layers.0.attn.r_w_bias"
    if edit == "reshaped":
        weights[name] = weights[name].flatten()
    elif edit == "dropped":
        del weights[name]
    else:
        weights["model.extra"] = torch.zeros(2)
    path = tmp_path / "edited.ckpt"
    torch.save(state, path)
    said = {"reshaped": r"layers.0.attn.r_w_bias has shape \[32\] \(this model: \[2, 16\]\)",
            "dropped": "layers.0.attn.r_w_bias is missing", "added": "extra is not a weight of this model"}[edit]
    with pytest.raises(CheckpointError, match=f"^ckpt_path=.* holds weights that do not fit this model: {said}; "):
        build_run(resume_cfg(tmp_path, corpus, "second", f"ckpt_path={path}"))
    with pytest.raises(CheckpointError, match=f"^ckpt=.* {said}"):
        Checkpoint.open(path, setting="ckpt").load_model()
    data = [f"data.{s}={corpus[s]}" for s in ("train", "val", "test")]
    with pytest.raises(CheckpointError, match=said):
        evaluate(compose_eval(f"ckpt={path}", "data=text", *data, f"data.cache_dir={tmp_path / 'cache'}",
                              f"paths.output_dir={tmp_path / 'eval'}"))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing"])
def test_damaged_checkpoint_is_one_clear_error(tmp_path, corpus, damage):
    path = tmp_path / "bad.ckpt"
    if damage == "truncated":
        fit(resume_cfg(tmp_path, corpus, "first", "trainer.max_steps=3",
                       "callbacks.model_checkpoint.every_n_train_steps=3"))
        good = (tmp_path / "first" / "run" / "checkpoints" / "last.ckpt").read_bytes()
        path.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01not a checkpoint" * 100)
    cfg = resume_cfg(tmp_path, corpus, "second", f"ckpt_path={path}")
    with pytest.raises(CheckpointError, match="ckpt_path=") as info:
        build_run(cfg)
    assert "\n" not in str(info.value)


class SendSignal(L.Callback):
    """Delivers a real signal to this process in the middle of a training step."""

    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step = signum, at_step

    def on_before_backward(self, trainer, module, loss):
        if trainer.global_step == self.at_step - 1:
            os.kill(os.getpid(), self.signum)


class ValidationRecorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_start(self, trainer, module):
        if not trainer.sanity_checking:
            self.steps.append(trainer.global_step)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_checkpoints_and_resume_is_exact(tmp_path, corpus, signum):
    """A signal ends the fit at the step boundary with one last.ckpt and nothing else: no validation, no step
    checkpoint, no last-v1.ckpt; the resume from it is exact."""
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole"))
    run = build_run(resume_cfg(tmp_path, corpus, "first", "callbacks.model_checkpoint.every_n_train_steps=null"))
    validations = ValidationRecorder()
    run.trainer.callbacks += [SendSignal(signum, at_step=STOP_AT), validations]
    before = signal.getsignal(signum)
    with pytest.raises(SIGTERMException, match=f"^stopped by {signal.Signals(signum).name} during the training after "
                                               f"step {STOP_AT}; checkpoint "):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == STOP_AT, "the run stops at the end of the step the signal arrived in"
    assert validations.steps == [3, 6], "no validation after the signal"
    folder = tmp_path / "first" / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step0000006.ckpt"]
    ckpt = folder / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == STOP_AT
    assert signal.getsignal(signum) == before  # the handler of before the fit is back

    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", f"ckpt_path={ckpt}"))
    assert sorted(second_losses) == list(range(STOP_AT + 1, STEPS + 1))
    assert all(second_losses[s] == whole_losses[s] for s in second_losses)


def test_signal_in_a_step_that_a_validation_follows_lets_the_validation_run(tmp_path, corpus):
    """A signal during step 6, where a validation falls due, stops the fit after that validation (it is not lost),
    with last.ckpt at step 6 holding what the validation recorded; the resume is exact and does not validate step 6
    again."""
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole"))
    run = build_run(resume_cfg(tmp_path, corpus, "first", "callbacks.model_checkpoint.every_n_train_steps=null"))
    validations = ValidationRecorder()
    run.trainer.callbacks += [SendSignal(signal.SIGTERM, at_step=6), validations]
    with pytest.raises(SIGTERMException, match="^stopped by SIGTERM after step 6 and its validation; checkpoint "):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 6 and validations.steps == [3, 6]
    folder = tmp_path / "first" / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step0000006.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 6

    second = build_run(resume_cfg(tmp_path, corpus, "second", f"ckpt_path={folder / 'last.ckpt'}"))
    losses, resumed_validations = LossRecorder(), ValidationRecorder()
    second.trainer.callbacks += [losses, resumed_validations]
    second.trainer.fit(second.module, datamodule=second.datamodule, ckpt_path=second.ckpt_path, weights_only=True)
    assert resumed_validations.steps == [9, 12], "the validation of step 6 is not run twice"
    assert_resumed_as_unbroken(whole, whole_losses, second, losses.losses, stop=6)


def test_resuming_a_checkpoint_onto_another_corpus_is_refused(tmp_path, corpus):
    fit(resume_cfg(tmp_path, corpus, "first", "trainer.max_steps=3",
                   "callbacks.model_checkpoint.every_n_train_steps=3"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    cfg = resume_cfg(tmp_path, corpus, "second", f"ckpt_path={ckpt}", f"data.train={corpus['val']}")
    with pytest.raises(CheckpointError, match=rf"^ckpt_path=.* was trained on data.train \({corpus['train']}\) but "
                                              rf"this run reads data.train \({corpus['val']}\); resume with the run's"):
        train.fit_and_test(cfg)
    assert not (tmp_path / "second" / "cache").exists(), "refused before the corpus is read"


def test_resume_of_a_run_folder_continues_it_in_place(tmp_path, corpus, monkeypatch):
    """`python train.py ckpt_path=RUN` takes the run's own settings, writes into RUN (no new folder) and continues
    its W&B run; max_steps counts all steps; another corpus is refused in one sentence."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if o != "logger=none"]
    run_hydra_main(train.main, ["train.py", *overrides, "logger=wandb", "trainer.max_steps=4", f"hydra.run.dir={run}"],
                   monkeypatch)
    run_hydra_main(train.main, ["train.py", f"ckpt_path={run}", "trainer.max_steps=8"], monkeypatch)
    assert not (tmp_path / "outputs").exists()
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
    run_id = (run / "wandb_id").read_text().strip()
    offline = sorted((run / "wandb").glob("offline-run-*"))
    # Both W&B sessions write the same run id; W&B adds -1 to the second folder's name when both start in one second.
    assert len(offline) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", p.name)
                                     for p in offline)
    assert (run / "train.log").read_text().count("results") == 2
    saved = OmegaConf.load(run / ".hydra" / "overrides.yaml")
    assert f"data.train={corpus['train']}" in saved and saved.count("trainer.max_steps=8") == 1
    with pytest.raises(SystemExit, match=r"^error: ckpt_path=.* is at step 8 and trainer.max_steps=8 counts all"):
        run_hydra_main(train.main, ["train.py", f"ckpt_path={run}"], monkeypatch)
    with pytest.raises(SystemExit, match=rf"^error: ckpt_path=.* continues a run with its own data, but "
                                         rf"data.train={corpus['val']} changes it; .* remove data.train from"):
        run_hydra_main(train.main, ["train.py", f"ckpt_path={run}", f"data.train={corpus['val']}"], monkeypatch)


class OrderRecorder(L.Callback):
    """What each step read and where the trainer's counters stood: (epoch, batch_idx, global_step, first tokens)."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.steps.append((trainer.current_epoch, batch_idx, trainer.global_step, batch[0][:, :4].tolist()))


@pytest.mark.parametrize("limit", [4, None])  # limit_train_batches, and full epochs
def test_resume_from_a_checkpoint_at_an_epoch_end_starts_the_next_epoch(tmp_path, corpus, limit):
    wide = ("data.batch_size=96", "data.tgt_len=64")  # full epochs of a few segments
    probe = build_run(resume_cfg(tmp_path, corpus, "probe", *wide))
    epoch = limit or len(probe.datamodule.train_dataloader())
    assert 2 <= epoch <= 8
    common = (*wide, f"trainer.limit_train_batches={limit or 1.0}", f"trainer.max_steps={epoch + 3}",
              f"callbacks.model_checkpoint.every_n_train_steps={epoch}")

    def recorded(run_name: str, *extra: str) -> tuple[list, L.Trainer]:
        run = build_run(resume_cfg(tmp_path, corpus, run_name, *common, *extra))
        recorder = OrderRecorder()
        run.trainer.callbacks.append(recorder)
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
        return recorder.steps, run.trainer

    whole, whole_trainer = recorded("whole")
    recorded("first", f"trainer.max_steps={epoch}")
    resumed, resumed_trainer = recorded("second", f"ckpt_path={tmp_path / 'first' / 'run'}")
    assert resumed == whole[epoch:]
    assert resumed[0][:2] == (1, 0)  # the second epoch, from its first segment
    assert resumed_trainer.current_epoch == whole_trainer.current_epoch


class MovingStrategy(SingleDeviceStrategy):
    """Moves the module where a GPU strategy would, after the checkpoint hooks ran: float64 stands in for the GPU."""

    def model_to_device(self) -> None:
        super().model_to_device()
        self.model.double()


class RecordFirstMemory(L.Callback):
    def __init__(self) -> None:
        self.first_memory = None

    def on_train_start(self, trainer, module):
        module.model.register_forward_pre_hook(self.record)

    def record(self, model, args):
        if self.first_memory is None:
            self.first_memory = args[1]


def test_restored_memory_follows_the_module_wherever_it_is_moved(tmp_path, corpus):
    fit(resume_cfg(tmp_path, corpus, "first", f"trainer.max_steps={STOP_AT}"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)["xl"]["train_memory"][0]
    cfg = resume_cfg(tmp_path, corpus, "second", f"ckpt_path={ckpt}", f"trainer.max_steps={STOP_AT + 2}")
    run = build_run(cfg)
    recorder = RecordFirstMemory()
    run.trainer = instantiate(cfg.trainer, strategy=MovingStrategy(torch.device("cpu")), logger=False,
                              callbacks=[*build_callbacks(cfg, False), recorder])
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
    assert run.trainer.global_step == STOP_AT + 2 and run.module.model.dtype == torch.float64
    assert [m.dtype for m in recorder.first_memory] == [torch.float64] * 2  # moved before the step reads it
    for m, s in zip(recorder.first_memory, saved, strict=True):
        assert torch.equal(m, s.double())
    assert all(m.dtype == torch.float64 for m in run.module.memory.mems["train"])


def test_checkpoints_are_read_outside_fit_without_the_training_state(tmp_path, corpus):
    """Testing or loading a checkpoint needs only its weights: another device count is fine, the RNGs stay."""
    fit(resume_cfg(tmp_path, corpus, "first", f"trainer.max_steps={STOP_AT}"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    # As if two processes had trained it.
    state["xl"]["train_memory"] = state["xl"]["train_memory"].repeat(2, 1, 1, 1, 1)
    state["xl"]["rng"] = state["xl"]["rng"] * 2
    two = tmp_path / "two.ckpt"
    torch.save(state, two)
    run = build_run(resume_cfg(tmp_path, corpus, "test"))
    rng_after = []
    for ckpt_path in (two, None):  # the same test with and without reading the checkpoint: the same RNG after
        torch.manual_seed(123)
        (metrics,) = run.trainer.test(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path, verbose=False,
                                      weights_only=True)
        rng_after.append(torch.get_rng_state())
    assert torch.equal(*rng_after)
    assert run.module.memory.mems["train"] is None and metrics["test/loss"] > 0
    torch.manual_seed(123)
    XLLitModule(**state["hyper_parameters"])  # building the module draws its initial weights
    built = torch.get_rng_state()
    torch.manual_seed(123)
    loaded = XLLitModule.load_from_checkpoint(two, weights_only=True)
    assert torch.equal(torch.get_rng_state(), built)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state["state_dict"][name]), name
    # A resumed fit with another number of processes is still refused, in one sentence.
    resumed = build_run(resume_cfg(tmp_path, corpus, "resume"))
    with pytest.raises(CheckpointError, match="come from 2 processes, this run has 1; resume with the same"):
        resumed.trainer.fit(resumed.module, datamodule=resumed.datamodule, ckpt_path=two, weights_only=True)


def test_a_requeued_run_continues_from_its_folder(tmp_path, corpus, monkeypatch):
    """The same command into the same folder, requeued by SLURM, continues from the folder's last.ckpt, exactly."""
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole"))
    train.fit_and_test(resume_cfg(tmp_path, corpus, "again", f"trainer.max_steps={STOP_AT}", "test=false"))
    recorder, build = LossRecorder(), xl.training.build.build_run

    def with_recorder(cfg):
        built = build(cfg)
        built.trainer.callbacks.append(recorder)
        return built

    monkeypatch.setattr(xl.training.build, "build_run", with_recorder)  # train imports it when it trains
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    again = resume_cfg(tmp_path, corpus, "again", "test=false")
    train.fit_and_test(again)
    assert again.ckpt_path == str(tmp_path / "again" / "run")  # the folder: its newest complete checkpoint
    assert sorted(recorder.losses) == list(range(STOP_AT + 1, STEPS + 1))
    assert all(recorder.losses[s] == whole_losses[s] for s in recorder.losses)


def test_resuming_after_the_corpus_files_changed_says_so(tmp_path, corpus):
    text = tmp_path / "train.txt"
    text.write_bytes(corpus["train"].read_bytes())
    fit(resume_cfg(tmp_path, corpus, "first", f"data.train={text}", "trainer.max_steps=3",
                   "callbacks.model_checkpoint.every_n_train_steps=3"))
    text.write_bytes(corpus["train"].read_bytes() + b"# one more line\n")
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(CheckpointError, match=rf"^ckpt_path=.* was trained on data.train \({text}\), whose files "
                                              r"have changed since \(size or modification time\)"):
        train.fit_and_test(resume_cfg(tmp_path, corpus, "second", f"data.train={text}", f"ckpt_path={ckpt}"))
