"""What the machine allows a config: ``precision=auto`` resolved for the device and CPU, precisions and device counts
it cannot honour, and whether a run's memory estimate fits the device (each refusal one sentence naming the setting
to change; :mod:`xl.config.rules` holds the rules of the config itself)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from omegaconf import DictConfig, open_dict

from xl.config.bounds import is_int
from xl.config.rules import ConfigError
from xl.training import cpu
from xl.training.headroom import NAMES, SETTINGS, GiB, verdict

if TYPE_CHECKING:
    from xl.training.footprint import RunFootprint

log = logging.getLogger(__name__)


def uses_cuda(cfg: DictConfig) -> bool:
    import torch

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def auto_precision(on_cpu: bool, flags: frozenset[str] | set[str]) -> tuple[str, str]:
    """What ``precision=auto`` trains in, and why: on a GPU, bf16 autocast where it has bf16 (Ampere on), else fp16 with
    loss scaling; on a CPU whose ``flags`` (:func:`xl.training.cpu.cpu_flags`) say it multiplies bfloat16 in hardware,
    bf16 autocast (faster there, the same held-out quality: docs/gpu.md), else float32."""
    import torch

    if not on_cpu:
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "the GPU computes bfloat16"
        return "16-mixed", "the GPU has no bfloat16: float16 with loss scaling"
    native = cpu.native_bf16(flags)
    if native:
        return "bf16-mixed", f"the CPU computes bfloat16 natively: {', '.join(native)}"
    return "32-true", f"the CPU has no native bfloat16 (no {' or '.join(cpu.BF16_FLAGS)} flag), so float32 is faster"


def check_device(cfg: DictConfig) -> bool:
    """Resolve ``precision=auto``; refuse precisions and device counts this machine cannot honour.

    Returns whether the run uses CUDA GPUs.
    """
    import torch

    t = cfg.trainer
    accelerator = str(t.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator} but no CUDA GPU is visible; use trainer=cpu")
    on_cpu = not uses_cuda(cfg)
    if str(t.get("precision")) == "auto":
        choice, reason = auto_precision(on_cpu, cpu.cpu_flags())
        with open_dict(cfg):
            t.precision = choice
        log.info("precision=auto: %s (%s)", choice, reason)
    precision = str(t.get("precision", "32-true"))
    if on_cpu and precision in ("16-mixed", "16-true", "16"):
        raise ConfigError(
            f"precision={precision} needs a CUDA GPU (on CPU Lightning would silently switch to bf16); "
            "use precision=32-true on CPU"
        )
    devices = t.get("devices", 1)
    if not on_cpu and isinstance(devices, int) and devices > torch.cuda.device_count():
        raise ConfigError(
            f"trainer.devices={devices} but only {torch.cuda.device_count()} GPU(s) are visible; lower trainer.devices"
        )
    return not on_cpu


def check_fits(footprint: RunFootprint, processes: int, available: int, where: str, warn: bool = True,
               lower: Callable[[], str | None] = lambda: None) -> None:
    """Refuse a run whose estimate (xl.training.footprint's, for ``processes`` sharing the device) exceeds the device's
    free memory, naming the setting to lower (``lower()``: :func:`xl.training.headroom.setting_to_lower`, asked only
    then; else the settings of the largest part); warn when it is close."""
    judged = verdict(footprint, available, processes)
    if judged == "fits":
        return
    part = footprint.largest()
    shared = f" over {processes} processes" if processes > 1 else ""
    detail = (f"about {footprint.total * processes / GiB:,.1f} GiB ({NAMES[part]}: "
              f"{footprint.parts()[part] * processes / GiB:,.1f} GiB{shared}) against {available / GiB:,.1f} GiB "
              f"of {where}")
    if judged == "too big":
        raise ConfigError(f"this run needs {detail}; lower {lower() or SETTINGS[part]}")
    if warn:
        log.warning("this run needs %s, close to the limit (python -m xl.footprint --run ... itemises it)", detail)


def processes_per_device(cfg: DictConfig) -> int:
    """How many processes share one device's memory: on CPU, every process of the machine; on GPUs, one."""
    devices = cfg.trainer.devices
    return 1 if uses_cuda(cfg) else devices if is_int(devices) and devices > 0 else 1

