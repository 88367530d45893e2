"""Outlines of project files: the shape of a file in a fraction of its tokens.

Two views, both pure functions of the text (so the prefix stays deterministic):

* :func:`outline` is one file's outline for a ``files`` section in ``outline`` mode:
  Python classes and functions with signatures and the first line of each docstring,
  Markdown headings, TOML tables, else the first lines;
* :func:`file_entry` is one file's line in the *project outline* (the ``outline``
  section): path, size, summary, and its top-level names with line numbers (public
  classes, functions and upper-case constants; headings; tables). :func:`reference_counts`
  says how often the project names each file, the order in which files earn room;
  :func:`matching` ranks outline entries by the words of a request (a small model copies
  best what is near its question: a worker's first message repeats the best lines).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

__all__ = ["Definition", "FileEntry", "file_entry", "human_size", "matching", "outline",
           "reference_counts"]

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


# --------------------------------------------------------------------------- the project outline
# One line per file: what a small model needs to point at the right file without opening it.

_SUMMARY_CHARS = 60
_DANGLING_DOC = re.compile(r"[:;,(]\s*$")
_ROLE = re.compile(r":[a-z]+:(?=`)")


@dataclass(frozen=True)
class Definition:
    """A top-level name of a file: ``kind`` is ``class``, ``def``, ``const`` (an upper-case
    module constant of two letters or more), ``heading`` (Markdown) or ``table`` (TOML);
    ``line`` is 1-based."""

    kind: str
    name: str
    line: int
    value: str = ""  # a constant's value when it is a short literal ("30", "'light'")


@dataclass(frozen=True)
class FileEntry:
    """One file as the project outline shows it. ``num_lines`` is None for a file that is
    not text (binary or too large to read); ``summary`` is the first sentence of a Python
    module's docstring or a Markdown file's first heading."""

    path: str
    num_bytes: int
    num_lines: int | None
    summary: str = ""
    definitions: tuple[Definition, ...] = ()

    def line(self, max_definitions: int, *, summary: bool = True) -> str:
        """The outline line, ``path (size): summary | class A L12, def b L40, C L7 +2``:
        the summary (with ``summary``), at most ``max_definitions`` names (classes first,
        then functions, then the rest; shown in file order), then how many were left out."""
        size = (f"{self.num_lines} lines" if self.num_lines is not None
                else f"{human_size(self.num_bytes)}, not text")
        out = f"{self.path} ({size})"
        if self.summary and summary:
            out += f": {self.summary}"
        if self.definitions and max_definitions > 0:
            rank = {"class": 0, "def": 1}
            chosen = sorted(self.definitions, key=lambda d: (rank.get(d.kind, 2), d.line))
            shown = sorted(chosen[:max_definitions], key=lambda d: d.line)
            names = ", ".join(f"{d.kind + ' ' if d.kind in rank else ''}{d.name}"
                              f"{' = ' + d.value if d.value else ''} L{d.line}" for d in shown)
            more = len(self.definitions) - len(shown)
            out += (" | " if self.summary and summary else ": ") + names + (
                f" +{more}" if more else "")
        return out


def human_size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    if num_bytes < 1024 * 1024:
        return f"{num_bytes / 1024:.0f} KB"
    return f"{num_bytes / (1024 * 1024):.1f} MB"


def _summary(doc: str) -> str:
    """The first sentence of ``doc`` (up to a period, colon or line end), at most
    :data:`_SUMMARY_CHARS` characters, cut at a word."""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    first = _ROLE.sub("", first).replace("`", "").replace("~", "")  # RST roles and quotes
    first = re.split(r"(?<=[a-z0-9)`'\"])[.:;](?:\s|$)", first, maxsplit=1)[0].strip()
    if len(first) > _SUMMARY_CHARS:
        first = first[:_SUMMARY_CHARS].rsplit(" ", 1)[0]
        first = _DANGLING_DOC.sub("", first) + "..."
    return first.rstrip(".")


_VALUE_CHARS = 16


def _literal(node: ast.expr | None) -> str:
    """A constant's value as written, when it is a short literal (a number, a string)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        node = node.operand if isinstance(node.op, ast.UAdd) else node
    if isinstance(node, ast.Constant | ast.UnaryOp) and not isinstance(
            getattr(node, "value", None), bytes):
        text = ast.unparse(node)
        return text if len(text) <= _VALUE_CHARS else ""
    return ""


def _python_definitions(text: str) -> tuple[str, tuple[Definition, ...]] | None:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    defs: list[Definition] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if not node.name.startswith("_"):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                defs.append(Definition(kind, node.name, node.lineno))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = _literal(node.value)
            defs.extend(Definition("const", t.id, node.lineno, value) for t in targets
                        if isinstance(t, ast.Name) and t.id.isupper() and t.id[0] != "_"
                        and len(t.id) > 1)
    return _summary(ast.get_docstring(tree) or ""), tuple(defs)


def _markdown_definitions(text: str) -> tuple[str, tuple[Definition, ...]]:
    defs: list[Definition] = []
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip()
            if title:
                defs.append(Definition("heading", title[:_SUMMARY_CHARS], no))
    if defs and defs[0].line <= 3:  # the title is the summary, the rest its sections
        return _summary(defs[0].name), tuple(defs[1:])
    return "", tuple(defs)


def _toml_definitions(text: str) -> tuple[Definition, ...]:
    return tuple(Definition("table", line.strip(), no)
                 for no, line in enumerate(text.splitlines(), 1)
                 if line.startswith("[") and line.rstrip().endswith("]"))


