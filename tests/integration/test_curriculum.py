"""curriculum=[...] through the real Trainer: stages that end by their budget and by their threshold, one vocabulary
for every stage, a resume in the middle of a stage (and at a stage's end) that goes on as the unbroken run, the
stage in results.json and the logs, and a bad stage refused in one sentence."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import compose_config
from tests.helpers.babilong_solver import parse
from tests.integration.test_resume import LossRecorder
from xl.config.rules import ConfigError, check_config
from xl.training.build import build_run, make_datamodule

EPOCH, STEPS = 4, 10  # validation at every epoch's end (4 segments), where a stage may change
# stage 1 ends by its budget at step 4, stage 2 by its threshold (any model's loss is below 1e9) at step 8
STAGES = "curriculum=[{length:0,steps:4},{length:60,metric:val/loss,below:1e9},{length:120}]"


def overrides(tmp_path, corpus, run: str) -> list[str]:
    return [
        "data=babilong", "model=tiny", "data/background=text", f"data.background.train={corpus['train']}",
        f"data.background.val={corpus['val']}", f"data.background.test={corpus['test']}", "data.tokenizer=word",
        "data.tasks=[qa1]", "data.length=0", "data.train_samples=stream", "data.eval_samples=6", "data.tgt_len=16",
        "data.batch_size=3", "memory.mem_len=16", "logger=csv", f"data.cache_dir={tmp_path / 'cache'}",
        f"paths.output_dir={tmp_path / run}", "model.dropout=0.1", f"trainer.limit_train_batches={EPOCH}",
        f"trainer.val_check_interval={EPOCH}", f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=12",
        "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "trainer.deterministic=true",
        "callbacks.progress_bar.refresh_rate=0", "+trainer.enable_model_summary=false",
        "callbacks.model_checkpoint.monitor=null", STAGES]


def fit(tmp_path, corpus, run: str, *extra: str):
    run_ = build_run(compose_config(*overrides(tmp_path, corpus, run), *extra))
    recorder, stages = LossRecorder(), {}

    class StageRecorder(LossRecorder):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            stages[trainer.global_step] = (trainer.datamodule.index + 1, batch[0].clone())

    run_.trainer.callbacks += [recorder, StageRecorder()]
    run_.trainer.fit(run_.module, datamodule=run_.datamodule, ckpt_path=run_.ckpt_path, weights_only=True)
    return run_, recorder.losses, stages


def test_stages_advance_by_budget_and_threshold_and_resume_exactly(tmp_path, corpus):
    whole, losses, stages = fit(tmp_path, corpus, "whole")
    assert {step: stage for step, (stage, _) in stages.items()} == {
        step: 1 if step <= 4 else 2 if step <= 8 else 3 for step in range(1, STEPS + 1)}
    assert whole.datamodule.starts == [0, 4, 8]
    # each stage reads its own length: stage 1's samples are the facts alone, stage 3's hold background
    lengths = [whole.datamodule.modules[i].stream.length for i in range(3)]
    assert lengths == [0, 60, 120]
    # the run's one results.json and one metrics.csv say the stage
    run_dir = tmp_path / "whole"
    csv = (run_dir / "csv" / "metrics.csv").read_text() if (run_dir / "csv").is_dir() else ""
    logged = next(run_dir.rglob("metrics.csv")).read_text() if not csv else csv
    assert "train/stage" in logged.splitlines()[0]

    for stop in (6, 8):  # mid stage 2, and at the validation that ends it
        first, _, _ = fit(tmp_path, corpus, f"first{stop}", f"trainer.max_steps={stop}")
        saved = torch.load(tmp_path / f"first{stop}" / "checkpoints" / "last.ckpt", weights_only=True)
        state = saved["CurriculumDataModule"]
        assert state["stage"] == (1 if stop < 8 else 2) and saved["global_step"] == stop
        second, second_losses, second_stages = fit(tmp_path, corpus, f"second{stop}",
                                                   f"ckpt_path={tmp_path / f'first{stop}'}")
        assert sorted(second_losses) == list(range(stop + 1, STEPS + 1))
        for step in second_losses:
            assert second_stages[step][0] == stages[step][0], f"step {step}: another stage after resume"
            assert torch.equal(second_stages[step][1], stages[step][1]), f"step {step}: another batch after resume"
            assert second_losses[step] == losses[step], f"step {step} differs after resume"
        for (name, a), b in zip(whole.module.state_dict().items(), second.module.state_dict().values(), strict=True):
            assert torch.equal(a, b), name


def test_the_last_stage_ends_the_run_and_results_say_the_stage(tmp_path, corpus):
    cfg = compose_config(*overrides(tmp_path, corpus, "short"),
                         "curriculum=[{length:0,steps:4},{length:60,metric:val/loss,below:1e9}]")
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule, weights_only=True)
    assert run.trainer.global_step == 8  # stage 2 passed its threshold at its first validation
    run.trainer.test(run.module, datamodule=run.datamodule, weights_only=True)
    results = json.loads((tmp_path / "short" / "results.json").read_text())
    assert (results["stage"], results["stages"], results["stage_starts"]) == (2, 2, [0, 4])


def test_every_stage_shares_one_vocabulary(tmp_path, corpus):
    cfg = compose_config(*overrides(tmp_path, corpus, "vocab"))
    data = make_datamodule(cfg)
    data.prepare_data()
    tokenizers = [m.tokenizer.to_dict() for m in data.modules]
    assert tokenizers[0] == tokenizers[1] == tokenizers[2]
    # the vocabulary holds the background's words, which the facts-alone stage never reads
    assert data.modules[0].stream.length == 0 and "json" in data.modules[0].tokenizer.itos
    assert data.modules[0].tokenizer_fingerprint == data.modules[2].tokenizer_fingerprint
    # fitted on its own length, the first stage's vocabulary would be another (the facts' words alone)
    alone = make_datamodule(compose_config(*overrides(tmp_path, corpus, "alone"), "curriculum=null"))
    alone.prepare_data()
    assert alone.tokenizer_fingerprint != data.modules[0].tokenizer_fingerprint


@pytest.mark.parametrize(("stage", "sentence"), [
    ("{length:0},{length:60}",
     "curriculum stage 1 never ends; give it steps=N or a threshold (below=... or above=...)"),
    ("{length:0,steps:0}", "curriculum stage 1: steps must be a whole number >= 1 (optimizer steps), got 0"),
    ("{length:0,metric:val/accuracy,below:1}", "curriculum stage 1: metric=val/accuracy is not a validation metric"),
    ("{length:0,step:4}", "curriculum stage 1 has step, which is not a stage setting"),
    ("{length:lots,steps:4}", "curriculum stage 1 needs length"),
    ("{length:0,steps:4,below:1,above:2}", "curriculum stage 1 has both below and above; give one threshold"),
    ("{length:0,train_most_questions:11,steps:4}",
     "curriculum stage 1: train_most_questions must be a whole number from 1 to 10, got 11"),
    ("{length:0,val_most_questions:0,steps:4}",
     "curriculum stage 1: val_most_questions must be a whole number from 1 to 10, got 0"),
    ("{length:0,train_support:{qa2:['drop, move']},steps:4}",
     "curriculum stage 1: train_support must map tasks to lists of what their answers follow from"),
])
def test_a_bad_stage_is_refused_in_one_sentence(tmp_path, corpus, stage, sentence):
    cfg = compose_config(*overrides(tmp_path, corpus, "bad"), f"curriculum=[{stage}]")
    with pytest.raises(ConfigError, match="^" + sentence.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
                       .replace("*", r"\*")) as err:
        check_config(cfg, lambda: 256)
    assert len(str(err.value)) < 200 and "\n" not in str(err.value)


def test_a_stage_over_the_number_of_facts_sets_the_training_stories_and_nothing_else(tmp_path, corpus):
    """``train_most_questions`` per stage: the first stage's qa1 training stories are two moves long, the last
    stage's up to ten; every stage keeps one vocabulary and the same val and test samples."""
    stages = "curriculum=[{length:0,train_most_questions:1,steps:4},{length:0}]"
    data = make_datamodule(compose_config(*overrides(tmp_path, corpus, "facts"), stages))
    data.prepare_data()
    first, last = data.modules
    assert {len(first.stream.sample(0, j).story.facts) for j in range(30)} == {2}
    assert max(len(last.stream.sample(0, j).story.facts) for j in range(30)) > 2
    assert first.tokenizer.to_dict() == last.tokenizer.to_dict()
    for split in ("val", "test"):
        assert list(first.source.samples(split)) == list(last.source.samples(split))


