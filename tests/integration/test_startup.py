"""Commands that train nothing answer without importing Lightning (which alone takes seconds to import): printing
the composed config, every command's help, a misspelt key's one sentence, a value out of its range, a broken rule
between settings and the footprint's arithmetic; all but the last two without torch either (about as long again).
What each command imported is checked, not how long it took, so that the test holds on a loaded machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.paths import ROOT

HELP = "== Configuration groups =="
COMMANDS = {  # in this order: a library one command imports stays imported for the next
    "train.py --cfg job": "_target_: xl.data.SegmentDataModule",
    "train.py --help": HELP,
    "train.py memory.mem_lenn=3": "error: memory.mem_lenn is not a setting; did you mean memory.mem_len?",
    "-m xl.evaluate --help": HELP,
    "-m xl.generate --help": HELP,
    "-m xl.export --help": HELP,
    "-m xl.babilong --help": HELP,
    "-m xl.evaluate ckpt=RUN warmpu=1": "error: warmpu is not a setting; did you mean warmup?",
    "-m xl.generate ckpt=RUN temprature=0.5": "error: temprature is not a setting; did you mean temperature?",
    "train.py trainer.max_steps=-5 hydra.run.dir=OUT": "error: trainer.max_steps must be -1 (no limit)",
    "train.py model.n_head=0 hydra.run.dir=OUT": "error: model.n_head must be a positive integer, got 0",
    "-m xl.generate ckpt=RUN top_p=1.5 hydra.run.dir=OUT": "error: top_p must be a number in (0, 1], got 1.5",
    "train.py trainer.strategy=dpp hydra.run.dir=OUT": "error: trainer.strategy must be auto, a mapping with a",
    # torch from here on (a memory's settings are typed by its module, which imports torch)
    "-m xl.footprint": "512m × 768d × 12L × 8b float32",
    "train.py memory.mem_len=0 memory.same_length=true hydra.run.dir=OUT":
        "error: memory.same_length=True needs mem_len > 0",
}
WITHOUT_TORCH = list(COMMANDS)[:list(COMMANDS).index("-m xl.footprint")]


def test_commands_that_train_nothing_do_not_import_lightning(tmp_path):
    commands = [command.replace("OUT", str(tmp_path / "out")) for command in COMMANDS]
    argv = " -- ".join(["lightning,lightning.pytorch,lightning.fabric,torch", *commands])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "tests.helpers.startup", *argv.split()], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [" ".join(r["argv"]) for r in runs] == commands
    for run, command, expected in zip(runs, COMMANDS, COMMANDS.values(), strict=True):
        assert expected in run["output"], f"{command} printed:\n{run['output'][-2000:]}"
        assert run["code"] == (1 if "error:" in expected else 0), command
        heavy = [name for name in run["at_end"] if name != "torch" or command in WITHOUT_TORCH]
        assert heavy == [] and run["at_first_output"] == run["at_end"], f"{command} imported {run['at_end']}"
