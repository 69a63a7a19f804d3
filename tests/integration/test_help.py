"""Every command's ``--help`` is composed once and filled into Hydra's help template (xl/config/help.py); what it
prints is what Hydra's own ``--help`` prints for the same command line, computed here through Hydra itself."""

from __future__ import annotations

import hydra
import pytest

import xl.babilong
import xl.evaluate
import xl.export
import xl.generate
import xl.train
from tests.conftest import run_hydra_main
from xl.config.compose import CONF_DIR
from xl.config.help import help_overrides, job_name, render_help

COMMANDS = {  # a command's entry point, its config and a command line asking for help
    "train": (xl.train.train_main, "config", ["train.py", "--help"]),
    "train with groups": (xl.train.train_main, "config", ["train.py", "experiment=enwik8_base", "memory=knn",
                                                          "model.n_layer=3", "-h"]),
    "evaluate": (xl.evaluate.main, "evaluate", ["evaluate.py", "--help", "ckpt=RUN"]),
    "generate": (xl.generate.main, "generate", ["generate.py", "--help"]),
    "export": (xl.export.main, "export", ["export.py", "--help"]),
    "babilong": (xl.babilong.main, "babilong", ["babilong.py", "--help"]),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_help_is_hydras_own(command, capsys, monkeypatch):
    entry, config_name, argv = COMMANDS[command]
    # Hydra's help for the same command: hydra.main reads the job name from the task under the entry point's wrapper
    hydras = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(entry)
    with pytest.raises(SystemExit, match="^0$"):
        run_hydra_main(hydras, argv, monkeypatch)
    expected = capsys.readouterr().out
    assert "== Configuration groups ==" in expected and "\ndata: " in expected

    fast = render_help(CONF_DIR, config_name, job_name(entry.__wrapped__), help_overrides(argv[1:]))
    assert fast is not None and fast + "\n" == expected
    with pytest.raises(SystemExit, match="^0$"):
        run_hydra_main(xl.train.main if entry is xl.train.train_main else entry, argv, monkeypatch)
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("argv", [["--help", "--resolve"], ["-m", "--help"], ["--hydra-help"], ["--cfg", "job"],
                                  ["--help", "--config-name=evaluate"], ["seed=1"],
                                  ["seed=1", "--help", "model=tiny"]])
def test_any_other_flag_is_left_to_hydra(argv):
    assert help_overrides(argv) is None


def test_a_config_that_does_not_compose_is_left_to_hydra():
    assert render_help(CONF_DIR, "config", "train", ["memory=nope"]) is None
