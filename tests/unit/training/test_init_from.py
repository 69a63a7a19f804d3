"""python train.py init_from=RUN: a new run from a checkpoint's weights (a converted published model here)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from tests.conftest import compose_config, run_hydra_main
from tests.helpers.paths import FIXTURES
from xl import train
from xl.convert import convert
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError
from xl.training.checkpoints.init_from import start_from

FIXTURE = FIXTURES / "transfo_xl"
TEXT = FIXTURE / "text.txt"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("init") / "wt"
    convert(FIXTURE, out)
    return out


def overrides(tmp_path: Path, converted: Path, *extra: str) -> list[str]:
    return [f"init_from={converted}", "data=text", f"data.train={TEXT}", f"data.val={TEXT}", f"data.test={TEXT}",
            "data.tokenizer=word", f"data.tokenizer_file={converted / 'vocab.json'}", f"data.cache_dir={tmp_path}",
            f"paths.output_dir={tmp_path / 'run'}", "logger=none", "data.batch_size=2", "data.tgt_len=5",
            "memory.mem_len=7", "memory.clamp_len=4", "memory.same_length=true", "model.dropout=0.0",
            "model.dropatt=0.0", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=0", "trainer.precision=32-true", "callbacks.progress_bar.refresh_rate=0",
            "+trainer.enable_model_summary=false", "test=false", *extra]


class FirstLoss(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def test_fine_tuning_a_converted_model_starts_at_its_loss_and_trains(tmp_path, converted, caplog):
    run = build_run(compose_config(*overrides(tmp_path, converted)))
    (warning,) = [r.getMessage() for r in caplog.records if "shape is the checkpoint's" in r.getMessage()]
    assert "n_layer=2" in warning and "cutoffs" not in warning  # the group's null cutoffs: the data's to fit
    checkpoint = Checkpoint.open(converted)
    config = run.module.config  # the checkpoint's shape: the original's layout and tying
    assert config.cutoffs == (20, 40, 70) and config.tie_weights and config.tie_projs == (False, True, True, True)
    start = {k: v.clone() for k, v in run.module.model.state_dict().items()}
    first = FirstLoss()
    run.trainer.callbacks.append(first)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 2 and len(first.losses) == 2  # a fresh optimizer, from step 0
    model = checkpoint.load_model()
    x, y = next(iter(run.datamodule.train_dataloader()))[:2]  # the first batch: the start of the corpus
    with torch.no_grad():
        expected = model(x, targets=y, mem_len=7, clamp_len=4, same_length=True).loss
    assert first.losses[0] == pytest.approx(float(expected), rel=1e-5)
    after = run.module.model.state_dict()
    assert any(not torch.equal(start[k], after[k]) for k in start)  # it trained
    assert torch.equal(start["layers.0.attn.r_w_bias"], checkpoint.model_weights()["layers.0.attn.r_w_bias"])


def test_init_from_refuses_another_tokenizer_and_gives_way_to_a_resume(tmp_path, converted):
    fitted = [o for o in overrides(tmp_path, converted) if not o.startswith("data.tokenizer_file")]
    with pytest.raises(CheckpointError, match=r"init_from=.* (another tokenizer|vocabulary of 100)"):
        build_run(compose_config(*fitted))
    with pytest.raises(CheckpointError, match=r"ckpt_path=.* is a converted model .* with init_from="):
        build_run(compose_config(*[o for o in overrides(tmp_path, converted) if not o.startswith("init_from")],
                                 f"ckpt_path={converted}"))
    resumed = tmp_path / "resumed.ckpt"  # a fine-tune's own checkpoint: no longer a converted one
    state = Checkpoint.open(converted).state
    del state["xl"]["converted_from"]
    torch.save(state, resumed)
    cfg = compose_config(*overrides(tmp_path, converted), f"ckpt_path={resumed}")
    assert start_from(cfg) is None and cfg.model.n_layer != 2  # the resumed checkpoint decides, not init_from


def test_a_conflicting_model_setting_on_the_command_line_is_refused(tmp_path, converted, monkeypatch, capsys):
    argv = ["train.py", *overrides(tmp_path, converted), "model.n_layer=3"]
    with pytest.raises(SystemExit, match=r"model\.n_layer=3 conflicts with init_from=.*n_layer=2"):
        run_hydra_main(train.main, argv, monkeypatch)
    argv = ["train.py", *overrides(tmp_path, converted), "model.cutoffs=[20,40]"]
    with pytest.raises(SystemExit, match=r"model\.cutoffs=\[20, 40\] conflicts with init_from=.*\[20, 40, 70\]"):
        run_hydra_main(train.main, argv, monkeypatch)


def test_a_run_trained_with_a_tokenizer_file_fine_tunes_on_other_text(tmp_path, corpus, caplog):
    """The tokenizer file's ids do not depend on the corpus, so the checkpoint's fingerprint is the other text's.
    The model group is the checkpoint's (model=tiny, cutoffs fitted to the data): nothing to warn about."""
    from tests.conftest import tiny_overrides
    from tests.unit.data.test_data import write_corpus
    from tests.unit.data.test_tokenizers import hf_tokenizer

    file = tmp_path / "tokenizer.json"
    hf_tokenizer("BPE", 320).save(str(file))
    subwords = ["data.tokenizer=bpe", f"data.tokenizer_file={file}", "trainer.max_steps=2", "test=false"]
    first = build_run(compose_config(*tiny_overrides(tmp_path, corpus), *subwords))
    first.trainer.fit(first.module, datamodule=first.datamodule)
    texts = {split: path.read_text(encoding="utf-8") for split, path in corpus.items()}
    (tmp_path / "other").mkdir()
    other = write_corpus(tmp_path / "other", texts["test"] * 3 + texts["val"], texts["train"][:4000],
                         texts["train"][4000:8000])
    tuned = build_run(compose_config(*tiny_overrides(tmp_path, corpus), *subwords,
                                     *(f"data.{split}={path}" for split, path in other.items()),
                                     f"data.cache_dir={tmp_path / 'other-cache'}",
                                     f"init_from={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
                                     f"paths.output_dir={tmp_path / 'tuned'}"))
    assert tuned.datamodule.tokenizer_fingerprint == first.datamodule.tokenizer_fingerprint
    assert "shape is the checkpoint's" not in caplog.text
    tuned.trainer.fit(tuned.module, datamodule=tuned.datamodule)
    assert tuned.trainer.global_step == 2


