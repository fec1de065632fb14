"""The package layering of docs/design.md holds: no upward import, no import cycle, no sys.modules;
and no library file, class or function grows past the size a reader can hold.

Imports are read from the source with `ast` (every import statement, including ones inside
functions and under TYPE_CHECKING: a lazy import is still a dependency), so the checks need no
import side effects and name the file and line of each violation.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "arealite")

# docs/design.md's import rule: the arealite packages each package may import besides itself.
BASE = {"api", "utils"}
ALLOWED: dict[str, set[str]] = {
    "utils": set(),
    "api": {"utils"},
    "checkpoint": set(),  # checkpoint files: written whole, read without running code
    "engine": BASE | {"checkpoint"},
    "lifecycle": set(),  # processes die with their launcher; one owner per run directory
    "inference": BASE | {"lifecycle"},
    "rollout": BASE,
    "trainer": BASE | {"lifecycle", "checkpoint"},
    "openai_wire": BASE,  # the OpenAI chat-completions format, for server and agent
    "server": BASE | {"openai_wire", "lifecycle"},
    "dataset": BASE,  # the user's data as canonical rows, and the row building blocks
    "tasks": BASE | {"dataset"},  # built-in tasks: loader + reward + options, one registry
    "reward": BASE | {"tasks"},  # spec -> callable (built-ins by short name), worker pool
    "workflow": BASE | {"reward"},
    "agent": BASE | {"openai_wire", "workflow", "rollout", "reward"},
    "launcher": BASE
    | {"tasks", "reward", "lifecycle"},  # preflight opens the data, calls the rewards
    "testing": BASE,  # imported by tests, benchmarks and examples only
}
# whole runs built from the config (GRPOTrainer): every package but the launchers and testing
ALLOWED["recipes"] = set(ALLOWED) - {"launcher", "testing", "recipes"}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def library_modules() -> dict[str, str]:
    """Dotted name -> file of every module under arealite/."""
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                out[module_name(path)] = path
    return out


MODULES = library_modules()


def imported_modules(path: str, from_packages: bool = False) -> Iterator[tuple[str, int]]:
    """(arealite module, line) for every import in `path`; `from pkg import name` counts as
    `pkg.name` when that is a module, else as `pkg` (and as `pkg` too with `from_packages`:
    the name is looked up in pkg's `__init__.py` first, a submodule or not)."""
    tree = ast.parse(open(path).read(), path)
    this = module_name(path)
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = this.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in MODULES else base), node.lineno
                if from_packages and sub in MODULES:
                    yield base, node.lineno


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "arealite" and len(parts) > 1 else None


