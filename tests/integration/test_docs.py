"""Every command the docs show runs as written: README.md, docs/*.md and the entry points' docstrings.

Commands come from the fenced ```bash blocks of the Markdown files and from the ``python …`` examples of the module
docstrings of ``train.py`` and ``xl/``. Each command line is given to ``bash -c`` as written, so quoting, globs and
line continuations are the shell's, with ``python`` and ``pip`` replaced by shell functions that record the arguments
bash hands them, and with no ``PATH``, so that nothing else can start. Each recorded ``python`` command then runs in
this process as ``python`` would run it (``runpy``, with the ``sys.argv`` bash produced), so the argument parsers and
Hydra's override grammar read exactly what a user's shell passes; the command is shrunk to seconds by arguments
appended after the user's (``SCALE``: a tiny model, two steps, a few batches; later overrides win in Hydra and
argparse). Commands run in a fresh folder holding small text files under the names the docs use (``WORKSPACE_FILES``),
one block after another in document order, so a block that trains and then evaluates what it trained runs as such.
``RUN`` and ``CKPT`` in a command stand for a run folder and its ``last.ckpt``, made by a tiny training first;
``SRC`` for a published-layout model folder (the test fixture), ``OUT`` for a new folder (``substitute``). A command
naming a training's step checkpoint (``runs/x/checkpoints/step0001000.ckpt``) names the one the shrunk training
writes instead (``shrunk_step``).

Install commands are not run: they must be the CI's (``.ci/run``) or name an extra that ``pyproject.toml`` defines.
Commands that cannot run here (a GPU, a cluster, a download, an account) are listed in ``SKIP`` with the reason; their
shell syntax is still checked and Hydra still composes their overrides. A command that is neither runnable nor listed
fails the suite, and so does a listed command that no document shows any more.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import logging
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch  # noqa: F401  (its loggers exist before a command configures them: see restore_logging)
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser

from tests.helpers.paths import FIXTURES, ROOT

CONF_DIR = ROOT / "conf"
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASH = shutil.which("bash") or "/bin/bash"
CI_COMMAND = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]

# Hydra entry points and the config each composes (for commands that are only composed).
HYDRA_CONFIGS = {"train.py": "config", "xl.evaluate": "evaluate", "xl.generate": "generate", "xl.export": "export",
                 "xl.babilong": "babilong"}

BIND_ONE_STAGE = ("curriculum=[{length:0,train_most_questions:1,steps:6000},{length:0}] "
                  "trainer.limit_train_batches=1000 trainer.val_check_interval=1000")
# Commands shown but not run here, each with the reason (keys: the command as shlex reads it, comments dropped).
SKIP = {
    # GPUs and clusters
    "python train.py trainer=ddp trainer.devices=4": "needs 4 GPUs",
    "python train.py trainer=ddp trainer.devices=8 trainer.num_nodes=2": "needs 2 nodes of 8 GPUs",
    "python train.py trainer=fsdp trainer.devices=8": "needs 8 GPUs",
    "python train.py -m hydra/launcher=slurm trainer=ddp trainer.devices=4 trainer.num_nodes=2 memory.mem_len=256,512 "
    "hydra.launcher.partition=gpu hydra.launcher.timeout_min=1440": "needs a SLURM cluster",
    "python -m xl.bench.gpu": "needs a CUDA GPU",
    "python -m xl.bench.gpu --experiment enwik8_base": "needs a CUDA GPU",
    "python -m xl.bench.gpu --experiment babilong_gpu --estimate": "needs a CUDA GPU",
    "python train.py experiment=babilong_gpu hydra.run.dir=runs/gpu":
        "a GPU's run, PG-19 from the Hugging Face hub; tests/integration/test_experiments.py trains its first steps",
    "python -m xl.babilong ckpt=runs/gpu tasks=[qa1,qa2] lengths=[0,1k,4k,16k,64k,128k]":
        "scores the GPU run the command above makes",
    # hours of CPU
    "python -m xl.probe data.source.gap=600 data.source.eval_episodes=400 memory=knn memory.knn_size=512 --mem-lens 32 "
    "--distances 16 48 64 128 256 512 --seeds 1 2 3 4 5 --score data.source.gap=16600 data.source.eval_episodes=90 "
    "data.source.distances=[1024,4096,16384] memory.knn_size=16384":
        "five trainings and scorings over 16,600-token episodes; the one-seed commands above it run",
    "python -m xl.probe data.source.gap=400 memory=tokens --mem-lens 32 --steps 1500 --seeds 1 2 3 4 5 --score "
    "data.source.gap=1100 data.source.eval_episodes=200 data.source.distances=[16,48,64,160,512,1024]":
        "five trainings and scorings; the one-seed commands above it run",
    "python -m xl.probe data.source.gap=400 memory=tokens memory.grad_segments=4 --mem-lens 32 --steps 3000 --seeds 1 "
    "2 3 4 5 --score data.source.gap=1100 data.source.eval_episodes=200 data.source.distances=[16,48,64,160,512,1024]":
        "five trainings and scorings; the one-seed commands above it run",
    "python -m xl.probe data.source.gap=400 memory=lmrmt --mem-lens 32 --steps 1500 --seeds 1 2 3 4 5 --score "
    "data.source.gap=1100 data.source.eval_episodes=200 data.source.distances=[16,48,64,160,512,1024]":
        "five trainings and scorings; the one-seed commands above it run",
    "python -m xl.probe data.source.gap=400 memory=compressive memory.cmem_len=16 memory.cmem_rate=4 --mem-lens 16 "
    "--seeds 1 2 3 4 5": "five trainings; the one-seed commands above it run",
    "python -m xl.probe data.source.gap=400 memory=compressive memory.cmem_len=16 memory.cmem_rate=4 --mem-lens 16 "
    "--seeds 1 2 3 4 5 --score data.source.gap=1100 data.source.eval_episodes=200 "
    "data.source.distances=[16,48,96,160,512,1024]": "five trainings and scorings; the one-seed commands above it run",
    "python -m xl.probe memory.grad_segments=2 --mem-lens 32 --steps 1500 --seeds 1 2 3 4 5":
        "five trainings; the one-seed commands above it run",
    "python -m xl.probe memory.grad_segments=4 --mem-lens 32 --steps 750 --seeds 1 2 3 4 5":
        "five trainings; the one-seed commands above it run",
    "python -m xl.probe data.source.gap=400 memory=lmrmt --mem-lens 0 --steps 1500 --seeds 1 2 3 4 5":
        "five trainings; memory tokens' one-seed commands run",
    "python -m xl.probe data.source.gap=400 memory=rmt --mem-lens 0 --steps 1500 --seeds 1 2 3 4 5":
        "five trainings; memory tokens' one-seed commands run",
    "python -m xl.probe --mem-lens 0 32 --seeds 1 2 3 4 5":
        "ten trainings; the probe's default command runs",
    # research runs of docs/babilong.md's table against the recency shortcut (10 to 45 minutes each)
    "python train.py experiment=babilong_bytes data.tokenizer=word +data.tokenizer_kwargs.punctuation=true "
    "data.train_samples=stream trainer.limit_train_batches=100000 trainer.max_steps=2000 "
    "precision=32-true hydra.run.dir=runs/recipe/words":
        "a research training of 10 to 45 minutes; the settings' own command above it runs",
    "python train.py experiment=babilong_bytes data.tokenizer=word +data.tokenizer_kwargs.punctuation=true "
    "data.train_samples=stream data.train_questions=all trainer.limit_train_batches=100000 "
    "trainer.max_steps=2000 precision=32-true hydra.run.dir=runs/recipe/all":
        "a research training of 10 to 45 minutes; the settings' own command above it runs",
    "python train.py experiment=babilong_bytes data.tokenizer=word +data.tokenizer_kwargs.punctuation=true "
    "data.train_samples=stream data.train_questions=all memory=none data.tgt_len=128 "
    "trainer.limit_train_batches=100000 trainer.max_steps=2000 precision=32-true "
    "hydra.run.dir=runs/recipe/all-none-128":
        "a research training of 10 to 45 minutes; the settings' own command above it runs",
    "python train.py experiment=babilong_bytes data.tokenizer=word +data.tokenizer_kwargs.punctuation=true "
    "data.train_samples=stream data.train_questions=every trainer.limit_train_batches=100000 "
    "trainer.max_steps=3000 precision=32-true hydra.run.dir=runs/recipe/every":
        "a research training of 10 to 45 minutes; the settings' own command above it runs",
    "python train.py experiment=babilong_bytes data.tokenizer=word +data.tokenizer_kwargs.punctuation=true "
    "data.train_samples=stream data.train_questions=every model.pre_lnorm=true optim.lr=2e-3 "
    "optim.warmup_steps=500 trainer.limit_train_batches=100000 trainer.max_steps=6000 precision=32-true "
    "hydra.run.dir=runs/recipe/every-prenorm":
        "a research training of 10 to 45 minutes; the settings' own command above it runs",
    "python train.py experiment=babilong_facts seed=1 logger=csv hydra.run.dir=runs/recipe/facts-1":
        "a research training of 10 to 45 minutes; the settings' own command above it runs",
    "python train.py experiment=babilong_facts seed=2 logger=csv hydra.run.dir=runs/recipe/facts-2":
        "a research training of 10 to 45 minutes; the settings' own command above it runs",
    "python -m xl.babilong ckpt=runs/recipe/words tasks=[qa1] lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/all/checkpoints/step0001000.ckpt tasks=[qa1] lengths=[0] "
    "samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/all tasks=[qa1] lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/all-none-128/checkpoints/step0001000.ckpt tasks=[qa1] "
    "lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/every/checkpoints/step0001000.ckpt tasks=[qa1] lengths=[0] "
    "samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/every/checkpoints/step0002000.ckpt tasks=[qa1] lengths=[0] "
    "samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/every tasks=[qa1] lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/every-prenorm/checkpoints/step0001000.ckpt tasks=[qa1] "
    "lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/facts-1 tasks=[qa1] lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/facts-2/checkpoints/step0001600.ckpt tasks=[qa1] lengths=[0] "
    "samples=200 logger=none":
        "scores a research training that is skipped",
    "python train.py experiment=babilong_facts "
    "curriculum=[{length:0,train_most_questions:1,steps:400},{length:0,train_most_questions:2}] "
    "trainer.max_steps=2000 seed=1 logger=csv hydra.run.dir=runs/recipe/facts-up-to-4":
        "a research training of 10 to 45 minutes; the settings' own command above it runs",
    "python train.py experiment=babilong_facts "
    "curriculum=[{length:0,train_most_questions:1,steps:1000},{length:0,train_most_questions:2,steps:2000},"
    "{length:0,train_most_questions:3,steps:2000},{length:0}] trainer.max_steps=10000 "
    "trainer.limit_train_batches=1000 trainer.val_check_interval=1000 logger=csv hydra.run.dir=runs/recipe/facts-long":
        "a research training of 40 minutes; the settings' own command above it runs",
    "python -m xl.babilong ckpt=runs/recipe/facts-long tasks=[qa1] lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    **{f"python train.py experiment=babilong seed={n} logger=csv hydra.run.dir=runs/recipe/end-{n}":
       "a research training of 31 to 35 minutes; the settings' own command above it runs" for n in (1, 2, 3)},
    "python train.py experiment=babilong data.train_questions=every seed=1 logger=csv "
    "hydra.run.dir=runs/recipe/every-staged-1":
        "a research training of 31 minutes; the settings' own command above it runs",
    **{f"python train.py experiment=babilong data.train_questions=every {BIND_ONE_STAGE} seed={n} logger=csv "
       f"hydra.run.dir=runs/recipe/wide-{n}":
       "a research training of 42 minutes; the settings' own command above it runs" for n in (1, 2)},
    **{f"python train.py experiment=babilong model.init_std=0.07 data.train_questions=every {BIND_ONE_STAGE} "
       f"seed={n} logger=csv hydra.run.dir=runs/recipe/bind-{n}":
       "a research training of 35 minutes; the settings' own command above it runs" for n in (1, 2, 3)},
    "python train.py experiment=babilong data.tasks=[qa2] seed=1 logger=csv hydra.run.dir=runs/recipe/qa2-1":
        "a research training of 45 minutes; the settings' own command above it runs",
    "python -m xl.babilong ckpt=runs/recipe/qa2-1/checkpoints/last.ckpt tasks=[qa2] lengths=[0] samples=200 "
    "logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong ckpt=runs/recipe/end-1 tasks=[qa1] lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    "python -m xl.babilong.study none=runs/study/none-1-score,runs/study/none-2-score,runs/study/none-3-score "
    "cache=runs/study/cache-1-score,runs/study/cache-2-score,runs/study/cache-3-score "
    "compressive=runs/study/compressive-1-score,runs/study/compressive-2-score,runs/study/compressive-3-score "
    "tokens=runs/study/tokens-1-score,runs/study/tokens-2-score,runs/study/tokens-3-score "
    "retrieval=runs/study/knn-1-score,runs/study/knn-2-score,runs/study/knn-3-score "
    "retrieval+recency=runs/study/knnr-1-score,runs/study/knnr-2-score,runs/study/knnr-3-score "
    "2-layer-retrieval+recency=runs/study/knn2r-1-score,runs/study/knn2r-2-score,runs/study/knn2r-3-score "
    "2-layer-retrieval+age=runs/study/knn2a-1-score,runs/study/knn2a-2-score,runs/study/knn2a-3-score "
    "--out runs/study/table":
        "tables the scorings of 24 research trainings (about six hours of CPU); the block above runs it",
    "python -m xl.babilong.study none=runs/none-1-score,runs/none-2-score cache=runs/cache-1-score --out runs/table":
        "tables scorings that this docstring does not make; docs/babilong.md's study block runs the command",
    "python -m xl.babilong ckpt=runs/recipe/facts-up-to-4 tasks=[qa1] lengths=[0] samples=200 logger=none":
        "scores a research training that is skipped",
    # downloads and accounts
    "python train.py data=wikitext103": "downloads WikiText-103",
    "python train.py data=babilong data/background=pg19": "streams PG-19 from the Hugging Face hub",
    "python train.py data=wikitext103 model.cutoffs=[20000,40000,200000] model.div_val=4": "downloads WikiText-103",
    "python train.py experiment=enwik8_base": "downloads enwik8; a GPU-sized run",
    "python train.py experiment=enwik8_large trainer=ddp trainer.devices=8": "downloads enwik8; needs 8 GPUs",
    "python train.py experiment=text8_large trainer=ddp trainer.devices=8": "downloads text8; needs 8 GPUs",
    "python train.py experiment=wt103_base trainer=ddp trainer.devices=4 data.batch_size=15":
        "downloads WikiText-103; needs 4 GPUs",
    "python train.py experiment=wt103_large trainer=ddp trainer.num_nodes=2 trainer.devices=8 data.batch_size=8":
        "downloads WikiText-103; needs 2 nodes of 8 GPUs",
    "wandb sweep sweeps/mem_len.yaml && wandb agent ENTITY/PROJECT/SWEEP_ID": "needs a W&B account and the network",
    # installs
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu":
        "PyTorch's CPU wheel index is not reachable here; CI installs the same CPU build from local disk",
    # the published weights (docs/pretrained.md)
    "python -m xl.convert transfo-xl/transfo-xl-wt103 wt103": "downloads the published model from the Hugging Face hub",
    "python -m xl.evaluate +experiment=wt103_published ckpt=wt103": "needs the downloaded model and WikiText-103",
    "python -m venv /tmp/hfref": "creates the reference's virtual environment (an install step)",
    "/tmp/hfref/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors sacremoses":
        "installs transformers 4.57.6 from the network into the reference's environment",
    "/tmp/hfref/bin/python scripts/make_transfo_xl_fixture.py tests/fixtures/transfo_xl":
        "needs the reference's environment (transformers 4.57.6); rewrites the committed fixture",
    # the port of the 2019 code lives in its own virtual environment
    "python -m venv --system-site-packages /tmp/port": "creates the port's virtual environment (an install step)",
    "/tmp/port/bin/pip install --no-deps transformers==4.30.2 safetensors regex tokenizers==0.13.3":
        "installs an old transformers from the network into the port's environment",
    "/tmp/port/bin/python -m xl.bench.port --rounds 10": "needs the port's environment (transformers 4.30.2)",
    "python -m xl.bench.port": "needs transformers 4.30.2 (its own environment)",
    "python -m xl.bench.port --rounds 10": "needs transformers 4.30.2 (its own environment)",
    "python -m xl.evaluate": "named in prose by xl/bench/evalspeed.py, not an example (it needs ckpt=)",
    "python -m xl.convert": "named in prose by docstrings, not an example (it needs SRC and OUT)",
    # sharing a model (docs/sharing.md)
    "python -m xl.export ckpt=RUN out=shared push=org/name": "pushes to the Hugging Face hub: a network and an account",
}

# Appended to a command of each entry point: a tiny model, two steps, a few batches, one thread.
SCALE = {
    "train.py": ["model=tiny", "data.tgt_len=8", "data.batch_size=2", "trainer.max_steps=2",
                 "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
                 "trainer.num_sanity_val_steps=0", "callbacks.progress_bar.refresh_rate=0",
                 "+trainer.enable_model_summary=false"],
    "xl.evaluate": ["data.batch_size=2", "trainer.limit_val_batches=10", "trainer.limit_test_batches=10"],
    "xl.generate": ["max_new_tokens=4"],
    "xl.babilong": ["samples=2", "batch_size=2", "max_new_tokens=3", "seg_len=512"],
    "xl.babilong.study": [],
    "xl.probe": ["--steps", "2", "--distances", "4", "16"],
    "xl.footprint": [],
    "xl.convert": [],
    "xl.export": [],
    "xl.config.reference": [],
    "xl.bench": ["--steps", "1", "--warmup", "0", "--repeats", "1", "--threads", "1", "--batch", "2",
                 "--tgt-len", "16"],
    "xl.bench.evalspeed": ["--attn-lens", "32", "--tgt-len", "16", "--batch", "2", "--positions", "2",
                           "--repeats", "1", "--threads", "1"],
    "xl.bench.documents": ["--steps", "1", "--rounds", "1", "--threads", "1", "--batch", "2", "--tgt-len", "16",
                           "--doc-len", "8"],
    "xl.bench.compressive": ["--mem-len", "16", "--batch", "2", "--tgt-len", "16", "--steps", "1", "--decode", "2",
                             "--rounds", "1", "--threads", "1"],
    "xl.bench.babilong": ["--length", "150", "--batch", "2", "--rounds", "1", "--threads", "1", "--peak-lengths"],
    "xl.bench.precision": ["--steps", "1", "--rounds", "1", "--threads", "1", "--batch", "2", "--tgt-len", "16"],
    "xl.bench.knn": ["--batch", "2", "--tgt-len", "8", "--size", "256", "--rounds", "1", "--cross-batch", "2",
                            "--cross-queries", "4", "--sizes", "64", "128"],
    "xl.bench.tokens": ["--mem-len", "16", "--num-tokens", "2", "--batch", "2", "--tgt-len", "16", "--steps", "1",
                        "--rounds", "1", "--threads", "1"],
}
SCALE_FRONT = {  # put before the command's own arguments: its parser takes Hydra overrides only before its options
    "xl.probe": ["data.source.episodes=60", "data.source.eval_episodes=20"],
}
SCALE_IF = {  # appended when the command selects what the key names
    "hydra/sweeper=optuna_mem": ["hydra.sweeper.n_trials=2"],
    "data=babilong": ["data.train_samples=24", "data.eval_samples=4"],
    "experiment=babilong_bytes": ["data.train_samples=24", "data.eval_samples=4", "model.n_layer=2", "model.d_model=32",
                            "model.n_head=2", "model.d_head=16", "model.d_inner=64", "memory.mem_len=16"],
    "experiment=babilong_facts": ["data.eval_samples=4", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
                                  "model.d_head=16", "model.d_inner=64", "memory.mem_len=16",
                                  "trainer.limit_train_batches=2"],
    "experiment=babilong": ["data.eval_samples=4", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
                             "model.d_head=16", "model.d_inner=64", "memory.mem_len=16",
                             "trainer.limit_train_batches=2"],
    "experiment=babilong_long": ["data.eval_samples=4", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
                                 "model.d_head=16", "model.d_inner=64", "memory.mem_len=16",
                                 "trainer.limit_train_batches=2"],
    "experiment=babilong_curriculum": ["data.eval_samples=4", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
                                       "model.d_head=16", "model.d_inner=64", "memory.mem_len=16",
                                       "trainer.limit_train_batches=2"],
    "--score": ["--score", "data.source.eval_episodes=4"],  # xl.probe's scoring episodes (--score extends)
    # the study's scorings read the same code at 1K as at 16K: 0 and 1K are enough here (the last override wins)
    "lengths=[0,1k,4k,16k]": ["lengths=[0,1k]"],
    # the study's two retrieval layers in the scaled-down model of two layers
    "memory.knn_layers=[1,2]": ["memory.knn_layers=[0,1]"],
}
SCALE_UNLESS_SET = {  # appended unless the command sets the key itself
    "train.py": ["logger=none"],
    "xl.evaluate": ["logger=none"],
    "xl.babilong": ["logger=none"],
}

# The files the docs' commands name, made in the folder the commands run in.
WORKSPACE_FILES = ("train.txt", "valid.txt", "test.txt", "a.txt", "b.txt", "v.txt", "t.txt", "notes.txt",
                   "code.py", "prompt.txt")
# Placeholder words of the docs (RUN, CKPT, SRC, OUT): see substitute().
FIXTURE_MODEL = FIXTURES / "transfo_xl"
RUN_COMMAND = "python train.py data=text data.train=train.txt data.val=valid.txt data.test=test.txt"


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str  # the logical line as written (continuations joined)

    @property
    def key(self) -> str:
        """The command as the shell splits it, without comments or leading VAR=value assignments."""
        words = shlex.split(self.text, comments=True)
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
            words = words[1:]
        return " ".join(words)


def logical_lines(lines: list[str], first: int, where: str) -> list[Command]:
    commands, pending, start = [], "", first
    for number, line in enumerate(lines, first):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text and not text.startswith("#"):
            commands.append(Command(f"{where}:{start}", text))
    return commands


def markdown_blocks() -> list[tuple[str, list[Command]]]:
    blocks = []
    for path in MARKDOWN:
        lines = path.read_text(encoding="utf-8").splitlines()
        name = path.relative_to(ROOT).as_posix()
        inside, body, opened = False, [], 0
        for number, line in enumerate(lines, 1):
            fence = line.strip()
            if not inside and fence.startswith("```") and fence[3:].strip() in ("bash", "sh", "shell", "console"):
                inside, body, opened = True, [], number
            elif inside and fence.startswith("```"):
                inside = False
                blocks.append((f"{name}:{opened}", logical_lines(body, opened + 1, name)))
            elif inside:
                body.append(line)
    return blocks


def docstring_commands() -> list[tuple[str, list[Command]]]:
    """``python …`` examples in the module docstrings of train.py and xl/: inline spans and indented lines.

    ``[key=value ...]``-style optional parts of a synopsis are left out; ``PATH`` names a run (``RUN``)."""
    blocks = []
    for path in [ROOT / "train.py", *sorted((ROOT / "xl").rglob("*.py"))]:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        name = path.relative_to(ROOT).as_posix()
        found = re.findall(r"``((?:python|OMP_NUM_THREADS=\S+ python) [^`]+)``", doc)
        found += [line.strip() for line in doc.splitlines()
                  if line.startswith("    ") and re.match(r"\s+(\S*/)?(python|pip)\s", line)]
        for text in found:
            text = re.sub(r"\s\[[^\]'\"]*\]", "", text)
            text = re.sub(r"\bPATH\b", "RUN", text)
            blocks.append((f"{name} docstring", [Command(f"{name} docstring", text)]))
    return blocks


def all_blocks() -> list[tuple[str, list[Command]]]:
    """The Markdown blocks, then each docstring command that no block or earlier docstring shows."""
    blocks = markdown_blocks()
    seen = {c.key for _, block in blocks for c in block}
    for where, block in docstring_commands():
        if block[0].key not in seen:
            seen.add(block[0].key)
            blocks.append((where, block))
    return blocks


ALL_BLOCKS = all_blocks()
# Blocks of minutes, or of the longest seconds, run with -m slow: what they run is also tested in the default suite
# (the studies' blocks: their experiments in test_experiments.py, their scorer and table in test_babilong_score.py,
# export and convert in theirs; the probes of knn.md and memory-tokens.md, with those memories, in test_probe.py).
SLOW_BLOCKS = {"python train.py experiment=babilong seed=1 hydra.run.dir=runs/study/bind-1",
               "python train.py experiment=babilong data.tasks=[qa1,qa2] trainer.max_steps=16000 seed=1 "
               "hydra.run.dir=runs/study2/bind-1",
               "python -m xl.probe data.source.gap=600 data.source.eval_episodes=400 --mem-lens 32 --distances 16 48 "
               "64 128 256 512",
               "python -m xl.probe data.source.gap=400 memory=tokens --mem-lens 32 --steps 1500"}
BLOCK_PARAMS = [pytest.param(where, commands, id=where,
                             marks=[pytest.mark.slow] if commands and commands[0].key in SLOW_BLOCKS else [])
                for where, commands in ALL_BLOCKS]


# ---------------------------------------------------------------------------------------------------------- shell

PRELUDE = r"""
__record() { local n; n=$(( $(<"$DOCS_REC/count") + 1 )); echo "$n" > "$DOCS_REC/count"
             printf '%s\0' "$@" > "$DOCS_REC/$n"; }
