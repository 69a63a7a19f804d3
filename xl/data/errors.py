"""The one error type of the data package, so callers can tell a bad setting from a bug."""

from __future__ import annotations

from pathlib import Path


class DataError(ValueError):
    """A data setting or input file is unusable; the message names the setting to change."""


def existing_file(value: object, setting: str, name: str) -> Path:
    """``value`` as the path of a file such as ``name`` (``tokenizer.json``), or :class:`DataError` naming ``setting``
    and saying whether the path is a folder or does not exist."""
    path = Path(str(value)).expanduser()
    if path.is_dir():
        inside = f"the {name} file in it, {path / name}" if (path / name).is_file() else f"a {name} file"
        raise DataError(f"{setting}={value} is a folder; point it at {inside}")
    if not path.is_file():
        raise DataError(f"{setting}={value} does not exist; point it at a {name} file")
    return path