def file_entry(rel: str, text: str | None, num_bytes: int) -> FileEntry:
    """The outline entry of the file at ``rel`` (``text`` None: not readable as text)."""
    if text is None:
        return FileEntry(rel, num_bytes, None)
    num_lines = len(text.splitlines())
    if rel.endswith((".py", ".pyi")):
        parsed = _python_definitions(text)
        if parsed is not None:
            return FileEntry(rel, num_bytes, num_lines, *parsed)
    elif rel.endswith((".md", ".rst")):
        return FileEntry(rel, num_bytes, num_lines, *_markdown_definitions(text))
    elif rel.endswith(".toml"):
        return FileEntry(rel, num_bytes, num_lines, "", _toml_definitions(text))
    return FileEntry(rel, num_bytes, num_lines)


# A word that may name a file: a path (a/b.py), a dotted module (a.b) or a file name (b.py).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*")


def _keys(rel: str, unique_names: set[str]) -> list[str]:
    """The words by which other files may refer to ``rel``."""
    keys = [rel]
    if rel.endswith(".py"):
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        if "." in module:  # a bare top-level name ("mesh", "tests") is any word's match
            keys.append(module)
    name = rel.rsplit("/", 1)[-1]
    if name in unique_names and name != rel:
        keys.append(name)
    return keys


def reference_counts(texts: Mapping[str, str]) -> dict[str, int]:
    """How many other files of ``texts`` (path -> text) name each file: by its path, its
    dotted module name (Python) or its file name when no other file has that name. One
    pass over the words of every text (linear in the project's size)."""
    names = [rel.rsplit("/", 1)[-1] for rel in texts]
    counts = Counter(names)
    unique = {n for n in names if counts[n] == 1 and "." in n}
    owner: dict[str, str] = {}
    for rel in texts:
        for key in _keys(rel, unique):
            owner.setdefault(key, rel)
    referrers: dict[str, set[str]] = {rel: set() for rel in texts}
    for rel, text in texts.items():
        for word in set(_NAME.findall(text)):
            word = word.rstrip("./-")
            target = owner.get(word)
            if target is None and "." in word:
                # mesh.engine.pool.SharedKVPool names mesh.engine.pool
                head = word.rsplit(".", 1)[0]
                target = owner.get(head)
            if target is not None and target != rel:
                referrers[target].add(rel)
    return {rel: len(who) for rel, who in referrers.items()}


# --------------------------------------------------------------------------- matching
# Words a request is made of that say nothing about which file it is about.
_COMMON = frozenset((
    "a", "an", "the", "of", "in", "on", "at", "to", "for", "from", "by", "with", "and", "or",
    "is", "are", "was", "be", "it", "its", "this", "that", "these", "what", "which", "who",
    "where", "when", "how", "why", "does", "do", "did", "can", "file", "files", "defines",
    "define", "defined", "holds", "hold", "class", "function", "method", "constant", "module",
    "project", "code", "there", "many", "much", "value", "name", "named", "me", "tell"))
_WORDS = re.compile(r"[A-Za-z0-9]+")
_MATCHED_NAMES = 3  # names a matched entry keeps: those the request names first


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _split(name: str) -> list[str]:
    """A name's words: ``SharedKVPool`` -> shared, kv, pool; ``plan_route`` -> plan, route."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", name)
    return [w.lower() for w in _WORDS.findall(spaced)]


def matching(request: str, entries: Sequence[FileEntry], limit: int = 3,
             least: float = 2.0) -> list[FileEntry]:
    """The ``limit`` outline entries that best match ``request``, best first, each with
    only the names that share a word with it (all of them when none does); none unless
    the best scores ``least``, and none under half the best. A word of the request counts
    once where the entry's path, summary or names hold it (``Parcel`` holds "parcel"),
    twice more where it is a name the entry defines; a run of two or three words counts
    again where the entry writes them as one (the summary "The shared KV pool", the class
    ``SharedKVPool``: "shared KV pool"), and more in a name it defines. Plurals match
    their singular. Pure; linear in the outline's size."""
    words = [w.lower() for w in _WORDS.findall(request)]
    keys = [w for w in words if w not in _COMMON and len(w) > 1]
    if not keys:
        return []
    stems = {k.rstrip("s") for k in keys}
    runs = [_squash("".join(words[i:i + n])) for n in (2, 3) for i in range(len(words) - n + 1)
            if not all(w in _COMMON for w in words[i:i + n])]
    scored: list[tuple[float, str, FileEntry]] = []
    for entry in entries:
        names = [d.name for d in entry.definitions]
        own = {w.rstrip("s") for part in (entry.path, entry.summary, *names)
               for w in (*_split(part), _squash(part))}
        text = _squash(" ".join((entry.path, entry.summary, *names)))
        defined = {_squash(n) for n in names}
        score = sum(1.0 + 2.0 * (k in defined) for k in keys if k.rstrip("s") in own)
        if not score:
            continue
        for run in runs:
            if run in text:
                score += 1.0
            if run in defined:
                score += 2.0
        scored.append((-score, entry.path, entry))
    scored.sort(key=lambda item: (item[0], item[1]))
    if not scored or -scored[0][0] < least:
        return []
    scored = [s for s in scored if s[0] <= scored[0][0] / 2]  # at least half the best
    asked = _squash(request)
    out: list[FileEntry] = []
    for _, _, entry in scored[:limit]:
        exact = [d for d in entry.definitions
                 if len(_squash(d.name)) > 2 and _squash(d.name) in asked]
        near = [d for d in entry.definitions if d not in exact
                and {w.rstrip("s") for w in _split(d.name)} & stems]
        said = (exact + near)[:_MATCHED_NAMES]
        out.append(replace(entry, definitions=tuple(said)) if said else entry)
    return out
