"""A command's ``--help``, as Hydra prints it, in a fraction of Hydra's time.

Hydra lists the config groups for its help by asking its config loader for each group's options, and every question
copies the whole config repository (the ConfigStore with this project's schemas included): over a hundred copies, most
of a second and more. Here the config is composed once, the groups are listed once from the loader's config sources,
and Hydra's own help template (``hydra.help.template``) is filled in the format Hydra uses. Anything this does not
cover (another flag beside ``--help``, a template asking for the flags' help, a config that does not compose) is left
to Hydra, so that its output and errors are Hydra's own; a test compares both outputs for every command.
"""

from __future__ import annotations

import inspect
import os
import string
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.errors import CompactHydraException
from omegaconf import OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

HELP_FLAGS = ("--help", "-h")


def help_overrides(argv: list[str]) -> list[str] | None:
    """The overrides of a command line that asks for ``--help`` and nothing else of Hydra; None for any other."""
    flags = [arg for arg in argv if arg.startswith("-")]
    if len(flags) != 1 or flags[0] not in HELP_FLAGS or argv.index(flags[0]) not in (0, len(argv) - 1):
        return None  # Hydra's parser refuses overrides on both sides of a flag
    return [arg for arg in argv if arg not in HELP_FLAGS]


def job_name(task: Callable) -> str:
    """The job name Hydra gives ``task``'s command: its module's last name, or its file's name when run as a script."""
    module = os.environ.get("HYDRA_MAIN_MODULE", task.__module__)
    if module == "__main__":
        return Path(inspect.getfile(task)).stem
    return module.rpartition(".")[2]


def config_groups() -> dict[str, list[str]]:
    """Every config group that has options, with its sorted options, from the global Hydra's config sources."""
    sources = GlobalHydra.instance().config_loader().get_sources()

    def options(group: str, kind: ObjectType) -> list[str]:
        found = {name for source in sources if source.is_group(group) for name in source.list(group, kind)}
        return sorted(found)

    groups: dict[str, list[str]] = {}

    def walk(parent: str) -> None:
        for child in options(parent, ObjectType.GROUP):
            group = f"{parent}/{child}" if parent else child
            configs = options(group, ObjectType.CONFIG)
            if configs:
                groups[group] = configs
            walk(group)

    walk("")
    return groups


def render_help(config_dir: Path, config_name: str, name: str, overrides: list[str]) -> str | None:
    """The text Hydra's ``--help`` prints for ``config_name`` with ``overrides`` (its final newline left to print);
    None where Hydra itself should answer (the config does not compose, or the template wants the flags' help)."""
    try:
        with initialize_config_dir(config_dir=str(config_dir), job_name=name, version_base="1.3"):
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
            groups = config_groups()
    except (CompactHydraException, OmegaConfBaseException):  # Hydra reports it in its own words
        return None
    template = cfg.hydra.help.template
    if "FLAGS_HELP" in template:
        return None
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]

    def listing(hydra_groups: bool) -> str:
        return "".join(f"{group}: {', '.join(options)}\n" for group, options in sorted(groups.items())
                       if (group == "hydra" or group.startswith("hydra/")) == hydra_groups)

    return string.Template(template).substitute(
        APP_CONFIG_GROUPS=listing(False), HYDRA_CONFIG_GROUPS=listing(True), CONFIG=OmegaConf.to_yaml(cfg))