def test_a_stage_validated_on_its_own_stories_keeps_the_test_split(tmp_path, corpus):
    """``val_most_questions`` per stage: the first stage validates on two-move stories, the last on whole ones; the
    test split is BABILong's whole stories in every stage."""
    stages = "curriculum=[{length:0,train_most_questions:1,val_most_questions:1,steps:4},{length:0}]"
    data = make_datamodule(compose_config(*overrides(tmp_path, corpus, "own-val"), stages))
    data.prepare_data()
    first, last = data.modules
    assert {len(s.story.facts) for s in first.source.samples("val")} == {2}
    assert max(len(s.story.facts) for s in last.source.samples("val")) > 2
    assert list(first.source.samples("test")) == list(last.source.samples("test"))
    assert first.tokenizer.to_dict() == last.tokenizer.to_dict()


def test_a_stage_on_one_kind_of_support_sets_the_training_stories_and_nothing_else(tmp_path, corpus):
    """``train_support`` per stage: the first stage trains on qa2's stories whose object was carried by its holder's
    move (and qa1's as they are), the last on every story; one vocabulary, the same val and test samples."""
    stages = "curriculum=[{length:0,train_support:{qa2:['get, move']},steps:4},{length:0}]"
    settings = [o if o != "data.tasks=[qa1]" else "data.tasks=[qa1,qa2]" for o in overrides(tmp_path, corpus, "sup")]
    data = make_datamodule(compose_config(*settings, stages))
    data.prepare_data()
    first, last = data.modules

    def supports(module) -> set[str]:
        got = (module.stream.sample(0, j).story for j in range(40))
        return {", ".join(parse(s.facts[i]).kind for i in s.supporting) for s in got if s.task == "qa2"}

    assert supports(first) == {"get, move"}
    assert supports(last) == {"get, move", "move, get", "move, drop"}
    assert first.tokenizer.to_dict() == last.tokenizer.to_dict()
    for split in ("val", "test"):
        assert list(first.source.samples(split)) == list(last.source.samples(split))


