"""Every option of every config group composes against its schema, states only what differs from it, and builds
what it names."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import lightning as L
import pytest
import torch
import yaml
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, compose_config
from tests.helpers.paths import ROOT
from tests.integration.test_experiments import closed_form_parameters
from xl.config import schema as xl_schema
from xl.config.callback_schema import CALLBACKS, LOGGERS
from xl.config.compose import compose as compose_or_explain
from xl.config.machine import check_device
from xl.config.reference import generated_part, reference
from xl.config.rules import ConfigError, check_memory, model_values
from xl.config.schema import SCHEMAS, FilesDataSchema, ModelSchema, OptimConfig
from xl.data import SegmentDataModule
from xl.data.tokenizers import TOKENIZERS
from xl.device.footprint import PRECISION_BYTES
from xl.model.config import XLConfig
from xl.model.memory_settings import DEFAULT_TARGET, MemorySettings, config_class, variant
from xl.model.transformer import count_parameters
from xl.training.build import build_callbacks, build_loggers
from xl.training.loop.module import XLLitModule


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_groups_have_the_promised_options():
    assert {"tiny", "small", "base"} <= set(options("model"))
    assert {"none", "short", "default", "long"} <= set(options("memory"))
    assert {"32-true", "bf16-mixed", "16-mixed", "bf16-true"} <= set(options("precision"))
    assert {"cpu", "gpu", "ddp"} <= set(options("trainer"))
    assert {"wandb", "tensorboard", "csv", "none"} <= set(options("logger"))


MODEL_SHAPES = {  # (n_layer, n_head, d_model, d_head, d_inner, dropout), parameters with a byte vocabulary
    "tiny": ((2, 2, 32, 16, 64, 0.0), 27_200),
    "small": ((4, 4, 256, 64, 1024, 0.1), 3_484_672),  # config S of the benchmarks
    "base": ((12, 8, 512, 64, 2048, 0.1), 41_093_120),  # the paper's enwik8 base: 41M
}


@pytest.mark.parametrize("option", options("model"))
def test_model_options(option):
    cfg = compose_config(f"model={option}")
    config = XLConfig.from_dict(model_values(cfg, vocab_size=256))
    shape, params = MODEL_SHAPES[option]
    m = cfg.model
    assert (m.n_layer, m.n_head, m.d_model, m.d_head, m.d_inner, m.dropout) == shape
    # The closed form counts the adaptive softmax's word biases; the plain softmax has none.
    assert count_parameters(config) == closed_form_parameters(config) - config.vocab_size == params


def memory_file(option: str) -> dict:
    """conf/memory/OPTION.yaml's own values (its defaults list left out)."""
    values = yaml.safe_load((CONF_DIR / "memory" / f"{option}.yaml").read_text())
    assert values["defaults"] == ["/memory_schema@_here_"], f"memory/{option}.yaml extends the schema alone"
    return {key: value for key, value in values.items() if key != "defaults"}


@pytest.mark.parametrize("option", options("memory"))
def test_memory_options(option):
    """Each conf/memory file composes to its own values over the shared settings' defaults, names a variant's config
    class (the cache's by default) and passes the variant's rules: a new memory adds a file, not a row here."""
    cfg = compose_config(f"memory={option}")
    own = memory_file(option)
    shared = MemorySettings()
    for f in dataclasses.fields(MemorySettings):
        assert cfg.memory[f.name] == own.get(f.name, getattr(shared, f.name)), f"memory/{option}.yaml: {f.name}"
    assert cfg.memory.mem_dtype == "float32"
    made = variant(cfg.memory, cfg)
    assert type(made) is config_class(own.get("_target_", DEFAULT_TARGET))
    for f in made.user_fields():
        assert getattr(made, f.name) == own.get(f.name, f.default), f"memory/{option}.yaml: {f.name}"
    check_memory(cfg)


def test_the_cache_options_keep_their_contexts():
    """The cache's own options: none, 64 and 192 positions, and 256 with a longer, same-length evaluation window."""
    m = {option: compose_config(f"memory={option}").memory for option in ("none", "short", "long", "babilong")}
    assert (m["none"].mem_len, m["none"].eval_mem_len, m["short"].mem_len, m["babilong"].mem_len) == (0, 0, 64, 192)
    assert (m["long"].mem_len, m["long"].eval_mem_len, m["long"].eval_same_length) == (256, 1024, True)


