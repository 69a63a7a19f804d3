"""Commands that train nothing answer without importing Lightning (which alone takes seconds to import): printing
the composed config, the help, the footprint's arithmetic, and a misspelt key's one sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.paths import ROOT

COMMANDS = {
    "train.py --cfg job": "_target_: xl.data.SegmentDataModule",
    "train.py --help": "== Configuration groups ==",
    "-m xl.footprint": "512m × 768d × 12L × 8b float32",
    "train.py memory.mem_lenn=3": "error: memory.mem_lenn is not a setting; did you mean memory.mem_len?",
}


def test_commands_that_train_nothing_do_not_import_lightning(tmp_path):
    argv = " -- ".join(["lightning,lightning.pytorch,lightning.fabric", *COMMANDS])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "tests.helpers.startup", *argv.split()], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [" ".join(r["argv"]) for r in runs] == list(COMMANDS)
    for run, expected in zip(runs, COMMANDS.values(), strict=True):
        command = " ".join(run["argv"])
        assert expected in run["output"], f"{command} printed:\n{run['output'][-2000:]}"
        assert run["code"] == (1 if "error:" in expected else 0), command
        assert run["at_first_output"] == [] and run["at_end"] == [], f"{command} imported {run['at_end']}"
