"""The house's rules, checked on the source: the library imports no application, and a memory variant's settings
are named only by its own module, its config file, its benchmark, the tests and the docs."""

from __future__ import annotations

import ast
import re

from tests.helpers.paths import ROOT
from xl.memory.settings import MemoryConfig, config_class

LIBRARY = ("model", "memory", "data", "training", "config", "hub")
SHARED = ("xl.memory.base", "xl.memory.settings", "xl.memory.eviction", "xl.memory.store")  # every memory's
APPLICATIONS = ("xl.train", "xl.evaluate", "xl.evaluation", "xl.generate", "xl.generation", "xl.probe", "xl.footprint",
                "xl.export", "xl.convert", "xl.babilong", "xl.bench")


def imported(path) -> list[str]:
    """Every module an ``import`` names in the file, function-level imports included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def test_the_library_imports_no_application():
    # A variant's benchmark lives with the variant (xl/memory/<variant>/bench.py) and uses the benchmarks' runner.
    paths = [path for package in LIBRARY for path in (ROOT / "xl" / package).rglob("*.py") if path.name != "bench.py"]
    found = [(str(path.relative_to(ROOT)), name) for path in paths for name in imported(path)
             if any(name == app or name.startswith(app + ".") for app in APPLICATIONS)]
    assert found == []


def test_a_variants_settings_are_named_only_beside_its_code():
    """``conf/memory/*.yaml`` name the variants; outside their module or package (with the modules of
    ``xl/memory`` it imports and its decoder) and the benchmark of that variant (``xl/bench/<name>.py``), no file
    of ``xl/`` names one of their settings."""
    variants = {}
    for path in (ROOT / "conf" / "memory").glob("*.yaml"):
        target = re.search(r"^_target_: (\S+)", path.read_text(encoding="utf-8"), re.M).group(1)
        cls = config_class(target)
        # A variant that extends another's config (memory=rmt of memory=tokens) is checked for the settings it
        # declares; those it inherits are checked with the variant that declares them.
        inherited = {f.name for base in cls.__mro__[1:] if isinstance(base, type) and issubclass(base, MemoryConfig)
                     and base is not MemoryConfig for f in base.user_fields()}
        variants[target] = (cls, [f.name for f in cls.user_fields() if f.name not in inherited])
    homes = {cls.__module__ for cls, _ in variants.values()}
    for target, (cls, names) in variants.items():
        home = ROOT / (cls.__module__.replace(".", "/") + ".py")
        own = [ROOT / (name.replace(".", "/") + ".py") for name in imported(home)
               if name.startswith("xl.memory.") and name not in SHARED and name not in homes]
        package = list(home.parent.glob("*.py")) if home.parent != ROOT / "xl" / "memory" else []  # its package
        allowed = {home, *own, *package, home.with_name(home.stem + "_decoding.py"),
                   ROOT / "xl" / "bench" / f"{cls.name}.py", ROOT / "xl" / "bench" / f"{home.stem}.py"}
        for path in (ROOT / "xl").rglob("*.py"):
            if path in allowed or not names:
                continue
            text = path.read_text(encoding="utf-8")
            named = [n for n in names if re.search(rf"\b{n}\b", text)]
            assert named == [], f"{path.relative_to(ROOT)} names {named}, settings of {target}"


def test_docs_layout_names_every_module():
    """docs/layout.md names each module of ``xl/``: by its path, or by its file name in the row of its package."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        for folder in re.findall(r"`(xl/[\w/]+/)`", line):
            rows[folder] = rows.get(folder, "") + line
    missing = []
    for path in sorted((ROOT / "xl").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if path.name in ("__init__.py", "__main__.py") or f"`{relative}`" in text:
            continue
        folders = [parent.relative_to(ROOT).as_posix() + "/" for parent in path.parents if ROOT in parent.parents]
        inside = relative.removeprefix(next((f for f in folders if f in rows), ""))
        if not any(f in rows and re.search(rf"`{re.escape(inside)}`", rows[f]) for f in folders):
            missing.append(relative)
    assert missing == [], f"docs/layout.md does not name {missing}"
