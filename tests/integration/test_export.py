"""python -m xl.export: a run into a shared folder (and a push refused at once where it cannot succeed); the folder
back into a run folder (python -m xl.convert) that train.py init_from= fine-tunes; the Python of docs/sharing.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import xl.export
from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from tests.helpers.hub_env import hub_offline, hub_unreachable
from tests.helpers.paths import ROOT
from xl import train
from xl.convert.cli import main as convert_main
from xl.data.tokenizers import WordTokenizer, fingerprint
from xl.hub import PretrainedXL
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError
from xl.training.checkpoints.run_folder import new_folder
from xl.training.runs import TrainedRun

DOCS = ROOT / "docs" / "sharing.md"


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus) -> Path:
    """A tiny word-level run trained as ``python train.py`` trains one, with an evaluation context of its own."""
    tmp = tmp_path_factory.mktemp("export_run")
    monkeypatch = pytest.MonkeyPatch()
    try:
        run_hydra_main(train.main, ["train.py", *tiny_overrides(tmp, corpus), "data.tokenizer=word",
                                    "trainer.max_steps=2", "trainer.val_check_interval=2",
                                    "trainer.num_sanity_val_steps=0", "memory.eval_mem_len=24", "test=false",
                                    f"hydra.run.dir={tmp / 'run'}"], monkeypatch)
    finally:
        monkeypatch.undo()
    return tmp / "run"


@pytest.fixture(scope="module")
def shared(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shared") / "model"
    monkeypatch = pytest.MonkeyPatch()
    try:
        run_hydra_main(xl.export.main, ["xl.export", f"ckpt={run}", f"out={out}",
                                        f"hydra.run.dir={out.parent / 'hydra'}"], monkeypatch)
    finally:
        monkeypatch.undo()
    return out


def segments(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        first = model(x[:, :8])
        return [first.logits, model(x[:, 8:], first.mems).logits]


def test_export_writes_the_runs_model_and_tokenizer(run, shared, corpus):
    checkpoint = Checkpoint.open(run)
    original, loaded = checkpoint.load_model(), PretrainedXL.from_pretrained(shared)
    assert sorted(p.name for p in shared.iterdir()) == ["README.md", "config.json", "model.safetensors", "vocab.json"]
    saved = original.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in loaded.state_dict().items()) and saved.keys() == \
        loaded.state_dict().keys()
    x = torch.randint(0, original.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(segments(original, x), segments(loaded, x), strict=True))
    trained_with = TrainedRun.open(run).tokenizer  # the fitted vocabulary, read back as a vocabulary file
    text = corpus["val"].read_text(encoding="utf-8")
    assert loaded.tokenizer.itos == trained_with.itos
    assert (loaded.tokenizer.encode(text) == trained_with.encode(text)).all()
    assert json.loads((shared / "config.json").read_text())["tokenizer"]["fingerprint"] == fingerprint(
        WordTokenizer(file=shared / "vocab.json"))  # what a run reading data.tokenizer_file records
    assert loaded.about["evaluation"]["mem_len"] == 24
    assert loaded.about["training"]["steps"] == 2 and loaded.about["training"]["tgt_len"] == 16
    assert "It was trained for 2 steps on data.train (" in (shared / "README.md").read_text()


def test_the_shared_folder_fine_tunes_from_its_own_weights(shared, corpus, tmp_path, capsys):
    """python -m xl.convert FOLDER START, then train.py init_from=START: the first training loss is the shared
    model's loss on the same batch (dropout off), and the run trains."""
    start = tmp_path / "start"
    convert_main([str(shared), str(start)])
    settings = f"data.tokenizer=word data.tokenizer_file={start / 'vocab.json'}"
    assert f"read text with its tokenizer: {settings}" in capsys.readouterr().out
    checkpoint = Checkpoint.open(start)
    assert checkpoint.hyper_parameters["eval_mem_len"] == 24  # xl.evaluate's default context is the run's
    assert checkpoint.state["xl"]["converted_from"]["source"] == f"folder {shared.resolve()}"
    overrides = [*tiny_overrides(tmp_path, corpus), f"init_from={start}", *settings.split(), "model.dropout=0.0",
                 "model.dropatt=0.0", "trainer.max_steps=1", "trainer.num_sanity_val_steps=0", "test=false"]
    fine_tune = build_run(compose_config(*overrides))
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    fine_tune.trainer.callbacks.append(Record())
    fine_tune.trainer.fit(fine_tune.module, datamodule=fine_tune.datamodule)
    model = PretrainedXL.from_pretrained(shared)
    x, y = next(iter(fine_tune.datamodule.train_dataloader()))[:2]
    with torch.no_grad():
        expected = model(x, targets=y).loss
    assert fine_tune.trainer.global_step == 1 and losses[0] == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(CheckpointError, match=r"ckpt_path=.*start is a converted model .* with init_from="):
        build_run(compose_config(*[o for o in overrides if not o.startswith("init_from")], f"ckpt_path={start}"))