python() { __record python "$@"; }
pip() { __record pip "$@"; }
command_not_found_handle() { __record "$@"; return 0; }
"""


def shell_argv(text: str, cwd: Path, rec: Path) -> list[list[str]]:
    """The argument vectors bash hands to each program of a command line, programs not started."""
    rec.mkdir(parents=True, exist_ok=True)
    for old in rec.iterdir():
        old.unlink()
    (rec / "count").write_text("0")
    env = {"PATH": "/nonexistent-docs-test", "DOCS_REC": str(rec), "HOME": str(cwd)}
    result = subprocess.run([BASH, "-c", PRELUDE + text], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0 and not result.stderr, f"bash rejects {text!r}: {result.stderr.strip()}"
    count = int((rec / "count").read_text())
    return [(rec / str(i)).read_bytes().decode().split("\0")[:-1] for i in range(1, count + 1)]


def program_of(text: str) -> str:
    words = [w for w in shlex.split(text, comments=True) if not re.match(r"^[A-Z_]+=", w)]
    return words[0] if words else ""


# ---------------------------------------------------------------------------------------------------------- installs

def extras() -> set[str]:
    """The extras pyproject.toml defines (the keys of [project.optional-dependencies])."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*=", section, re.M))


def check_install(argv: list[str], text: str) -> None:
    """pip as the docs use it: the CI's torch pin, the project itself, or one of its extras."""
    ci_pins = {w for w in shlex.split(CI_COMMAND) if "==" in w}
    args = argv[1:]
    assert args[:1] == ["install"], f"{text!r}: pip {' '.join(args)} is not an install the docs may show"
    for word in args[1:]:
        if word == "-e":
            continue
        target = re.fullmatch(r"\.(?:\[(?P<extra>[\w,-]+)\])?", word)
        if target:
            unknown = set((target["extra"] or "").split(",")) - extras() - {""}
            assert not unknown, f"{text!r}: pyproject.toml has no extra {sorted(unknown)}"
        else:
            assert word in ci_pins, f"{text!r}: {word} differs from the CI's install ({CI_COMMAND})"


