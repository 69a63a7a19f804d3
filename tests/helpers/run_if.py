"""``run_if``: skip a test unless the machine has what it needs (a CUDA GPU, several of them, bf16)."""

from __future__ import annotations

import pytest
import torch


def run_if(cuda: bool = False, min_gpus: int = 0, bf16: bool = False) -> pytest.MarkDecorator:
    """A skip mark naming every missing requirement; a test that needs a GPU is also marked ``gpu``, so that
    ``python -m pytest tests/gpu -m gpu`` selects exactly the GPU tests."""
    missing = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (cuda or min_gpus or bf16) and not gpus:
        missing.append("a CUDA GPU")
    elif gpus < min_gpus:
        missing.append(f"{min_gpus} CUDA GPUs (found {gpus})")
    if bf16 and gpus and not torch.cuda.is_bf16_supported():
        missing.append("bf16 on the GPU")
    return pytest.mark.skipif(bool(missing), reason=f"needs {' and '.join(missing)}")


def gpu_param(value: object, **needs: bool | int) -> object:
    """``value`` as a parameter that runs only where :func:`run_if` allows, marked ``gpu``."""
    return pytest.param(value, marks=[run_if(cuda=True, **needs), pytest.mark.gpu])
