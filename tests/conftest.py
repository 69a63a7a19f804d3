"""Shared fixtures: the real Hydra config, composed and shrunk to run in seconds."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import xl.config.schema  # noqa: F401 (registers the schemas that conf/ names, as the entry points do)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# Whatever the shell says: W&B writes offline runs, datasets reads its cache only. Tests of the hub's reach set or
# clear HF_HUB_OFFLINE themselves (tests/helpers/hub_env.py).
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# Tiny models run fastest on one thread, and a busy 2-core machine makes 2 threads crawl (spin-waiting).
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; python -m pytest tests/gpu -m gpu runs these")


def compose_config(*overrides: str) -> DictConfig:
    """The training config as the entry points compose it (the memory node typed by its variant)."""
    from xl.config.compose import type_memory

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    type_memory(cfg)
    return cfg


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A small real-text corpus: a few standard-library modules, split into three files."""
    import inspect
    import json
    import textwrap

    text = "".join(inspect.getsource(m) for m in (textwrap, json.decoder, json.encoder))
    folder = tmp_path_factory.mktemp("corpus")
    n = len(text)
    parts = {"train": text[: int(0.8 * n)], "val": text[int(0.8 * n): int(0.9 * n)], "test": text[int(0.9 * n):]}
    paths = {}
    for split, part in parts.items():
        paths[split] = folder / f"{split}.txt"
        paths[split].write_text(part, encoding="utf-8")
    return paths


def tiny_overrides(tmp_path: Path, corpus: dict[str, Path]) -> list[str]:
    return [
        "model=tiny", "data=text", "logger=none",
        f"data.train={corpus['train']}", f"data.val={corpus['val']}", f"data.test={corpus['test']}",
        f"data.cache_dir={tmp_path / 'cache'}", f"paths.output_dir={tmp_path / 'run'}",
        "data.batch_size=4", "data.tgt_len=16", "memory.mem_len=16",
        "trainer.max_steps=20", "trainer.val_check_interval=10", "trainer.limit_val_batches=4",
        "trainer.limit_test_batches=4", "trainer.log_every_n_steps=1", "trainer.num_sanity_val_steps=1",
        "+trainer.enable_model_summary=false", "callbacks.progress_bar.refresh_rate=0",
    ]


@pytest.fixture
def tiny_cfg(tmp_path, corpus) -> DictConfig:
    return compose_config(*tiny_overrides(tmp_path, corpus))


def run_hydra_main(main, argv: list[str], monkeypatch) -> None:
    """A @hydra.main entry point as the command line runs it, in this process; Hydra's globals restored after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr(sys, "argv", argv)
    try:
        main()
    finally:
        HydraConfig.instance().cfg = None
        GlobalHydra.instance().clear()
        root.handlers[:], root.level = handlers, level


@pytest.fixture(scope="session", autouse=True)
def a_cpu_without_native_bf16(tmp_path_factory):
    """precision=auto picks bf16-mixed on a CPU that multiplies bfloat16 in hardware (xl.device.cpu): in this
    process the suite sees a CPU whose flags say it does not, so that what the tests compute does not depend on the
    machine's CPU (tests of the choice give their own flags; subprocesses see the real CPU)."""
    import xl.device.cpu

    cpuinfo = tmp_path_factory.mktemp("cpu") / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xl.device.cpu, "CPUINFO", str(cpuinfo))
        yield


@pytest.fixture(autouse=True)
def no_wandb_run_left_open(request):
    """W&B keeps one current run per process, and a later WandbLogger would log into it: a test that leaves one open
    would make the next test's result depend on the order. Each test closes what it opened; this checks it."""
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()
        pytest.fail(f"{request.node.nodeid} left a W&B run open; finish it (or use logger=none)", pytrace=False)
