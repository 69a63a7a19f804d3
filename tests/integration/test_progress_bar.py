"""The training bar of a resumed run (xl/training/services/progress_bar.py): the run's steps, at a rate that makes
sense."""

from __future__ import annotations

import re

from tests.conftest import compose_config, tiny_overrides
from xl.train import fit_and_test


def test_a_resumed_runs_bar_counts_on_from_its_step_at_a_positive_rate(tmp_path, corpus, capsys):
    """tqdm's reset keeps the bar's initial count: redrawn at 0 against the resumed step, it showed a rate such as
    -1723686.58it/s."""
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith(("trainer.max_steps", "callbacks."))]
    fit_and_test(compose_config(*overrides, "trainer.max_steps=3", "test=false"))
    capsys.readouterr()
    fit_and_test(compose_config(*overrides, "trainer.max_steps=12", "test=false",
                                f"ckpt_path={tmp_path / 'run'}", "callbacks.progress_bar.refresh_rate=1"))
    drawn = capsys.readouterr()
    text = (drawn.out + drawn.err).replace("\r", "\n")
    rates = re.findall(r"(-?[\d.]+)it/s", text)
    assert rates and all(float(r) > 0 for r in rates), sorted(set(rates))
    assert re.search(r"\b3/12 \[", text) and re.search(r"\b12/12 \[", text)
