"""Outlines of project files: the shape of a file in a fraction of its tokens.

Python files list their classes and functions with signatures and the first line of each
docstring; Markdown files list their headings; TOML files their tables; anything else its
first lines. Outlines are pure functions of the text, so the prefix stays deterministic.
"""

from __future__ import annotations

import ast

__all__ = ["outline"]

_HEAD_LINES = 20


def _first_line(node: ast.AST) -> str:
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        doc = ast.get_docstring(node)
        if doc:
            return doc.strip().splitlines()[0]
    return ""


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}"


def _python(text: str) -> str:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return _head(text, note="(not parseable as Python; first lines)")
    lines: list[str] = []
    if doc := _first_line(tree):
        lines.append(f'"""{doc}"""')
    for node in tree.body:
        lines.extend(_node(node, indent=""))
    return "\n".join(lines) if lines else "(no definitions)"


def _node(node: ast.stmt, indent: str) -> list[str]:
    out: list[str] = []
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        out.extend(f"{indent}@{ast.unparse(d)}" for d in node.decorator_list)
        out.append(f"{indent}{_signature(node)}")
        if doc := _first_line(node):
            out.append(f'{indent}    """{doc}"""')
    elif isinstance(node, ast.ClassDef):
        out.extend(f"{indent}@{ast.unparse(d)}" for d in node.decorator_list)
        bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
        out.append(
            f"{indent}class {node.name}({bases}):" if bases else f"{indent}class {node.name}:"
        )
        if doc := _first_line(node):
            out.append(f'{indent}    """{doc}"""')
        for child in node.body:
            if isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                out.append(f"{indent}    {child.target.id}: {ast.unparse(child.annotation)}")
            else:
                out.extend(_node(child, indent + "    "))
    elif isinstance(node, ast.Assign | ast.AnnAssign) and not indent:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper():
                out.append(f"{target.id} = ...")
    return out


def _markdown(text: str) -> str:
    heads = [line for line in text.splitlines() if line.startswith("#")]
    return "\n".join(heads) if heads else _head(text)


def _toml(text: str) -> str:
    tables = [line for line in text.splitlines() if line.lstrip().startswith("[")]
    return "\n".join(tables) if tables else _head(text)


def _head(text: str, note: str = "") -> str:
    lines = text.splitlines()
    head = lines[:_HEAD_LINES]
    if len(lines) > _HEAD_LINES:
        head.append(f"... ({len(lines) - _HEAD_LINES} more lines)")
    return "\n".join([note, *head] if note else head)


def outline(rel: str, text: str) -> str:
    """The outline of the file at root-relative path ``rel`` whose content is ``text``."""
    if rel.endswith((".py", ".pyi")):
        return _python(text)
    if rel.endswith((".md", ".rst")):
        return _markdown(text)
    if rel.endswith(".toml"):
        return _toml(text)
    return _head(text)