# ---------------------------------------------------------------------------------------------------------- running

def entry_of(args: list[str]) -> tuple[str, list[str]]:
    """(entry point name, its arguments) of a python command: 'train.py' or a module name."""
    if args[:1] == ["-m"]:
        return args[1], args[2:]
    return args[0], args[1:]


def scaled(name: str, args: list[str], workspace: Path, n: int) -> list[str]:
    extra = list(SCALE[name])
    for default in SCALE_UNLESS_SET.get(name, []):
        if not any(a.startswith(default.split("=")[0] + "=") for a in args):
            extra.append(default)
    for selector, more in SCALE_IF.items():
        if selector in args:
            extra += more
    if name == "train.py" and any(re.match(r"(ckpt|ckpt_path|init_from)=", a) for a in args):
        extra.append("trainer.max_steps=4")  # a resume has steps left to do (max_steps counts from the start)
    if name in HYDRA_CONFIGS:
        if not any(a.startswith("hydra.run.dir=") for a in args):
            extra.append(f"hydra.run.dir={workspace / 'runs' / str(n)}")
        if not any(a.startswith("hydra.sweep.dir=") for a in args):
            extra.append(f"hydra.sweep.dir={workspace / 'sweeps' / str(n)}")
    return extra


def logging_state() -> dict[str, tuple]:
    loggers = {"": logging.getLogger()} | {name: logger for name, logger in logging.Logger.manager.loggerDict.items()
                                          if isinstance(logger, logging.Logger)}
    return {name: (logger, logger.level, logger.disabled, logger.propagate, logger.handlers[:])
            for name, logger in loggers.items()}


