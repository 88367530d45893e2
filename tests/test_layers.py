"""Layering rules, checked on the source: who may import what.

Every ``.py`` under ``mesh/``, ``bench/`` and ``tests/`` is parsed with :mod:`ast` (nothing is
imported), so an import inside a function, or under ``if TYPE_CHECKING:``, counts too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("mesh", "bench", "tests")
DATA_DIRS = ("mesh/template/builtin/", "templates/")  # sample projects: data, not code

LLAMA_ADAPTER = "mesh/engine/llama.py"  # the one module that imports llama_cpp
WEB = ("a2a", "starlette", "mesh.a2a", "mesh.agent", "mesh.fleet", "mesh.api", "mesh.cli")


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    line: int


@dataclass(frozen=True)
class Rule:
    """Files whose path starts with one of ``scope`` may not import anything in ``banned``."""

    name: str
    scope: tuple[str, ...]
    banned: tuple[str, ...]
    exempt: tuple[str, ...] = ()  # path prefixes inside ``scope`` the rule does not cover

    def covers(self, rel: str) -> bool:
        return rel.startswith(self.scope) and not rel.startswith(self.exempt)


RULES = (
    Rule(
        "only the llama.cpp adapter's backend module imports llama_cpp",
        scope=SCANNED,
        banned=("llama_cpp",),
        exempt=(LLAMA_ADAPTER,),
    ),
    Rule(
        "the engine knows nothing of A2A, HTTP or the layers above it",
        scope=("mesh/engine/",),
        banned=(
            "a2a",
            "starlette",
            "uvicorn",
            "httpx",
            "sse_starlette",
            "mesh.a2a",
            "mesh.agent",
            "mesh.fleet",
            "mesh.api",
            "mesh.worker",
            "mesh.gate",
            "mesh.cli",
        ),
    ),
    Rule(
        "remote engines speak HTTP (httpx) and nothing of A2A, Starlette or the layers above",
        scope=("mesh/backends/",),
        banned=(
            "a2a",
            "starlette",
            "uvicorn",
            "sse_starlette",
            "mesh.a2a",
            "mesh.agent",
            "mesh.fleet",
            "mesh.api",
            "mesh.worker",
            "mesh.gate",
            "mesh.cli",
            "mesh.engine.pool",
            "mesh.engine.llama",
        ),
    ),
    Rule(
        "the gate is pure: no model, no native library, no web",
        scope=("mesh/gate/",),
        banned=("llama_cpp", "mesh.engine.pool", "mesh.engine.llama", *WEB),
    ),
    Rule(
        "workers and templates stay off the web and the native engine",
        scope=("mesh/worker/", "mesh/template/"),
        banned=(*WEB, "mesh.engine.pool", "mesh.engine.llama"),
    ),
    Rule(
        "only the cluster package imports Ray (mesh serve --ray; nothing of Ray without it)",
        scope=SCANNED,
        banned=("ray",),
        exempt=("mesh/cluster/", "tests/cluster/", "bench/cluster/"),
    ),
    Rule(
        "only the CLI's --ray path reaches the cluster package",
        scope=("mesh/",),
        banned=("mesh.cluster",),
        exempt=("mesh/cluster/", "mesh/cli/compose.py"),
    ),
    Rule(
        "the cluster package is an engine: nothing of A2A, the web, workers or the gate",
        scope=("mesh/cluster/",),
        banned=(*WEB, "mesh.worker", "mesh.gate", "httpx"),
    ),
    Rule(
        "nothing below the CLI imports it",
        scope=("mesh/", "bench/"),
        banned=("mesh.cli",),
        # ``python -m mesh`` exists to run the CLI; tests/ may test the CLI.
        exempt=("mesh/cli/", "mesh/__main__.py"),
    ),
)


def module_name(rel: str) -> str:
    """Dotted name of a repo-relative path: ``mesh/engine/__init__.py`` -> ``mesh.engine``."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, rel: str) -> str:
    """The absolute package a ``from X import ...`` reads from, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    package = module_name(rel).split(".")
    if not rel.endswith("__init__.py"):
        package.pop()  # a plain module's package is its parent
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join([*base, node.module] if node.module else base)


def _literal_import(node: ast.Call) -> str | None:
    """``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports_in(source: str, rel: str) -> Iterator[Import]:
    """Every module ``source`` (the file at repo-relative ``rel``) imports, anywhere in it.

    ``from a.b import c`` yields both ``a.b`` and ``a.b.c``: ``c`` may be a submodule.
    """
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, rel)
            yield Import(base, node.lineno)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(f"{base}.{alias.name}", node.lineno)
        elif isinstance(node, ast.Call) and (name := _literal_import(node)):
            yield Import(name, node.lineno)


def is_within(module: str, banned: str) -> bool:
    return module == banned or module.startswith(banned + ".")


def violations(source: str, rel: str, rules: tuple[Rule, ...] = RULES) -> list[str]:
    found: list[str] = []
    seen: set[tuple[str, int, str]] = set()
    for rule in rules:
        if not rule.covers(rel):
            continue
        for imp in imports_in(source, rel):
            for banned in rule.banned:
                key = (rule.name, imp.line, banned)
                if is_within(imp.module, banned) and key not in seen:
                    seen.add(key)
                    found.append(f"{rel}:{imp.line}: imports {imp.module} ({rule.name})")
    return found