def test_the_main_job_keeps_four_segments_of_memory():
    """conf/memory/default.yaml's comment: 128 positions = 4 segments of the main job's 32 tokens."""
    cfg = compose_config()
    assert cfg.memory.mem_len == 4 * cfg.data.tgt_len == 128 and cfg.data.batch_size == 16


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
    assert check_device(cfg) is True
    assert cfg.trainer.precision == expected
    cpu = compose_config("trainer=cpu")  # an explicit CPU run stays float32 even where a GPU is visible
    assert check_device(cpu) is False
    assert cpu.trainer.precision == "32-true"


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse2 avx avx2 {}
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu
"""


@pytest.mark.parametrize("flags,expected", [
    ("", "32-true"), ("avx512f avx512bw", "32-true"), ("avx512f avx512_bf16", "bf16-mixed"),
    ("amx_bf16 amx_tile amx_int8 avx512_bf16", "bf16-mixed"), ("amx_bf16 amx_tile", "bf16-mixed")])
def test_auto_precision_on_a_cpu_is_bf16_where_it_computes_bf16(flags, expected, tmp_path, monkeypatch, caplog):
    """The choice is a function of the CPU's flags as Linux lists them (the first CPU's); logged with its reason."""
    import xl.device.cpu

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.format(flags))
    assert xl.device.cpu.cpu_flags(cpuinfo) == {"fpu", "vme", "sse2", "avx", "avx2", *flags.split()}
    monkeypatch.setattr(xl.device.cpu, "CPUINFO", str(cpuinfo))
    cfg = compose_config(f"paths.output_dir={tmp_path}")
    with caplog.at_level(logging.INFO, logger="xl.config.machine"):
        assert check_device(cfg) is False
    assert cfg.trainer.precision == expected
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision=auto")]
    reason = "natively: " if expected == "bf16-mixed" else "no native bfloat16 (no amx_bf16 or avx512_bf16 flag)"
    assert len(said) == 1 and said[0].startswith(f"precision=auto: {expected} (") and reason in said[0], said
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    assert trainer.strategy.precision_plugin.precision == expected
    assert xl.device.cpu.cpu_flags(tmp_path / "missing") == frozenset()  # no /proc/cpuinfo (macOS, Windows): float32


TRAINERS = {"cpu": ("cpu", 1, "SingleDeviceStrategy"), "ddp": ("auto", 2, "DDPStrategy")}


@pytest.mark.parametrize("option", options("trainer"))
def test_trainer_options(option, tmp_path):
    cfg = compose_config(f"trainer={option}", f"paths.output_dir={tmp_path}")
    if option in ("gpu", "fsdp"):  # Lightning's FSDP is CUDA only (tests/integration/test_launchers.py)
        assert cfg.trainer.accelerator == "gpu"
        with pytest.raises(ConfigError, match="trainer=cpu"):
            check_device(cfg)
        return
    check_device(cfg)
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    assert (cfg.trainer.accelerator, cfg.trainer.devices, type(trainer.strategy).__name__) == TRAINERS[option]
    assert trainer.max_steps == 1500 and trainer.gradient_clip_val == 0.25 and trainer.default_root_dir == str(tmp_path)
    if option == "ddp":
        assert trainer.strategy._ddp_kwargs.get("broadcast_buffers") is False


LOGGER_TYPES = {"none": [], "wandb": ["WandbLogger"], "tensorboard": ["TensorBoardLogger"], "csv": ["CSVLogger"]}


@pytest.mark.parametrize("option", options("logger"))
def test_logger_options(option, tmp_path):
    cfg = compose_config(f"logger={option}", f"paths.output_dir={tmp_path}", "tags=[a,b]")
    loggers = build_loggers(cfg)
    assert [type(logger).__name__ for logger in loggers] == LOGGER_TYPES[option]
    for logger in loggers:
        assert str(logger.save_dir) == str(tmp_path)
    if option == "wandb":
        assert cfg.logger.wandb.offline is True and list(cfg.logger.wandb.tags) == ["a", "b"]


DATA = {  # source class (None: local files), its name argument, tokenizer
    "stdlib": ("StdlibSource", None, "byte"), "text": ("TextFilesSource", None, "byte"),
    "enwik8": ("HubSource", "enwik8", "byte"), "text8": ("HubSource", "text8", "char"),
    "wikitext103": ("HubSource", "wikitext-103", "word"), "wikitext2": ("HubSource", "wikitext-2", "word"),
    "recall": ("RecallSource", None, "byte"), "babilong": ("BabilongSource", None, "byte"),
}


# data=run: a run's own data (xl.training.runs)
@pytest.mark.parametrize("option", [o for o in options("data") if o != "run"])
def test_data_options(option, tmp_path):
    extra = [f"data.train={tmp_path}/a.txt", f"data.val={tmp_path}/b.txt", f"data.test={tmp_path}/c.txt"]
    cfg = compose_config(f"data={option}", f"data.cache_dir={tmp_path}", *(extra if option == "text" else []))
    datamodule = instantiate(cfg.data)  # building is lazy: no file is read, nothing downloaded
    source, name, tokenizer = DATA[option]
    assert type(datamodule.source).__name__ == source and getattr(datamodule.source, "name", None) == name
    assert datamodule.tokenizer_name == tokenizer
    assert (datamodule.batch_size, datamodule.tgt_len) == (16, 32)  # the main job's (conf/config.yaml)
    assert datamodule.eval_batch_size == datamodule.batch_size and datamodule.eval_tgt_len == datamodule.tgt_len


def test_callbacks_build(tmp_path):
    callbacks = build_callbacks(compose_config(f"paths.output_dir={tmp_path}"))
    assert [type(c).__name__ for c in callbacks] == ["ModelCheckpoint", "LearningRateMonitor", "ThroughputMonitor",
                                                     "RunProgressBar", "PreemptionCheckpoint", "JobSummary"]
    checkpoint = callbacks[0]
    assert (checkpoint.dirpath, checkpoint.monitor, checkpoint.save_top_k, checkpoint.save_last) == (
        str(tmp_path / "checkpoints"), "val/loss", 1, True)
    assert [type(c).__name__ for c in build_callbacks(compose_config(f"paths.output_dir={tmp_path}"),
                                                      with_logger=False)] == [
        "ModelCheckpoint", "RunProgressBar", "PreemptionCheckpoint", "JobSummary"]
    names = build_callbacks(compose_config(f"paths.output_dir={tmp_path}", "~callbacks.throughput"))
    assert "ThroughputMonitor" not in [type(c).__name__ for c in names] and len(names) == 5


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigError, match=r"^memory.mem_lenn is not a setting; did you mean memory.mem_len\?$"):
        compose_or_explain("config", ["memory.mem_lenn=3"])


def test_defaults_are_cpu_fp32_wandb_offline():
    cfg = compose_config()
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.precision == "auto"
    check_device(cfg)
    assert cfg.trainer.precision == "32-true"
    assert cfg.logger.wandb.offline is True
    assert OmegaConf.select(cfg, "data.source._target_").endswith("StdlibSource")


# ---- the schema is the reference ---------------------------------------------------------------------------
def names(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema) if not f.name.startswith("_")}


def test_schema_mirrors_the_code_it_configures():
    context = {"mem_len", "clamp_len", "same_length", "mem_dtype"}
    xl_fields = {f.name for f in dataclasses.fields(XLConfig)}
    from_data = {"vocab_size"}  # the data's vocabulary
    assert names(ModelSchema) == xl_fields - context - from_data - {"memory"}  # memory: the variant's own config
    module_memory = {"doc_boundaries", "grad_segments"}  # memory settings of the Lightning module, not of the model
    assert {n for n in names(MemorySettings) if not n.startswith("eval_")} == context | module_memory
    assert module_memory <= set(inspect.signature(XLLitModule).parameters)
    for schema in (ModelSchema, MemorySettings):  # the defaults are XLConfig's (cutoffs: null, fitted to the data)
        for f in dataclasses.fields(schema):
            if f.name in xl_fields and f.name != "cutoffs":
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                ours = getattr(XLConfig, f.name)
                assert (default if ours is None else type(ours)(default)) == ours, f.name
    assert SCHEMAS["optim_schema"] is OptimConfig  # the optimizer's settings are its schema: one dataclass
    data_args = set(inspect.signature(SegmentDataModule).parameters) - {"source"}
    assert names(FilesDataSchema) == data_args | set(inspect.signature(SegmentDataModule.from_files).parameters) - {
        "kwargs"}
    trainer_args = set(inspect.signature(L.Trainer).parameters)
    assert names(SCHEMAS["trainer_schema"]) <= trainer_args
    for schema in [*CALLBACKS.values(), *LOGGERS.values()]:
        parameters = inspect.signature(get_object(schema._target_)).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):  # WandbLogger passes on to wandb.init
            assert names(schema) <= set(parameters), schema.__name__


def parent_defaults(group: str, entry: str | dict) -> dict:
    """What an option file's defaults-list entry gives: a schema's defaults, another option composed, or a nested
    group's option under its key (data/babilong's background)."""
    if isinstance(entry, dict):
        return {sub: option_values(f"{group}/{sub}", option) for sub, option in entry.items()}
    node = SCHEMAS.get(entry.removeprefix("/").removesuffix("@_here_"))
    if node is not None:
        return OmegaConf.to_container(OmegaConf.create(
            {k: OmegaConf.structured(v) for k, v in node.items()} if isinstance(node, dict) else
            OmegaConf.structured(node)))
    return option_values(group, entry)


def option_values(group: str, option: str) -> dict:
    body = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml")) or {}
    merged: dict = {}
    for entry in body.pop("defaults", []):
        if entry != "_self_":
            merged = OmegaConf.to_container(OmegaConf.merge(merged, parent_defaults(group, entry)))
    return OmegaConf.to_container(OmegaConf.merge(merged, body))


def restated(body: dict, base: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in body.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            found += restated(value, base[key], f"{prefix}{key}.")
        elif key in base and base[key] == value:
            found.append(f"{prefix}{key}")
    return found


GROUPS = ["model", "memory", "data", "optim", "trainer", "callbacks", "logger"]
SHOWN = {  # options whose files show the schema's values (not _target_), less the keys (or whole entries) named here
    ("model", "small"): set(),
    ("trainer", "cpu"): {"precision", "default_root_dir"},  # precision: the precision group's
    ("callbacks", "default"): {"model_checkpoint.dirpath", "model_checkpoint.auto_insert_metric_name",
                               "model_checkpoint.enable_version_counter", "throughput", "preemption", "job_summary"},
    ("logger", "wandb"): {"wandb.save_dir", "wandb.id", "wandb.tags"},  # the run folder's, its W&B id, run tags
}


def flat(values: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    out = {}
    for key, value in values.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {f"{prefix}{key}": value})
    return out


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_option_files_state_only_what_differs(group, option):
    body = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml")) or {}
    entries = [e for e in body.pop("defaults", []) if e != "_self_"]
    # data/run: evaluation's and generation's "the run's own data", whose keys change the run's settings
    # (xl.training.runs)
    assert entries or option == "none" or (group, option) == ("data", "run"), f"{group}/{option}.yaml names no schema"
    if group == "memory":  # the file is its variant's constructor: it names the class and shows each of its settings
        variant = config_class(body["_target_"])
        assert {f.name for f in variant.user_fields()} <= set(body), f"memory/{option}.yaml leaves a setting out"
        return
    if (group, option) == ("optim", "adamw"):  # the only optimizer: its file shows every value a user would change
        assert set(body) == {f.name for f in dataclasses.fields(OptimConfig)}
        assert OptimConfig(**body) == OptimConfig()  # and they are the defaults
        return
    if (group, option) in SHOWN:  # a default option: its file shows every value a user would change, the schema's
        schema, shown = flat(parent_defaults(group, entries[0])), flat(body)
        left = SHOWN[group, option]
        users = {k for k in schema if k.rsplit(".", 1)[-1] != "_target_" and not any(
            k == x or k.startswith(f"{x}.") for x in left)}
        assert set(shown) == users, f"{group}/{option}.yaml leaves out {sorted(users - set(shown))}"
        assert {k: schema[k] for k in shown} == shown, "the values shown are the schema's defaults"
        return
    base: dict = {}
    for entry in entries:
        base = OmegaConf.to_container(OmegaConf.merge(base, parent_defaults(group, entry)))
    assert restated(body, base) == []


def test_the_configuration_page_is_the_schema():
    """docs/configuration.md's tables are what ``python -m xl.config.reference`` prints from the schema."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert generated_part(page) == reference(), \
        "regenerate the tables: python -m xl.config.reference --write docs/configuration.md"


def test_the_schema_names_every_tokenizer_the_data_accepts():
    assert set(xl_schema.TOKENIZERS) == set(TOKENIZERS)
    assert set(xl_schema.PRECISIONS) == set(PRECISION_BYTES)