def restore_logging(saved: dict[str, tuple]) -> None:
    """Loggers as they were before a command configured logging (Hydra's job logging sets levels and handlers)."""
    kept = {id(h) for *_, handlers in saved.values() for h in handlers}
    for logger, level, disabled, propagate, handlers in saved.values():
        for handler in logger.handlers:
            if id(handler) not in kept:
                handler.close()
        logger.setLevel(level)
        logger.disabled, logger.propagate, logger.handlers[:] = disabled, propagate, handlers


def run_python(args: list[str], workspace: Path, n: int) -> None:
    """A ``python`` command, in this process, as the interpreter would run it; fails on a non-zero exit.

    What the command changes in the process (logging, warning filters, Hydra's globals, torch's threads, sys.argv)
    is put back afterwards, so later tests see the process as it was."""
    name, rest = entry_of(args)
    assert name in SCALE, f"python {' '.join(args)}: no scale-down for {name}; add it to SCALE or SKIP"
    argv = [*SCALE_FRONT.get(name, []), *rest, *scaled(name, rest, workspace, n)]
    saved_logging, saved_argv = logging_state(), sys.argv[:]
    try:
        with warnings.catch_warnings():
            if name.endswith(".py"):
                sys.argv = [str(ROOT / name), *argv]
                runpy.run_path(str(ROOT / name), run_name="__main__")
            else:
                sys.argv = [name, *argv]
                runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        assert stop.code in (0, None), f"python {' '.join(args)} exited with {stop.code!r}"
    finally:
        sys.argv = saved_argv
        HydraConfig.instance().cfg = None
        GlobalHydra.instance().clear()
        restore_logging(saved_logging)
        torch.set_num_threads(1)