def test_a_curriculum_needs_the_stream_and_validation_at_epoch_ends(tmp_path, corpus):
    with pytest.raises(ConfigError, match=r"^a curriculum trains on samples made while training; set data=babilong"):
        check_config(compose_config(*overrides(tmp_path, corpus, "bad"), "data.train_samples=20"), lambda: 256)
    with pytest.raises(ConfigError, match=r"^a curriculum changes stage at the end of an epoch"):
        check_config(compose_config(*overrides(tmp_path, corpus, "bad"), "trainer.val_check_interval=3"),
                     lambda: 256)


def test_a_curriculum_run_is_read_back_at_its_last_stage_with_its_vocabulary(tmp_path, corpus, monkeypatch):
    """xl.evaluate, xl.generate and xl.babilong read a curriculum's run as its last stage's data with the vocabulary
    every stage shares (a data group rebuilt without it would fit another vocabulary), and its segment length."""
    from tests.conftest import run_hydra_main
    from xl import train
    from xl.training.runs import TrainedRun

    argv = ["train.py", *overrides(tmp_path, corpus, "read"), f"hydra.run.dir={tmp_path / 'read'}",
            "trainer.max_steps=8", "curriculum=[{length:0,steps:4},{length:60}]"]
    run_hydra_main(train.main, argv, monkeypatch)
    run = TrainedRun.open(tmp_path / "read")
    assert run.checkpoint.train_tgt_len == 16
    assert run.data["length"] == 60 and run.data["vocabulary"] == {"length": 60, "tasks": ["qa1"]}
    data = run.datamodule()  # refused if its vocabulary were not the checkpoint's
    assert data.tokenizer_fingerprint == run.checkpoint.state["xl"]["tokenizer"]


def test_the_curriculum_the_babilong_page_shows_is_the_experiments():
    import re

    from omegaconf import OmegaConf

    from tests.helpers.paths import ROOT

    page = (ROOT / "docs/babilong.md").read_text(encoding="utf-8")
    shown = re.search(r"```yaml\n(curriculum:\n.*?)```", page, re.S).group(1)
    experiment = OmegaConf.load(ROOT / "conf" / "experiment" / "babilong_curriculum.yaml")
    assert OmegaConf.to_container(OmegaConf.create(shown))["curriculum"] == \
        OmegaConf.to_container(experiment)["curriculum"]