def source_files() -> list[str]:
    """Repo-relative paths of every scanned ``.py``, data folders left out."""
    files: list[str] = []
    for top in SCANNED:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            rel_dir = Path(dirpath).relative_to(ROOT).as_posix() + "/"
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d != "__pycache__" and not (rel_dir + d + "/").startswith(DATA_DIRS)
            )
            files += [rel_dir + f for f in sorted(filenames) if f.endswith(".py")]
    return files


def test_the_scan_sees_the_tree() -> None:
    files = source_files()
    assert LLAMA_ADAPTER in files
    assert "mesh/gate/__init__.py" in files
    assert "tests/test_layers.py" in files
    assert not [f for f in files if f.startswith(DATA_DIRS)]


def test_no_layer_imports_what_it_must_not() -> None:
    found: list[str] = []
    for rel in source_files():
        found += violations((ROOT / rel).read_text(encoding="utf-8"), rel)
    assert not found, "layering violations:\n" + "\n".join(found)


def test_the_adapter_does_import_llama_cpp() -> None:
    # Guards the checker: if it stopped seeing imports, every rule would pass vacuously.
    adapter = [rel for rel in source_files() if rel.startswith(LLAMA_ADAPTER)]
    assert any(is_within(i.module, "llama_cpp")
               for rel in adapter
               for i in imports_in((ROOT / rel).read_text(encoding="utf-8"), rel))


SNEAKY = """
import os
import llama_cpp.llama_cpp as ll

def later():
    from llama_cpp import Llama
    import importlib
    return importlib.import_module("llama_cpp")

if False:
    from ..a2a import app
    from . import pool
"""


def test_the_checker_reports_forbidden_imports() -> None:
    found = violations(SNEAKY, "mesh/gate/sneaky.py")
    assert "mesh/gate/sneaky.py:3: imports llama_cpp.llama_cpp" in found[0]
    lines = {f.split(":")[1] for f in found}
    assert lines == {"3", "6", "8", "11"}  # line 12, mesh.gate.pool, is the gate's own
    assert any("imports mesh.a2a" in f for f in found)  # relative, resolved
    only_llama = RULES[:1]
    assert len(violations(SNEAKY, "tests/x.py", only_llama)) == 3
    assert not violations(SNEAKY, LLAMA_ADAPTER, only_llama)  # the adapter may
    assert len(violations(SNEAKY, "mesh/engine/sampling.py", only_llama)) == 3  # nor its siblings


def test_relative_imports_resolve_inside_the_engine() -> None:
    found = violations("from . import pool\nfrom ..worker import loop\n", "mesh/engine/x.py")
    assert found == ["mesh/engine/x.py:2: imports mesh.worker (" + RULES[1].name + ")"]


@pytest.mark.parametrize("package", ["mesh.engine", "mesh.gate"])
def test_importing_the_package_loads_no_llama_cpp(package: str) -> None:
    code = (
        f"import sys, {package}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'llama_cpp')\n"
        "print(','.join(loaded))\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (
        f"import {package} loaded {done.stdout.strip() or '?'}; stderr: {done.stderr[-2000:]}"
    )


def test_serve_without_ray_loads_no_ray(tmp_path: Path) -> None:
    """``mesh serve`` without ``--ray``: its flags checked, its engine built (not started):
    no module of Ray is loaded."""
    code = (
        "import sys\n"
        "from mesh.cli import build_parser\n"
        "from mesh.cli.compose import build_engine, preflight\n"
        "from mesh.engine.config import EngineConfig\n"
        f"args = build_parser().parse_args(['serve', '--data-dir', {str(tmp_path)!r}, "
        "'--port', '0'])\n"
        "sock, checked = preflight(args)\n"
        "sock.close()\n"
        "build_engine(args, EngineConfig(model_path='unused'), 'prefix')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'mesh.cluster')"
        " or m.startswith('mesh.cluster'))\n"
        "print(','.join(loaded))\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (
        f"mesh serve without --ray loaded {done.stdout.strip() or '?'}; "
        f"stderr: {done.stderr[-2000:]}"
    )


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (anywhere in it, TYPE_CHECKING too)."""
    prefix = package.replace(".", "/") + "/"
    mods = {module_name(rel): rel for rel in source_files() if rel.startswith(prefix)}
    graph: dict[str, set[str]] = {}
    for mod, rel in mods.items():
        source = (ROOT / rel).read_text(encoding="utf-8")
        graph[mod] = {i.module for i in imports_in(source, rel) if i.module in mods} - {mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None when the graph has none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt, [*path, node]):
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start, []):
            return cycle
    return None


def test_the_engine_has_no_import_cycles() -> None:
    graph = import_graph("mesh.engine")
    assert graph.get("mesh.engine.pool"), "the scan sees no imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in mesh/engine: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"y2"}, "y2": {"y"}}) == ["y", "y2", "y"]