def compose_only(args: list[str]) -> None:
    """A command that cannot run here still parses: Hydra composes its config (sweeps: their first value)."""
    name, rest = entry_of(args)
    if name not in HYDRA_CONFIGS:
        return
    overrides = []
    for override in OverridesParser.create().parse_overrides([a for a in rest if a != "-m"]):
        if override.is_sweep_override():
            first = next(iter(override.sweep_string_iterator()))
            overrides.append(f"{override.get_key_element()}={first}")
        else:
            overrides.append(override.input_line)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        compose(HYDRA_CONFIGS[name], overrides=overrides, return_hydra_config=True)


def write_workspace(folder: Path) -> None:
    import json
    import textwrap

    text = "".join(inspect.getsource(m) for m in (textwrap, json.decoder, json.encoder))
    n = len(text)
    parts = {"train.txt": text[: int(0.8 * n)], "valid.txt": text[int(0.8 * n): int(0.9 * n)],
             "test.txt": text[int(0.9 * n):]}
    parts.update({"v.txt": parts["valid.txt"], "t.txt": parts["test.txt"], "notes.txt": parts["train.txt"],
                  "code.py": inspect.getsource(textwrap), "prompt.txt": "def parse(self, "})
    half = len(parts["train.txt"]) // 2
    parts["a.txt"] = parts["train.txt"][:half].replace("\n\n\n", "\n<|endoftext|>\n")
    parts["b.txt"] = parts["train.txt"][half:].replace("\n\n\n", "\n<|endoftext|>\n")
    for file in WORKSPACE_FILES:
        (folder / file).write_text(parts[file], encoding="utf-8")


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xl-cache")


