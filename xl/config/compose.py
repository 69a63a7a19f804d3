"""The one way the entry points compose a config and report a bad one.

The schema of every key is :mod:`xl.config.schema`; the rules a composed config must satisfy are :mod:`xl.config.rules`;
a config that cannot even be composed is described by :mod:`xl.config.compose_errors`. Importing ``xl`` registers the
schemas, so composing ``conf/`` by hand (``hydra.compose``) finds them too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import hydra
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import CompactHydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from xl.config.compose_errors import describe_error
from xl.config.help import help_overrides, job_name, render_help
from xl.config.rules import ConfigError, check_bounds
from xl.config.schema import register
from xl.model import memory_settings

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

def check_complete(cfg: DictConfig) -> None:
    """Refuse a config with an interpolation that cannot be resolved, or required keys left unset (``???``)."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "a setting"
        raise ConfigError(f"{key} cannot be resolved ({str(err).splitlines()[0]})") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        names = ", ".join(missing)
        raise ConfigError(f"{names} {'has' if len(missing) == 1 else 'have'} no value; "
                          f"set {' '.join(f'{k}=...' for k in missing)} on the command line")


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """``conf/<config_name>.yaml`` with ``overrides``, or :class:`ConfigError` in one sentence."""
    register()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name, overrides=list(overrides))
    except (CompactHydraException, OmegaConfBaseException) as err:
        raise ConfigError(describe_error(err)) from None
    type_memory(cfg)
    warn_memory_under_experiment(overrides)
    return cfg


def type_memory(cfg: DictConfig) -> None:
    """Type a training config's ``memory`` node by its variant (:func:`xl.model.memory_settings.typed`), or refuse a key
    or value of the wrong kind in one sentence."""
    if "memory" in cfg and "_target_" in cfg.memory:
        try:
            with open_dict(cfg):
                cfg.memory = memory_settings.typed(cfg.memory)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def warn_memory_under_experiment(overrides: list[str] | tuple[str, ...]) -> None:
    """Say which memory settings an experiment keeps over a memory chosen beside it (``experiment=X memory=Y``): the
    experiment's values are merged after the memory option, so they win unless the command line sets them too."""
    chosen = {o.key_or_group.lstrip("+"): o.value() for o in OverridesParser.create().parse_overrides(list(overrides))}
    experiment, memory = chosen.get("experiment"), chosen.get("memory")
    path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    if not isinstance(experiment, str) or not isinstance(memory, str) or not path.is_file():
        return
    option = CONF_DIR / "memory" / f"{memory}.yaml"
    own = OmegaConf.load(option) if option.is_file() else OmegaConf.create()
    with open_dict(own):
        own.pop("defaults", None)
    try:
        own = memory_settings.typed(own)
    except ValueError:
        return
    values = OmegaConf.load(path).get("memory") or {}
    kept = [f"memory.{k}={v}" for k, v in values.items()
            if f"memory.{k}" not in chosen and (k not in own or own[k] != v)]
    if kept:
        warnings.warn(f"experiment={experiment} sets {', '.join(kept)} over memory={memory}'s own values; set them "
                      "on the command line to change them", UserWarning, stacklevel=2)


def command_line_keys() -> set[str] | None:
    """The keys and groups that the running Hydra job's command line set (``data.tgt_len=64`` gives
    ``data.tgt_len``, ``data=text`` gives ``data``); None outside a Hydra job (a config composed in Python)."""
    if not HydraConfig.initialized():
        return None
    overrides = OverridesParser.create().parse_overrides(command_line())
    return {o.key_or_group for o in overrides}


def command_line() -> list[str]:
    """The running Hydra job's command-line overrides, as written (an interpolation in one is not resolved)."""
    return OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)


# ---- entry points -----------------------------------------------------------------------------------------


def user_errors() -> tuple[type[Exception], ...]:
    """The errors a user fixes by changing a setting or a file: reported in one sentence, no traceback. A checkpoint's
    error can be raised only once its module (which imports torch) is loaded; before, it is not asked for, so that a
    setting refused before torch is imported is reported without importing it."""
    from xl.data import DataError

    checkpoint = sys.modules.get("xl.training.checkpoints.checkpoint")
    return (ConfigError, DataError) + ((checkpoint.CheckpointError,) if checkpoint is not None else ())


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn a :func:`user_errors` exception into ``error: <sentence>`` on stderr and exit status 1."""
    try:
        yield
    except user_errors() as err:
        sys.exit(f"error: {err}")


T = TypeVar("T")


def entry_point(config_name: str) -> Callable[[Callable[[DictConfig], T]], Callable[[], T]]:
    """Decorator for a command's ``main(cfg)``: Hydra composes ``conf/<config_name>.yaml`` with the command line
    (``-m`` sweeps included), and any bad setting ends the command with ``error: <one sentence>``.

    Hydra prints composition errors over several lines; with ``HYDRA_FULL_ERROR`` set it raises them instead,
    so the command sets it while Hydra runs and reports them itself (unless the user had set it).
    """

    def decorate(task: Callable[[DictConfig], T]) -> Callable[[], T]:
        @functools.wraps(task)
        def job(cfg: DictConfig) -> T:
            with exit_on_user_error():
                check_bounds(cfg)  # first: typing the memory imports its variant's module, and with it torch
                type_memory(cfg)
                warn_memory_under_experiment(command_line())
                check_complete(cfg)
                try:
                    return task(cfg)
                except Exception as err:
                    err.raised_by_job = True  # a failure of the command, not of composition: keep its traceback
                    raise

        register()
        hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(job)

        @functools.wraps(task)
        def main() -> T:
            overrides = help_overrides(sys.argv[1:])
            if overrides is not None:
                text = render_help(CONF_DIR, config_name, job_name(task), overrides)
                if text is not None:
                    print(text)
                    sys.exit(0)  # as Hydra ends its own --help
            if os.environ.get("HYDRA_FULL_ERROR"):
                return hydra_main()
            os.environ["HYDRA_FULL_ERROR"] = "1"
            try:
                return hydra_main()
            except (CompactHydraException, OmegaConfBaseException) as err:
                if isinstance(err, InstantiationException) or getattr(err, "raised_by_job", False):
                    raise
                sys.exit(f"error: {describe_error(err)}")
            finally:
                del os.environ["HYDRA_FULL_ERROR"]

        return main

    return decorate