@pytest.mark.parametrize("memory", ["tokens", "knn", "compressive"])
def test_a_run_with_another_memory_starts_from_the_weights_and_its_memory_fresh(tmp_path, corpus, caplog, memory):
    """As the Recurrent Memory Transformer adds memory tokens to a trained model: init_from a run with the plain
    cache into a run with a memory that has weights of its own. The model's weights are the checkpoint's, the
    memory's own are those a fresh run of the same seed draws; the other way, the memory's own are left out."""
    from tests.conftest import tiny_overrides

    base = [*tiny_overrides(tmp_path, corpus), "trainer.max_steps=2", "test=false", "seed=3"]
    first = build_run(compose_config(*base))
    first.trainer.fit(first.module, datamodule=first.datamodule)
    saved = Checkpoint.open(tmp_path / "run").model_weights()

    other = [f"memory={memory}", "memory.mem_len=16"] + (["memory.knn_size=64"] if memory == "knn" else [])
    fresh = build_run(compose_config(*base, *other, f"paths.output_dir={tmp_path / 'fresh'}")).module.model
    tuned = build_run(compose_config(*base, *other, f"init_from={tmp_path / 'run'}",
                                     f"paths.output_dir={tmp_path / 'tuned'}"))
    weights = tuned.module.model.state_dict()
    own = [k for k in weights if k.split(".", 1)[0] in tuned.module.model.memory_modules]
    assert own and set(weights) == set(saved) | set(own) and not set(own) & set(saved)
    assert all(torch.equal(weights[k], saved[k]) for k in saved)
    assert all(torch.equal(weights[k], fresh.state_dict()[k]) for k in own)
    assert f"its own weights start fresh: {', '.join(sorted(own))}" in caplog.text
    tuned.trainer.fit(tuned.module, datamodule=tuned.datamodule)  # it trains, and writes its own checkpoint
    assert tuned.trainer.global_step == 2

    back = build_run(compose_config(*base, f"init_from={tmp_path / 'tuned'}", f"paths.output_dir={tmp_path / 'back'}"))
    tuned_weights = Checkpoint.open(tmp_path / "tuned").model_weights()
    assert set(back.module.model.state_dict()) == set(saved)
    assert all(torch.equal(v, tuned_weights[k]) for k, v in back.module.model.state_dict().items())
    assert "the checkpoint's memory weights are left out: " + ", ".join(sorted(own)) in caplog.text


def test_a_missing_weight_of_the_model_itself_is_still_refused(tmp_path, corpus):
    from tests.conftest import tiny_overrides

    base = [*tiny_overrides(tmp_path, corpus), "trainer.max_steps=1", "test=false"]
    first = build_run(compose_config(*base))
    first.trainer.fit(first.module, datamodule=first.datamodule)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=False)
    del state["state_dict"]["model.layers.0.attn.r_w_bias"]
    torch.save(state, tmp_path / "edited.ckpt")
    with pytest.raises(CheckpointError, match=r"init_from=.* holds weights that do not fit this model: "
                                              r"layers\.0\.attn\.r_w_bias is missing"):
        build_run(compose_config(*base, "memory=tokens", f"init_from={tmp_path / 'edited.ckpt'}",
                                 f"paths.output_dir={tmp_path / 'other'}"))


def test_a_weight_under_a_module_no_memory_of_the_checkpoint_builds_is_refused(tmp_path, corpus):
    """Only the checkpoint's own memory's modules are left out: a weight under any other module this model lacks
    (a later model class's, an edited file) is refused, not dropped."""
    from tests.conftest import tiny_overrides

    base = [*tiny_overrides(tmp_path, corpus), "trainer.max_steps=1", "test=false"]
    first = build_run(compose_config(*base, "memory=tokens"))
    first.trainer.fit(first.module, datamodule=first.datamodule)
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    state["state_dict"]["model.future.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "edited.ckpt")
    with pytest.raises(CheckpointError, match=r"init_from=.* holds weights that do not fit this model: .*future"):
        build_run(compose_config(*base, f"init_from={tmp_path / 'edited.ckpt'}", f"paths.output_dir={tmp_path / 'b'}"))
