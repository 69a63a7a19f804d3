"""How a run's estimated footprint (:class:`xl.footprint.RunFootprint`) compares with the memory a device has: the
verdict, and the words and settings that name each part of the footprint (used by :func:`xl.rules.check_fits` and by
``python -m xl.footprint``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xl.footprint import RunFootprint

WARN_FRACTION = 0.8  # of the device's free memory: above it a run is warned about, above all of it refused
GiB = 2**30
# The settings that shrink each part of a run's footprint (xl.footprint.RunFootprint), and the parts' names.
SETTINGS = {"train_memory": "memory.mem_len or data.batch_size",
            "eval_memory": "memory.eval_mem_len or data.eval_batch_size",
            "parameters": "the model (model.n_layer, model.d_model, model.d_inner)",
            "activations": "data.tgt_len, data.batch_size, memory.mem_len or memory.grad_segments"}
NAMES = {"train_memory": "training memory", "eval_memory": "evaluation memory and its keys/values",
         "parameters": "weights, gradients and AdamW state", "activations": "one training step's activations"}


def verdict(footprint: RunFootprint, available: int, processes: int = 1) -> str:
    """Whether the run fits: ``fits``, ``close`` (above WARN_FRACTION of the available memory) or ``too big``."""
    need = footprint.total * processes
    return "too big" if need > available else "close" if need > WARN_FRACTION * available else "fits"
