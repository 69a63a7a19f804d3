"""Truncated BPTT over k segments (memory.grad_segments; Bulatov et al., 2022)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from xl.lit import XLLitModule

REFERENCE = Path(__file__).parent / "data" / "tbptt_k1_reference.json"
TINY = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, mem_len=8)


def stream_segments(rows: int, seg_len: int, count: int, vocab: int, seed: int = 0) -> list[tuple]:
    """``count`` consecutive segments (inputs, next-token targets) of ``rows`` random token streams."""
    tokens = torch.randint(0, vocab, (rows, seg_len * count + 1), generator=torch.Generator().manual_seed(seed))
    return [(tokens[:, i * seg_len:(i + 1) * seg_len], tokens[:, i * seg_len + 1:(i + 1) * seg_len + 1])
            for i in range(count)]


class LossLog(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def k1_run(**module_kwargs: Any) -> tuple[list[float], str]:
    """A short fit (dropout, clipping, warm-up, an epoch boundary): its per-segment losses and a digest of the
    final weights."""
    L.seed_everything(0, verbose=False)
    module = XLLitModule(model={**TINY, "dropout": 0.1},
                         optim=dict(lr=3e-3, warmup_steps=2, min_lr_ratio=0.1), **module_kwargs)
    log = LossLog()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, gradient_clip_val=0.25, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, deterministic=True, callbacks=[log])
    trainer.fit(module, DataLoader(stream_segments(4, 8, 5, TINY["vocab_size"]), batch_size=None))
    digest = hashlib.sha256()
    for name, value in module.state_dict().items():
        digest.update(name.encode())
        digest.update(value.detach().contiguous().numpy().tobytes())
    return log.losses, digest.hexdigest()


def write_reference() -> None:
    """``python -m tests.test_tbptt``: record the k = 1 run (one thread, as the tests run)."""
    torch.set_num_threads(1)
    losses, digest = k1_run()
    REFERENCE.write_text(json.dumps({"torch": torch.__version__, "losses": [x.hex() for x in losses],
                                     "weights_sha256": digest}, indent=1) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--write-reference"]:
    write_reference()
