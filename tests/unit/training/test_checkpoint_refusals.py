"""A checkpoint that cannot serve is refused in one sentence that names the real cause: a run folder whose run
stopped before its first checkpoint, a folder whose checkpoints are all damaged, and a damaged file named on the
command line beside a complete one (the sentence names that one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError


def write(path: Path, step: int) -> Path:
    """A file with what Checkpoint.open reads of a checkpoint train.py wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"xl": {"model_config": {"n_layer": 1}}, "global_step": step}, path)
    return path


def damage(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


def run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 1\n")
    (run / "checkpoints").mkdir()
    return run


def refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(path)
    return str(info.value)


def test_a_run_folder_without_checkpoints_is_called_a_run_folder(tmp_path):
    run = run_folder(tmp_path)
    assert refusal(run) == (f"ckpt_path={run} is a run folder without checkpoints: its run stopped before the first "
                            "was written; train again, or give a .ckpt file or a run folder that has one")
    other = tmp_path / "other"
    other.mkdir()
    assert refusal(other) == f"ckpt_path={other} is a folder without checkpoints; give a run folder or a .ckpt file"


def test_a_folder_whose_checkpoints_are_all_damaged_names_them(tmp_path):
    run = run_folder(tmp_path)
    for name in ("last.ckpt", "step0000010.ckpt"):
        damage(write(run / "checkpoints" / name, 10))
    sentence = refusal(run)
    assert sentence == (f"ckpt_path={run} holds no complete checkpoint (last.ckpt, step0000010.ckpt: truncated or "
                        "corrupt); train again or give another checkpoint")


def test_a_damaged_file_named_on_the_command_line_names_the_complete_one_beside_it(tmp_path):
    folder = run_folder(tmp_path) / "checkpoints"
    last = write(folder / "last.ckpt", 30)
    write(folder / "step0000010.ckpt", 10)
    step20 = write(folder / "step0000020.ckpt", 20)
    damage(last)
    sentence = refusal(last)
    assert sentence.startswith(f"ckpt_path={last} cannot be read (")
    assert sentence.endswith(f"); step0000020.ckpt beside it is complete (step 20): give ckpt_path={step20}")
    assert "\n" not in sentence
    damage(step20)
    assert refusal(last).endswith(f"; step0000010.ckpt beside it is complete (step 10): give ckpt_path="
                                  f"{folder / 'step0000010.ckpt'}")
    damage(folder / "step0000010.ckpt")
    assert refusal(last).startswith(f"ckpt_path={last} cannot be read (truncated, corrupt or not a checkpoint): ")
