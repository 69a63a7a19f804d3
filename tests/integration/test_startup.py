"""Commands that train nothing answer without importing Lightning (which alone takes seconds to import): printing
the composed config, the help, a misspelt key's one sentence and the footprint's arithmetic; the first three without
torch either (about as long again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.paths import ROOT

COMMANDS = {  # in this order: a library one command imports stays imported for the next
    "train.py --cfg job": "_target_: xl.data.SegmentDataModule",
    "train.py --help": "== Configuration groups ==",
    "train.py memory.mem_lenn=3": "error: memory.mem_lenn is not a setting; did you mean memory.mem_len?",
    "-m xl.footprint": "512m × 768d × 12L × 8b float32",
}
WITHOUT_TORCH = ("train.py --cfg job", "train.py --help", "train.py memory.mem_lenn=3")


def test_commands_that_train_nothing_do_not_import_lightning(tmp_path):
    argv = " -- ".join(["lightning,lightning.pytorch,lightning.fabric,torch", *COMMANDS])
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
        heavy = [name for name in run["at_end"] if name != "torch" or command in WITHOUT_TORCH]
        assert heavy == [] and run["at_first_output"] == run["at_end"], f"{command} imported {run['at_end']}"
