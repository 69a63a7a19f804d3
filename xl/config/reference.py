"""The config reference, generated from the schema and the options of conf/memory/: prints the tables of
docs/configuration.md, or with --write PAGE puts them into that page between its markers (a test keeps the page equal
to this output)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, get_type_hints

from omegaconf import OmegaConf

from xl.config.callback_schema import CALLBACKS, LOGGERS
from xl.config.schema import (
    SCHEMAS,
    BabilongDataSchema,
    EvaluateSchema,
    FilesDataSchema,
    GenerateSchema,
    ScoreSchema,
    SourceDataSchema,
    TrainSchema,
)
from xl.model.memory_settings import MemorySettings, config_class
from xl.settings.bounds import bound_of, describe_type, help_of

BEGIN, END = "<!-- BEGIN GENERATED: python -m xl.config.reference -->", "<!-- END GENERATED -->"
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value: Any = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    if value == "???":
        return "required"
    if value == "":
        return '""'
    if dataclasses.is_dataclass(value):
        return ""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def rows(schema: type, prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    hints = get_type_hints(schema)
    lines = []
    for f in dataclasses.fields(schema):
        if f.name.startswith("_") or f.name in skip or "from" in f.metadata or dataclasses.is_dataclass(hints[f.name]):
            continue
        bound = bound_of(f)
        allowed = bound.says if bound else ""
        default = default_text(f)
        lines.append(f"| `{prefix}{f.name}` | {cell(describe_type(hints[f.name]))} | {cell(allowed)} | "
                     f"{f'`{cell(default)}`' if default else ''} | {cell(help_of(f))} |")
    return lines


def options(group: str) -> str:
    names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    return ", ".join(f"`{group}={n}`" for n in names)


def table(title: str, schema: type, prefix: str, note: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    head = [f"### {title}", ""] + ([note.replace("``", "`"), ""] if note else [])  # Markdown, not reST
    return head + ["| key | type | allowed | default | meaning |", "|---|---|---|---|---|",
                   *rows(schema, prefix, skip), ""]


def variant_tables() -> list[str]:
    """One table per memory variant that an option of ``conf/memory/`` names: its own settings."""
    options: dict[str, list[str]] = {}  # variant class → the options that name it
    for path in sorted((CONF_DIR / "memory").glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        if target is not None:
            options.setdefault(target, []).append(path.stem)
    lines = []
    for target, named in options.items():
        variant = config_class(target)
        note = f"`_target_: {target}` ({', '.join(f'`memory={n}`' for n in named)}). {variant.__doc__.splitlines()[0]}"
        if variant.user_fields():
            lines += table(f"`memory` of the {variant.name} memory", variant, "memory.", note)
    return lines


def reference() -> str:
    """Every group and key of ``python train.py``, ``python -m xl.evaluate`` and ``python -m xl.generate``, from the
    schema."""
    lines: list[str] = []
    for group in ("model", "memory", "optim", "trainer"):
        schema = MemorySettings if group == "memory" else SCHEMAS[f"{group}_schema"]
        summary = " ".join(schema.__doc__.split()) if group == "memory" else schema.__doc__.splitlines()[0]
        lines += table(f"`{group}`", schema, f"{group}.", f"Options: {options(group)}. {summary}")
        if group == "memory":
            lines += variant_tables()
    lines += table("`data` (every data option)", SourceDataSchema, "data.",
                   f"Options: {options('data')}. Sources other than local files take `data.source`.")
    lines += table("`data=text` (local files)", FilesDataSchema, "data.",
                   "The keys above, and the files of each split (the source of data=text).")
    lines += table("`data=babilong` (BABILong-style samples)", BabilongDataSchema, "data.",
                   f"The keys above but `data.source`, and these. Backgrounds: {options('data/background')}; see "
                   "[BABILong-style tasks](babilong.md).", skip=tuple(SourceDataSchema.__dataclass_fields__))
    for name, schema in CALLBACKS.items():
        lines += table(f"`callbacks.{name}`", schema, f"callbacks.{name}.", "Remove with `~callbacks." + name + "`.")
    for name, schema in LOGGERS.items():
        lines += table(f"`logger.{name}`", schema, f"logger.{name}.", f"With `logger={name}`.")
    lines += table("`compile`", SCHEMAS["train_schema"].__dataclass_fields__["compile"].default_factory, "compile.")
    lines += table("Top level of `python train.py`", TrainSchema, "")
    lines += table("`python -m xl.evaluate`", EvaluateSchema, "")
    context = EvaluateSchema.__dataclass_fields__["memory"].default_factory
    lines += table("`memory` of `python -m xl.evaluate`", context, "memory.", context.__doc__.replace("\n", " "))
    lines += table("`python -m xl.generate`", GenerateSchema, "", "The data are the run's (`data=run`), as in "
                   "evaluation.")
    lines += table("`python -m xl.babilong`", ScoreSchema, "", "See [BABILong-style tasks](babilong.md).")
    return "\n".join(lines).rstrip() + "\n"


def generated_part(page: str) -> str:
    """The generated tables of a page (between the BEGIN and END markers)."""
    return page.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write(page: Path) -> None:
    """Replace the generated tables of ``page`` with :func:`reference`'s, atomically (never a half-written page)."""
    text = page.read_text()
    if BEGIN not in text or END not in text.split(BEGIN, 1)[1]:
        raise SystemExit(f"error: {page} has no '{BEGIN}' ... '{END}' markers; add them where the tables go")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    fd, tmp = tempfile.mkstemp(dir=page.parent, prefix=f".{page.name}.")
    with os.fdopen(fd, "w") as out:
        out.write(f"{head}{BEGIN}\n{reference()}{END}{tail}")
    os.replace(tmp, page)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m xl.config.reference", description=" ".join(__doc__.split()))
    parser.add_argument("--write", metavar="PAGE", type=Path,
                        help="put the tables into PAGE between its markers (docs/configuration.md) instead of printing")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(reference())
    else:
        write(args.write)


if __name__ == "__main__":
    main()
