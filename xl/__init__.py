"""xl: Transformer-XL's segment-level recurrence and its memories, on PyTorch Lightning and Hydra.

The library, in the order its packages import each other (docs/layout.md): :mod:`xl.settings` (how a setting is
declared), :mod:`xl.model` (the network, and the interface of a memory), :mod:`xl.memory` (the memories),
:mod:`xl.data` (corpora, tokenizers, the ordered loader, the metrics), :mod:`xl.device` (device sizing),
:mod:`xl.config` (schemas and rules), :mod:`xl.training` (the LightningModule and what a run needs), :mod:`xl.hub`
(sharing models). The applications are the modules and packages beside them (``train``,
``evaluate``, ``generate``, ``probe``, ``footprint``, ``export``, ``convert``, ``babilong``) and the benchmarks
(``bench``); the library never imports them.

The names a user reaches for are here, imported when first used, so ``import xl`` stays instant::

    from xl import TransformerXL, XLConfig, TrainedRun
    model = TransformerXL(XLConfig(vocab_size=256, n_layer=2))
    run = TrainedRun.open("outputs/2026-01-01/12-00-00")  # a run folder: its model and tokenizer
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"

# name -> the module that defines it
PUBLIC = {
    "TransformerXL": "xl.model.transformer",
    "XLConfig": "xl.model.config",
    "XLLitModule": "xl.training.loop.module",
    "SegmentDataModule": "xl.data.datamodule",
    "Checkpoint": "xl.training.checkpoints.checkpoint",
    "TrainedRun": "xl.training.runs",
    "PretrainedXL": "xl.hub",
    "Memory": "xl.model.memory",
    "MemoryConfig": "xl.model.memory_settings",
}
__all__ = ["Checkpoint", "Memory", "MemoryConfig", "PretrainedXL", "SegmentDataModule", "TrainedRun", "TransformerXL",
           "XLConfig", "XLLitModule", "__version__"]

if TYPE_CHECKING:  # for type checkers and editors; at run time each name is imported on first use
    from xl.data.datamodule import SegmentDataModule
    from xl.hub import PretrainedXL
    from xl.model.config import XLConfig
    from xl.model.memory import Memory
    from xl.model.memory_settings import MemoryConfig
    from xl.model.transformer import TransformerXL
    from xl.training.checkpoints.checkpoint import Checkpoint
    from xl.training.loop.module import XLLitModule
    from xl.training.runs import TrainedRun


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'xl' has no attribute {name!r}")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
