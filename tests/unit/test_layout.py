"""The house's rules, checked on the source: packages import downward only (docs/layout.md lists their order), and a
memory variant's settings are named only by its own module, its config file, its benchmark, the tests and the
docs."""

from __future__ import annotations

import ast
import re

from tests.helpers.paths import ROOT
from xl.model.memory_settings import MemoryConfig, config_class

SHARED = ("xl.memory.store",)  # every memory's


def imported(path) -> list[str]:
    """Every module an ``import`` names in the file, function-level imports included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def layers() -> list[str]:
    """The packages in their order, lowest first, as docs/layout.md lists them."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    return re.findall(r"^\d+\. `(xl[\w.]*)`", text.split("## Layers", 1)[1].split("\n## ", 1)[0], re.M)


def module_name(path, root=ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path, root=ROOT) -> list[tuple[int, str]]:
    """Each ``import`` of ``xl`` in the file (function-level and ``TYPE_CHECKING`` ones included), relative ones
    resolved: (line, module imported). ``from package import name`` imports module ``package.name`` where that is a
    module, else ``package``."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                path_of = root / sub.replace(".", "/")
                is_module = path_of.with_suffix(".py").exists() or (path_of / "__init__.py").exists()
                found.append((node.lineno, sub if is_module else base))
    return sorted({(line, name) for line, name in found if name == "xl" or name.startswith("xl.")})


def layer_of(name: str, order: list[str]) -> int:
    """The place in ``order`` of the package that holds module ``name``: the longest listed prefix."""
    return max((i for i, package in enumerate(order) if name == package or name.startswith(package + ".")),
               key=lambda i: len(order[i]))


def test_layers_list_real_packages():
    order = layers()
    assert order[-1] == "xl" and len(set(order)) == len(order)
    for package in order:
        assert (ROOT / package.replace(".", "/") / "__init__.py").exists(), f"docs/layout.md lists {package}"


def test_every_kind_of_import_is_seen(tmp_path):
    """Module-level, function-level, ``TYPE_CHECKING``, relative and ``from package import module`` imports."""
    for name in ("xl/__init__.py", "xl/low/__init__.py", "xl/high/__init__.py", "xl/high/b.py", "xl/high/c.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    source = tmp_path / "xl" / "low" / "a.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "import xl.high.b\n"
                      "if TYPE_CHECKING:\n"
                      "    from xl.high.b import Thing\n"
                      "def f():\n"
                      "    from ..high import c\n"
                      "    from . import helper\n"
                      "    import os\n")
    assert imports(source, tmp_path) == [(2, "xl.high.b"), (4, "xl.high.b"), (6, "xl.high.c"), (7, "xl.low")]
    order = ["xl.low", "xl.high", "xl"]
    assert [layer_of(name, order) for _, name in imports(source, tmp_path)] == [1, 1, 1, 0]
    assert layer_of("xl.train", order) == 2 and layer_of(module_name(source, tmp_path), order) == 0


def test_packages_import_downward_only():
    """No module of ``xl/`` imports from a package later in the order of docs/layout.md."""
    order = layers()
    upward = []
    for path in sorted((ROOT / "xl").rglob("*.py")):
        here = layer_of(module_name(path), order)
        for line, name in imports(path):
            there = layer_of(name, order)
            if there > here:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {order[here]} imports {name} of {order[there]}")
    assert upward == [], "imports that run upward:\n" + "\n".join(upward)


def reads(name: str) -> str:
    """Where code reads or sets a memory's setting ``name``: off a memory's config (``memory.NAME``,
    ``settings.NAME``), as a key (``"NAME"``), a keyword (``NAME=``) or a command-line option (``--NAME``); the same
    word for something else (a tensor's ``stride()``) is not the setting."""
    return rf"\b(?:memory|settings)\.{name}\b|[\"']{name}[\"']|\b{name}=|--{name.replace('_', '-')}\b"


def test_a_variants_settings_are_named_only_beside_its_code():
    """``conf/memory/*.yaml`` name the variants; outside their module or package (with the modules of
    ``xl/memory`` it imports and its decoder) and the benchmark of that variant (``xl/bench/<name>.py``), no file
    of ``xl/`` reads or sets one of their settings (:func:`reads`)."""
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
            named = [n for n in names if re.search(reads(n), text)]
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
