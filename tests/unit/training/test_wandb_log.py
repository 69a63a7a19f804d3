"""The offline sessions of a W&B run, found by their folder names."""

from __future__ import annotations

from xl.training.services.wandb_log import sessions


def test_the_sessions_of_a_run_are_its_folders_oldest_first_same_second_ones_included(tmp_path):
    """W&B names a session ``offline-run-<start>-<id>``, and one that starts within the same second as another
    ``...-<id>-1`` (``-2``, ...); a run whose id merely starts with this one's is another run."""
    names = ["offline-run-20261206_153322-abc", "offline-run-20261206_153321-abc-1", "offline-run-20261206_153321-abc",
             "offline-run-20261206_153321-abcd", "offline-run-20261206_153321-xabc", "run-20261206_153321-abc"]
    for name in names:
        (tmp_path / name).mkdir()
    assert [p.name for p in sessions(tmp_path, "abc")] == [
        "offline-run-20261206_153321-abc", "offline-run-20261206_153321-abc-1", "offline-run-20261206_153322-abc"]
