"""What the machine allows a config: ``precision=auto`` resolved for the device and CPU, precisions and device counts
it cannot honour, and whether a run's memory estimate fits the device (each refusal one sentence naming the setting
to change; :mod:`xl.config.rules` holds the rules of the config itself)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, open_dict

from xl.config.rules import ConfigError, model_values, vocabulary_bound
from xl.device import cpu
from xl.device.headroom import NAMES, SETTINGS, GiB, verdict
from xl.model.config import XLConfig
from xl.model.memory_settings import evaluation
from xl.settings.bounds import is_int

if TYPE_CHECKING:
    from xl.device.footprint import RunFootprint

log = logging.getLogger(__name__)


def uses_cuda(cfg: DictConfig) -> bool:
    import torch

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def auto_precision(on_cpu: bool, flags: frozenset[str] | set[str]) -> tuple[str, str]:
    """What ``precision=auto`` trains in, and why: on a GPU, bf16 autocast where it has bf16 (Ampere on), else fp16 with
    loss scaling; on a CPU whose ``flags`` (:func:`xl.device.cpu.cpu_flags`) say it multiplies bfloat16 in hardware,
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
    """Refuse a run whose estimate (xl.device.footprint's, for ``processes`` sharing the device) exceeds the device's
    free memory, naming the setting to lower (``lower()``: :func:`xl.device.headroom.setting_to_lower`, asked only
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


def run_estimate(cfg: Any, vocab_size: int | None = None) -> tuple[RunFootprint, int]:
    """The estimate for one device of the training run a composed config describes, and how many processes share
    that device's memory (:func:`processes_per_device`); ``vocab_size`` defaults to
    :func:`xl.config.rules.vocabulary_bound`."""
    from xl.device.footprint import PRECISION_BYTES, run_footprint  # (torch: the config package loads without it)

    data, memory = cfg.data, cfg.memory
    config = XLConfig.from_dict(model_values(cfg, vocab_size or vocabulary_bound(cfg)))
    eval_batch = data.batch_size if data.eval_batch_size is None else data.eval_batch_size
    eval_mem_len = evaluation(memory).mem_len
    precision = str(cfg.trainer.precision)
    footprint = run_footprint(config, batch_size=data.batch_size, tgt_len=data.tgt_len, eval_batch_size=eval_batch,
                              eval_mem_len=eval_mem_len, precision=precision if precision in PRECISION_BYTES
                              else "32-true", grad_segments=memory.grad_segments)
    return footprint, processes_per_device(cfg)
