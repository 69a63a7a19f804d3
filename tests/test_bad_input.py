"""The README's bad-input table, row by row: one sentence naming the setting, nothing half-written."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import fsspec.implementations.local as fsspec_local
import pytest
import torch

from tests.conftest import compose_config, tiny_overrides
from xl.build import ConfigError, build_run
from xl.checkpoint import CheckpointError
from xl.data import DataError

ROOT = Path(__file__).resolve().parents[1]
USER_ERRORS = (ConfigError, DataError, CheckpointError)


def files(tmp_path: Path, train: bytes | None = None, val: bytes | None = None) -> dict[str, Path]:
    text = (ROOT / "xl" / "model.py").read_bytes()
    paths = {}
    for split, content in (("train", train), ("val", val), ("test", None)):
        paths[split] = tmp_path / f"{split}.txt"
        if content != b"MISSING":
            paths[split].write_bytes(text if content is None else content)
    return paths


ROWS = {
    # name: (overrides, corpus (train, val) or None, error type, text the message must contain)
    "negative memory": (["memory.mem_len=-1"], None, ConfigError, "mem_len must be an integer >= 0"),
    "memory not a number": (["memory.mem_len=abc"], None, ConfigError, "mem_len must be an integer >= 0"),
    "zero batch": (["data.batch_size=0"], None, DataError, "data.batch_size must be at least 1"),
    "zero heads": (["model.n_head=0"], None, ConfigError, "XLConfig.n_head must be a positive integer"),
    "odd width": (["model.d_model=31"], None, ConfigError, "XLConfig.d_model must be even"),
    "dropout out of range": (["model.dropout=1.0"], None, ConfigError, "XLConfig.dropout must be in [0, 1)"),
    "same_length without memory": (["memory.mem_len=0", "memory.same_length=true"], None, ConfigError,
                                   "same_length=True needs mem_len > 0"),
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
    assert not (tmp_path / "run").exists(), "nothing may be written before the input is known to be good"
    # No temporary or partial file is left; a cache without meta.json (written last) is never trusted.
    leftovers = [p.name for p in tmp_path.rglob("*") if "tmp" in p.name or p.name.startswith(".")]
    assert leftovers == []


def test_char_vocabulary_gap_is_reported_and_read_as_unknown(tmp_path, caplog):
    corpus = files(tmp_path, b"abc abc\n" * 200, b"abz \xc3\xa9\xc3\xa9\n" * 50)
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "data.tokenizer=char", "data.batch_size=2")
    run = build_run(cfg)
    assert run.datamodule.vocab_size == len(set("abc \n")) + 1
    assert "150 char symbols of the val split are not in the vocabulary" in caplog.text


def run_train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_unknown_key_and_unwritable_output_folder_from_the_command_line(tmp_path):
    result = run_train(tmp_path, "memory.mem_lenn=3")
    assert result.returncode != 0 and "Could not override 'memory.mem_lenn'" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_train(tmp_path, "hydra.run.dir=/etc/hostname/run")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "cannot write to the output folder /etc/hostname/run" in result.stderr and "hydra.run.dir" in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, corpus, monkeypatch):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=4",
                         "callbacks.model_checkpoint.monitor=null",
                         "callbacks.model_checkpoint.every_n_train_steps=2")
    run = build_run(cfg)
    real_write = fsspec_local.LocalFileOpener.write

    def write(self, data):
        if run.trainer.global_step >= 4:  # the second checkpoint runs out of space half-way
            real_write(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(fsspec_local.LocalFileOpener, "write", write)
    with pytest.raises(OSError, match="No space left"):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    folder = tmp_path / "run" / "checkpoints"
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step0000002.ckpt"]
