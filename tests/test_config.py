"""Every option of every config group composes, and builds what it names."""

from __future__ import annotations

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, compose_config
from xl.build import ConfigError, build_callbacks, build_loggers, check_device, model_config
from xl.model import XLConfig, check_context, count_parameters


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_groups_have_the_promised_options():
    assert {"tiny", "small", "base"} <= set(options("model"))
    assert {"none", "short", "default", "long"} <= set(options("memory"))
    assert {"32-true", "bf16-mixed", "16-mixed", "bf16-true"} <= set(options("precision"))
    assert {"cpu", "gpu", "ddp"} <= set(options("trainer"))
    assert {"wandb", "tensorboard", "csv", "none"} <= set(options("logger"))


@pytest.mark.parametrize("option", options("model"))
def test_model_options(option):
    cfg = compose_config(f"model={option}")
    config = XLConfig.from_dict(model_config(cfg, vocab_size=256))
    assert count_parameters(config) > 0


def test_base_model_is_the_papers_enwik8_base_shape():
    cfg = compose_config("model=base")
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head, cfg.model.d_inner) == (12, 512, 8, 2048)


@pytest.mark.parametrize("option", options("memory"))
def test_memory_options(option):
    m = compose_config(f"memory={option}").memory
    check_context(m.mem_len, m.clamp_len, m.same_length)
    check_context(m.eval_mem_len if m.eval_mem_len is not None else m.mem_len, m.clamp_len,
                  bool(m.eval_same_length if m.eval_same_length is not None else m.same_length))


@pytest.mark.parametrize("option", options("precision"))
def test_precision_options(option, tmp_path):
    cfg = compose_config(f"precision={option}", f"paths.output_dir={tmp_path}")
    if option.startswith("16"):
        with pytest.raises(ConfigError, match="precision=32-true"):
            check_device(cfg)
        return
    check_device(cfg)
    expected = "32-true" if option == "auto" else option  # auto on a CPU
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    assert cfg.trainer.precision == expected and trainer.strategy.precision_plugin.precision == expected


@pytest.mark.parametrize("bf16,expected", [(True, "bf16-mixed"), (False, "16-mixed")])
def test_auto_precision_on_a_gpu_is_mixed(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = compose_config("trainer=gpu")
    check_device(cfg)
    assert cfg.trainer.precision == expected
    cpu = compose_config("trainer=cpu")  # an explicit CPU run stays float32 even where a GPU is visible
    check_device(cpu)
    assert cpu.trainer.precision == "32-true"


@pytest.mark.parametrize("option", options("trainer"))
def test_trainer_options(option, tmp_path):
    cfg = compose_config(f"trainer={option}", f"paths.output_dir={tmp_path}")
    if option in ("gpu", "fsdp"):  # Lightning's FSDP is CUDA only (tests/test_launchers.py)
        with pytest.raises(ConfigError, match="trainer=cpu"):
            check_device(cfg)
        return
    check_device(cfg)
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    if option == "ddp":
        assert trainer.strategy._ddp_kwargs.get("broadcast_buffers") is False


@pytest.mark.parametrize("option", options("logger"))
def test_logger_options(option, tmp_path):
    cfg = compose_config(f"logger={option}", f"paths.output_dir={tmp_path}")
    loggers = build_loggers(cfg)
    assert len(loggers) == (0 if option == "none" else 1)


@pytest.mark.parametrize("option", options("data"))
def test_data_options(option, tmp_path):
    extra = [f"data.train={tmp_path}/a.txt", f"data.val={tmp_path}/b.txt", f"data.test={tmp_path}/c.txt"]
    cfg = compose_config(f"data={option}", f"data.cache_dir={tmp_path}", *(extra if option == "text" else []))
    datamodule = instantiate(cfg.data)  # building is lazy: no file is read, nothing downloaded
    assert datamodule.batch_size == cfg.data.batch_size


def test_callbacks_build(tmp_path):
    names = {type(c).__name__ for c in build_callbacks(compose_config(f"paths.output_dir={tmp_path}"))}
    assert {"ModelCheckpoint", "LearningRateMonitor", "ThroughputMonitor", "TQDMProgressBar"} <= names


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigCompositionException, match="memory.mem_lenn"):
        compose_config("memory.mem_lenn=3")


def test_defaults_are_cpu_fp32_wandb_offline():
    cfg = compose_config()
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.precision == "auto"
    check_device(cfg)
    assert cfg.trainer.precision == "32-true"
    assert cfg.logger.wandb.offline is True
    assert OmegaConf.select(cfg, "data.source._target_").endswith("StdlibSource")