def upward_imports(modules: dict[str, str]) -> list[str]:
    errors = []
    for name, path in sorted(modules.items()):
        pkg = package_of(name)
        for target, line in imported_modules(path):
            tpkg = package_of(target)
            if not target.startswith("arealite") or tpkg == pkg:
                continue
            rel = os.path.relpath(path, ROOT)
            if pkg is None:
                errors.append(f"{rel}:{line}: arealite/__init__.py imports {target}")
            elif pkg not in ALLOWED:
                errors.append(f"{rel}:{line}: package {pkg!r} has no rule in docs/design.md")
            elif tpkg not in ALLOWED[pkg]:
                may = sorted(ALLOWED[pkg]) or "no other arealite package"
                errors.append(f"{rel}:{line}: {pkg} imports {target} (it may import {may})")
    return errors


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_dependencies(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The modules importing `name` runs: what it imports, the package `__init__.py` files
    above each of those (Python runs them first) unless they are `name`'s own, already being
    imported, and the `__init__.py` a `from pkg import x` reads x from, its own included
    (`arealite/pkg/__init__.py` importing `arealite.pkg.mod`, which runs `from arealite.pkg
    import x`, is a cycle)."""
    own = set(_parents(name))
    deps = set()
    for target, _ in imported_modules(path):
        deps.add(target)
        deps.update(p for p in _parents(target) if p not in own)
    deps.update(t for t, _ in imported_modules(path, from_packages=True))
    return {d for d in deps if d in modules and d != name}


def import_cycles(modules: dict[str, str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm) over
    import_dependencies, so a cycle through a package's `__init__.py` counts."""
    graph = {
        name: sorted(import_dependencies(name, path, modules)) for name, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def sys_modules_lookups(modules: dict[str, str]) -> list[str]:
    hits = []
    for _, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "modules"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                hits.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return hits


def _names_arealite(node: ast.AST) -> bool:
    """A string (or an f-string's head) naming an arealite module."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value == "arealite" or node.value.startswith("arealite."))
    )


def string_imports(modules: dict[str, str]) -> list[str]:
    """`importlib.import_module("arealite...")`, `__import__("arealite...")` and
    "arealite.pkg.module:name" specs: imports the checks above cannot see. Import
    such a module with an import statement, where the layering allows it."""
    hits = []
    for _, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(open(path).read(), path)):
            func = node.func if isinstance(node, ast.Call) else None
            fname = getattr(func, "attr", None) or getattr(func, "id", None)
            if fname in ("import_module", "__import__") and node.args:
                if _names_arealite(node.args[0]):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"arealite(\.\w+)+:\w+", node.value):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return hits


def test_no_upward_import():
    assert upward_imports(MODULES) == []


def test_no_import_cycle():
    """A TYPE_CHECKING back-reference counts (a contract typing its owner, which imports it, is
    a cycle): type the owner with a Protocol in the lower module, or pass it only what it uses."""
    assert import_cycles(MODULES) == []


def test_no_sys_modules_lookup():
    assert sys_modules_lookups(MODULES) == []


def test_no_arealite_module_imported_by_a_string():
    assert string_imports(MODULES) == []


def test_library_never_imports_testing():
    assert not [e for e in upward_imports(MODULES) if "arealite.testing" in e]
    users = [
        f"{os.path.relpath(p, ROOT)}:{line}"
        for n, p in MODULES.items()
        if package_of(n) != "testing"
        for t, line in imported_modules(p)
        if package_of(t) == "testing"
    ]
    assert users == []


def test_every_package_says_what_lives_there_and_what_it_may_import():
    """Each package's __init__.py docstring: what lives there, and its import rule."""
    missing = []
    for path in sorted(MODULES.values()):
        if path.endswith("__init__.py"):
            doc = ast.get_docstring(ast.parse(open(path).read())) or ""
            if "import" not in doc.lower():
                missing.append(os.path.relpath(path, ROOT))
    assert missing == []


# Hard caps: past them a module, class or function no longer fits in one reader's head. They are
# generous on purpose; the tighter figures a reviewer asks about are in docs/guide.md (Layout).
MAX_LINES = {"file": 600, "class": 350, "function": 80}


def oversized(modules: dict[str, str]) -> list[str]:
    """Library files, classes and functions over MAX_LINES, as `path[:name]: kind N lines`."""
    out = []
    for _, path in sorted(modules.items()):
        src, rel = open(path).read(), os.path.relpath(path, ROOT)
        if (n_lines := src.count("\n")) > MAX_LINES["file"]:
            out.append(f"{rel}: file {n_lines} lines")
        for node in ast.walk(ast.parse(src, path)):
            kind = {ast.ClassDef: "class", ast.FunctionDef: "function"}.get(type(node))
            kind = "function" if isinstance(node, ast.AsyncFunctionDef) else kind
            n = node.end_lineno - node.lineno + 1 if kind else 0
            if kind and n > MAX_LINES[kind]:
                out.append(f"{rel}:{node.name}: {kind} {n} lines")
    return out


def test_files_classes_and_functions_stay_small():
    assert oversized(MODULES) == []


# ----------------------------------------------------------------------------- the checks fail


def _fake_tree(tmp_path, files: dict[str, str]) -> dict[str, str]:
    out = {}
    for rel, src in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
        out[rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")] = str(path)
    return out


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", str(tmp_path))
    return tmp_path


def test_the_checks_catch_violations(fake_root, monkeypatch):
    modules = _fake_tree(
        fake_root,
        {
            "arealite/utils/a.py": "def f():\n    from arealite.api.b import x\n",
            "arealite/api/b.py": "from arealite.api import c\nx = 1\n",
            "arealite/api/c.py": "import arealite.api.b\n",
            "arealite/engine/d.py": "import sys\nm = sys.modules['arealite.api.b']\n",
            "arealite/dataset/e.py": "from arealite.testing import tiny\n",
            "arealite/testing/tiny.py": "",
        },
    )
    monkeypatch.setattr(f"{__name__}.MODULES", modules)
    assert upward_imports(modules) == [
        "arealite/dataset/e.py:1: dataset imports arealite.testing.tiny (it may import "
        "['api', 'utils'])",
        "arealite/utils/a.py:2: utils imports arealite.api.b (it may import no other "
        "arealite package)",
    ]
    assert import_cycles(modules) == [["arealite.api.b", "arealite.api.c"]]
    assert sys_modules_lookups(modules) == ["arealite/engine/d.py:2"]
    cyclic = _fake_tree(
        fake_root,
        {
            "arealite/tasks/__init__.py": "from arealite.tasks.registry import TASKS\n",
            "arealite/tasks/registry.py": "from arealite.tasks import arith\nTASKS = {}\n",
            "arealite/tasks/arith.py": "from arealite.dataset.rows import rl_row\n",
            "arealite/dataset/__init__.py": "",
            "arealite/dataset/rows.py": "",
            "arealite/reward/resolve.py": (
                "import importlib\nm = importlib.import_module('arealite.reward.arith')\n"
                "n = __import__(f'arealite.{m}')\nB = {'arith': 'arealite.reward.arith:fn'}\n"
                "log = 'arealite.reward'\n"
            ),
        },
    )
    monkeypatch.setattr(f"{__name__}.MODULES", cyclic)
    assert import_cycles(cyclic) == [["arealite.tasks", "arealite.tasks.registry"]]
    assert import_dependencies("arealite.tasks.arith", cyclic["arealite.tasks.arith"], cyclic) == {
        "arealite.dataset",
        "arealite.dataset.rows",
    }
    assert string_imports(cyclic) == [
        "arealite/reward/resolve.py:2",
        "arealite/reward/resolve.py:3",
        "arealite/reward/resolve.py:4",
    ]
    monkeypatch.setattr(f"{__name__}.MODULES", modules)
    long_body = "    x = 1\n" * 81
    big = _fake_tree(fake_root, {"arealite/utils/big.py": f"async def g():\n{long_body}"})
    assert oversized(big) == ["arealite/utils/big.py:g: function 82 lines"]
    fits = _fake_tree(fake_root, {"arealite/utils/fits.py": "def f():\n" + "    x = 1\n" * 79})
    assert oversized(fits) == []
