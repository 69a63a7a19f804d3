"""Run commands one after another in this process, as ``python`` runs them, and say which heavy libraries each had
imported by the time it answered (``python -m tests.helpers.startup LIBRARY,... -- ARGV -- ARGV ...``).

Each command runs with ``runpy``, as the interpreter runs a script or ``-m`` a module; what it prints is kept. One
JSON line per command, in order: its exit code, its output, and which of the named libraries were in
``sys.modules`` when it first wrote to stdout or stderr and when it ended. A library imported by an earlier
command stays imported, so the first command that imports one shows it first.
"""

from __future__ import annotations

import io
import json
import runpy
import sys


class Watch(io.StringIO):
    """A stream that notes the libraries imported at its first write."""

    def __init__(self, libraries: list[str]) -> None:
        super().__init__()
        self.libraries, self.at_first_write = libraries, None

    def write(self, text: str) -> int:
        if self.at_first_write is None and text:
            self.at_first_write = imported(self.libraries)
        return super().write(text)


def imported(libraries: list[str]) -> list[str]:
    return [name for name in libraries if name in sys.modules]


def run(argv: list[str], libraries: list[str]) -> dict:
    from hydra.core.global_hydra import GlobalHydra

    out = Watch(libraries)
    saved = sys.stdout, sys.stderr, sys.argv
    sys.stdout = sys.stderr = out
    code: object = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.stdout, sys.stderr, sys.argv = saved
        GlobalHydra.instance().clear()
    if isinstance(code, str):  # sys.exit("error: ...") prints its message
        out.write(code + "\n")
        code = 1
    return {"argv": argv, "code": code or 0, "output": out.getvalue(), "at_first_output": out.at_first_write or [],
            "at_end": imported(libraries)}


def main() -> None:
    libraries, *commands = " ".join(sys.argv[1:]).split(" -- ")
    for command in commands:
        print(json.dumps(run(command.split(), libraries.split(","))), flush=True)


if __name__ == "__main__":
    main()
