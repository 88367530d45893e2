"""Every name is imported from where it lives (issue 45): a module's ``__all__`` lists only
what the module defines, packages' ``__init__`` files re-export nothing, and no import
inside the project goes through a module that merely re-exports the name. Checked on the
source with :mod:`ast` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("mesh", "bench", "tests", "examples")
SKIP = ("mesh/template/builtin/", "templates/")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted((ROOT / "mesh").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(SKIP):
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import):  # `import llama_cpp.llama_cpp as ll`: the adapter's
            names.update(a.asname for a in node.names if a.asname)  # gateway to the bindings
        elif isinstance(node, ast.If | ast.Try):  # definitions under a guard count too
            inner = ast.Module(body=[*node.body, *getattr(node, "orelse", [])],
                               type_ignores=[])
            names |= _defined(inner)
    return names


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def test_all_lists_only_what_the_module_defines() -> None:
    bad = {name: missing for name, tree in TREES.items()
           if (missing := sorted(set(_all(tree)) - _defined(tree)))}
    assert not bad, f"re-exported through __all__ (import them from where they live): {bad}"


def test_package_inits_import_nothing_of_the_project() -> None:
    bad = [name for name, path in MODULES.items() if path.name == "__init__.py"
           and any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("mesh")
                   for n in TREES[name].body)]
    assert not bad, f"these packages re-export: {bad}"


def test_every_project_import_names_the_defining_module() -> None:
    bad: list[str] = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(SKIP):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                tree = TREES.get(node.module)
                if tree is None:
                    continue
                defined = _defined(tree)
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if alias.name not in defined and sub not in MODULES:
                        bad.append(f"{rel}:{node.lineno}: {alias.name} from {node.module}")
    assert not bad, "import these from the module that defines them:\n" + "\n".join(bad)