def test_a_push_or_folder_that_cannot_work_is_refused_before_anything_is_written(run, shared, tmp_path,
                                                                                  monkeypatch):
    def export(*extra: str) -> None:
        run_hydra_main(xl.export.main, ["xl.export", f"ckpt={run}", f"hydra.run.dir={tmp_path / 'h'}", *extra],
                       monkeypatch)

    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"^error: push=nobody is not a hub repository id like org/name$"):
        export(f"out={out}", "push=nobody")
    hub_offline(monkeypatch)
    with pytest.raises(SystemExit, match=rf"^error: push=me/tiny-xl needs the Hugging Face hub but HF_HUB_OFFLINE "
                                         rf"is set; leave push unset, and upload {re.escape(str(out))} later$"):
        export(f"out={out}", "push=me/tiny-xl")
    hub_unreachable(monkeypatch)
    with pytest.raises(SystemExit, match=r"^error: push=me/tiny-xl needs the Hugging Face hub but 127\.0\.0\.1 "
                                         r"cannot be reached \(\[Errno 111\] Connection refused\)"):
        export(f"out={out}", "push=me/tiny-xl")
    assert not out.exists()
    with pytest.raises(SystemExit, match=r"^error: out=.*model exists and is not empty; remove it or give another"):
        export(f"out={shared}")
    alone = tmp_path / "alone.ckpt"  # the run's checkpoint outside its run folder: its data settings unknown
    alone.write_bytes((run / "checkpoints" / "last.ckpt").read_bytes())
    with pytest.raises(SystemExit, match=r"^error: ckpt=.*alone\.ckpt is not inside its run folder"):
        run_hydra_main(xl.export.main, ["xl.export", f"ckpt={alone}", f"out={out}", f"hydra.run.dir={tmp_path / 'h'}"],
                       monkeypatch)
    assert not out.exists()


def test_the_python_of_the_sharing_page_runs(run, shared, tmp_path, monkeypatch, capsys):
    """docs/sharing.md's Python blocks, as written, in a folder holding ``shared``, with RUN the run folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shared").symlink_to(shared)
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    assert blocks
    for block in blocks:
        exec(compile(block.replace('"RUN"', json.dumps(str(run))), str(DOCS), "exec"), {})
    assert capsys.readouterr().out  # the continuation was printed (newlines, from a model trained 2 steps)
    assert PretrainedXL.from_pretrained(tmp_path / "shared-again").tokenizer is not None


KILLED_EXPORT = """
import sys
import xl.export
from xl.hub import PretrainedXL

save = PretrainedXL.save_pretrained

def save_and_wait(self, folder, *args, **kwargs):
    save(self, folder, *args, **kwargs)
    print("staged:", folder, flush=True)
    sys.stdin.read()  # killed here: the model is staged in full, not yet renamed into place

PretrainedXL.save_pretrained = save_and_wait
sys.argv = ["xl.export", *sys.argv[1:]]
xl.export.main()
"""


class LiveExportFails(Exception):
    pass


def test_a_killed_exports_staging_folder_is_removed_by_the_next_run_and_a_live_ones_is_kept(run, tmp_path,
                                                                                          monkeypatch):
    """A killed xl.export left .OUT.*.tmp/ (a full weights file) that no rerun removed; now the next export to OUT
    removes it, while the staging folder of an export still under way (held by a live process) is kept."""
    out = tmp_path / "model"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, f"ckpt={run}", f"out={out}",
                              f"hydra.run.dir={tmp_path / 'h1'}"], cwd=tmp_path, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    line = ""
    while not line.startswith("staged: "):
        line = child.stdout.readline()
        assert line, f"the export ended before it staged its files (rc {child.wait()})"
    killed = Path(line.removeprefix("staged: ").strip())
    child.kill()
    child.wait()
    child.stdout.close()
    child.stdin.close()
    assert killed.parent == tmp_path and (killed / "model.safetensors").is_file(), "what the kill leaves"
    with pytest.raises(LiveExportFails), new_folder(out) as live:  # another export to OUT, under way
        (live / "model.safetensors").write_bytes(b"partly written")
        run_hydra_main(xl.export.main, ["xl.export", f"ckpt={run}", f"out={out}", f"hydra.run.dir={tmp_path / 'h2'}"],
                       monkeypatch)
        assert not killed.exists(), "the killed export's staging folder is removed"
        assert (live / "model.safetensors").read_bytes() == b"partly written", "the live one's is kept"
        raise LiveExportFails  # (its own failure removes it)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert (out / "model.safetensors").is_file()