@pytest.fixture
def workspace(tmp_path, token_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XL_CACHE_DIR", str(token_cache))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_workspace(tmp_path)
    return tmp_path


def substitute(text: str, workspace: Path, counter: list[int]) -> str:
    """The placeholders of a command replaced by real paths: RUN and CKPT by a tiny training's folder and last.ckpt,
    SRC by a published-layout Transformer-XL folder (the test fixture), OUT by a folder that does not exist yet."""
    words = set(re.findall(r"\b(RUN|CKPT|SRC|OUT)\b", text))
    if not words:
        return text
    counter[0] += 1
    paths = {"SRC": FIXTURE_MODEL, "OUT": workspace / "converted" / str(counter[0])}
    if words & {"RUN", "CKPT"}:
        run = workspace / "placeholder-runs" / str(counter[0])
        for argv in shell_argv(RUN_COMMAND + f" hydra.run.dir={run}", workspace, workspace / ".rec"):
            run_python(argv[1:], workspace, counter[0])
        paths.update(RUN=run, CKPT=run / "checkpoints" / "last.ckpt")
        assert paths["CKPT"].is_file(), f"the placeholder run wrote no {paths['CKPT']}"
    return re.sub(r"\b(RUN|CKPT|SRC|OUT)\b", lambda m: str(paths[m.group()]), text)


def shrunk_step(text: str, workspace: Path) -> str:
    """A step checkpoint the command names (``runs/x/checkpoints/step0001000.ckpt``) replaced by the step checkpoint
    that the shrunk training of that folder wrote (its own step count)."""
    def written(match: re.Match) -> str:
        found = sorted((workspace / match.group(1)).glob("step*.ckpt"))
        assert len(found) == 1, f"{match.group(1)} holds {len(found)} step checkpoints, not one"
        return str(found[0].relative_to(workspace))

    return re.sub(r"([^\s=]*checkpoints/)step\d{7}\.ckpt", written, text)


def run_block(commands: list[Command], workspace: Path) -> None:
    counter = [0]
    for command in commands:
        key = command.key
        if key in SKIP:
            if "/" in program_of(command.text):  # a program given by path: check the syntax only
                result = subprocess.run([BASH, "-n", "-c", command.text], capture_output=True, text=True)
                assert result.returncode == 0, f"{command.where}: bash rejects {command.text!r}: {result.stderr}"
                continue
            for argv in shell_argv(command.text, workspace, workspace / ".rec"):
                if argv[0] == "python":
                    compose_only(argv[1:])
            continue
        text = shrunk_step(substitute(command.text, workspace, counter), workspace)
        for argv in shell_argv(text, workspace, workspace / ".rec"):
            counter[0] += 1
            if argv[0] == "pip":
                check_install(argv, command.text)
            elif argv[0] == "python" and argv[1:3] == ["-m", "pytest"]:
                assert command.text == CI_COMMAND, (f"{command.where}: {command.text!r} is not .ci/run's test command; "
                                                    "a test suite is not run from here: add it to SKIP with the reason")
            elif argv[0] == "python":
                run_python(argv[1:], workspace, counter[0])
            else:
                pytest.fail(f"{command.where}: {command.text!r} runs {argv[0]}, which this test cannot run; "
                            "make it runnable or add it to SKIP with the reason")


@pytest.mark.parametrize("where, commands", BLOCK_PARAMS)
def test_documented_commands_run_as_written(where, commands, workspace):
    run_block(commands, workspace)


def test_readme_is_one_screen_with_the_two_commands_first():
    """The README stays short, and its first screen holds the main job's command and the CI's test command."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; move detail to docs/"
    pins = [w for w in shlex.split(CI_COMMAND) if "==" in w]
    first_screen = lines[:40]
    assert f"pip install {pins[0]} && pip install -e . && python train.py" in first_screen
    assert CI_COMMAND in first_screen, "the README's test command is not .ci/run's, or not on its first screen"


def prose_commands() -> list[Command]:
    """``python …`` commands named in the Markdown's prose (inline code, outside fenced blocks), where a fenced block
    does not show them: the blocks run, these are only parsed. ``…`` and ``[--option …]`` stand for what the reader
    fills in and are left out."""
    shown = {c.key for _, block in markdown_blocks() for c in block}
    commands = []
    for path in MARKDOWN:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for span in re.findall(r"(?<!`)`((?:[A-Z_]+=\S+ )*python [^`]+)`(?!`)", text):
            span = re.sub(r"\s\[[^\]]*\]|\s\S*(…|\.\.\.)\S*", "", " ".join(span.split()))
            command = Command(path.relative_to(ROOT).as_posix(), span)
            if command.key not in shown:
                shown.add(command.key)
                commands.append(command)
    return commands


class Parsed(Exception):
    """Raised by argparse's parse_args once it has accepted a command line: nothing after it runs."""


def parse_only(args: list[str], monkeypatch) -> None:
    """A command's arguments as its entry point reads them, without running it: Hydra composes the overrides, an
    argparse command line is parsed (an unknown option exits 2 with argparse's message)."""
    name, rest = entry_of(args)
    if name in HYDRA_CONFIGS:
        compose_only(args)
        return
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, *a, **kw):
        original(self, *a, **kw)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [name, *rest])
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except Parsed:
        return
    except SystemExit as stop:
        if stop.code == 0 and {"-h", "--help"} & set(rest):
            return  # the help, printed by the parser itself
        pytest.fail(f"python {' '.join(args)}: its parser refuses it (exit {stop.code})")
    pytest.fail(f"python {' '.join(args)} parsed no arguments")


def test_commands_named_in_the_prose_parse(monkeypatch):
    """An inline command (``python -m xl.footprint --cmem-len 64`` in a sentence) names options its entry point has
    and overrides its config composes, as the fenced blocks' commands do when they run."""
    checked = []
    for command in prose_commands():
        args = shlex.split(command.text)[1:]
        name, rest = entry_of(args)
        if (not rest or name == "pytest" or name.startswith("tests.") or name not in SCALE
                or any(a.startswith("hydra.searchpath=") for a in rest)):
            continue  # an entry point named, not a command; the suite; tests run as scripts; the reader's own configs
        parse_only(args, monkeypatch)
        checked.append(command.text)
    assert any("xl.footprint" in c for c in checked), checked


def test_every_skipped_command_is_still_shown():
    shown = {c.key for _, block in markdown_blocks() + docstring_commands() for c in block}
    assert not set(SKIP) - shown, f"SKIP lists commands no document shows: {sorted(set(SKIP) - shown)}"


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def test_every_link_of_the_docs_leads_somewhere():
    """Relative links of README.md and docs/*.md name an existing file and, after #, one of its headings."""
    broken = []
    for path in MARKDOWN:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("name", sorted(n for n in SCALE if n not in HYDRA_CONFIGS and n != "xl.export"))
def test_a_commands_help_is_plain_text(name, monkeypatch, capsys):
    """``--help`` of the argparse commands: their descriptions come from docstrings, without reST's markup."""
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith("usage:"), out
    assert not re.search(r"``|:(mod|func|class|meth):", out), out


def test_the_console_scripts_return_nothing_to_print():
    """pip's ``xl-*`` scripts run ``sys.exit(main())``: a function that returns its results (xl-bench's dict, the
    training's validation loss) would have them printed after the output and the command exit with status 1."""
    import importlib

    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = re.findall(r'^([\w-]+)\s*=\s*"([\w.]+):(\w+)"', section, re.M)
    assert len(scripts) > 5, section
    for name, module, function in scripts:
        target = f"{module}:{function}"
        returns = inspect.signature(getattr(importlib.import_module(module), function)).return_annotation
        assert returns in (None, "None"), f"{name} = {target} returns {returns}"


def test_every_slow_block_is_still_shown():
    firsts = {commands[0].key for _, commands in ALL_BLOCKS if commands}
    assert SLOW_BLOCKS <= firsts, f"SLOW_BLOCKS names blocks no document begins with: {sorted(SLOW_BLOCKS - firsts)}"
