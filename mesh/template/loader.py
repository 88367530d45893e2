"""A template: its manifest (``template.toml``), Jinja rendering, the outline of project
files it puts in the prefix, and finding and loading a template folder.

**The manifest** (templates/README.md lists the keys): the prefix's ordered ``sections``,
a worker's tool-call syntax and turns, its tools, the agent card's skills and the simulated
scenario's defaults. Every model forbids unknown keys: a typo is an error naming the field.

**Rendering** is sandboxed (template files are data a user may have edited or downloaded;
the loader reads only inside the folder) and strict: a name the context lacks is a
:class:`TemplateError` naming the file.

**The outline** (:func:`outline`, :func:`file_entry`, :func:`reference_counts`,
:func:`matching`) is pure, so the prefix stays deterministic.

**Loading** (:func:`load_template`) checks all that can be checked without a project: TOML,
manifest, every named file inside the folder, Jinja syntax, and a render of every file with
a sample context.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import shutil
import tomllib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import jinja2
from jinja2.sandbox import SandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "BUILTIN_DIR", "BUILTIN_TEMPLATES", "MANIFEST_NAME", "Definition", "Distribution",
    "FileEntry", "FilesSection", "FixedDist", "LogNormalDist", "Manifest", "OutlineSection",
    "PrefixSpec", "Renderer", "ScenarioSpec", "Section", "Skill", "Template", "TemplateError",
    "TextSection", "ToolCallSyntax", "ToolsSpec", "TreeSection", "TurnSpec", "UniformDist",
    "export_template", "file_entry", "human_size", "load_template", "matching", "outline",
    "reference_counts", "sample_project_dir"
]


# -------------------- the manifest --------------------------------------------

ToolName = Literal["list_files", "read_file", "grep", "delegate"]


class TemplateError(ValueError):
    """A template (or a prefix directory) is malformed. Names the file and, if any, field.

    A ``ValueError``: it is bad input, and callers that report bad input (``mesh serve``
    prints ``ValueError`` and exits 2) report this one too instead of a traceback.
    """

    def __init__(self, file: Path | str, field: str | None, message: str) -> None:
        self.file = str(file)
        self.field = field
        self.message = message
        where = f"{self.file}: {field}" if field else self.file
        super().__init__(f"{where}: {message}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


NonEmpty = Annotated[str, Field(min_length=1)]
Share = Annotated[float, Field(gt=0.0, le=1.0)]

# --------------------------------------------------------------------------- prefix


class TextSection(_Model):
    """A template file rendered with Jinja (system prompt, tool docs, guidelines)."""

    kind: Literal["text"]
    file: NonEmpty


class TreeSection(_Model):
    """The project's file tree, sorted, at most ``max_entries`` lines."""

    kind: Literal["tree"]
    title: NonEmpty = "Project tree"
    max_entries: int = Field(200, ge=1)
    share: Share = 1.0  # most of the target this section may take


class OutlineSection(_Model):
    """The project outline: one line for every file the scan sees (path, size, summary,
    top-level names with line numbers; :func:`mesh.template.loader.file_entry`), at most
    ``max_definitions`` names a line. Over the section's share, the folders the project
    names least (:func:`mesh.template.loader.reference_counts`) are folded into one line
    each (how many files, how large) until it fits."""

    kind: Literal["outline"]
    title: NonEmpty = "Project outline"
    exclude: list[NonEmpty] = []
    max_definitions: int = Field(6, ge=0)
    share: Share = 1.0


class FilesSection(_Model):
    """Project files matching ``include``, full or outlined: in pattern order, or with
    ``order = "referenced"`` the files the project names most first.

    ``required`` files must exist (else the prefix build fails naming them); a file that is
    matched but binary, too large or over the budget is skipped and listed.
    """

    kind: Literal["files"]
    title: NonEmpty
    include: list[NonEmpty] = Field(min_length=1)
    exclude: list[NonEmpty] = []
    required: list[NonEmpty] = []
    mode: Literal["full", "outline"] = "full"
    order: Literal["pattern", "referenced"] = "pattern"
    max_tokens_per_file: int = Field(2000, ge=16)
    share: Share = 1.0


Section = Annotated[TextSection | TreeSection | OutlineSection | FilesSection,
                    Field(discriminator="kind")]


class PrefixSpec(_Model):
    target_tokens: int = Field(ge=64)
    fill: bool = True  # pad with a labelled appendix of project text up to the target
    max_file_bytes: int = Field(262_144, ge=1)
    include_hidden: bool = False
    exclude: list[NonEmpty] = []
    sections: list[Section] = Field(min_length=1)


# --------------------------------------------------------------------------- turns


class ToolCallSyntax(_Model):
    """How a tool call and a final answer look in generated text.

    ``style = "json"``: ``<open>{"name": "read_file", "arguments": {"path": "x"}}<close>``.
    ``style = "call"``: ``<open>read_file(path="x")<close>`` (Python call, literal args).
    """

    style: Literal["json", "call"]
    open: NonEmpty = "<tool_call>"
    close: NonEmpty = "</tool_call>"
    answer_open: NonEmpty = "<answer>"
    answer_close: NonEmpty = "</answer>"

    @model_validator(mode="after")
    def _distinct(self) -> ToolCallSyntax:
        tags = [self.open, self.close, self.answer_open, self.answer_close]
        if len(set(tags)) != len(tags):
            raise ValueError("open, close, answer_open and answer_close must all differ")
        return self

    def format(self, name: str, arguments: dict[str, object]) -> str:
        """One call in this syntax (used for examples and for scripted scenario calls)."""
        if self.style == "json":
            body = json.dumps({"name": name, "arguments": arguments}, sort_keys=True)
        else:
            body = f"{name}({', '.join(f'{k}={v!r}' for k, v in sorted(arguments.items()))})"
        return f"{self.open}{body}{self.close}"


class TurnSpec(_Model):
    instructions: NonEmpty  # Jinja file: the first user message's content
    tool_result: NonEmpty  # Jinja file: a tool result message's content
    max_turns: int = Field(8, ge=1)
    max_tokens_per_turn: int = Field(256, ge=1)
    max_total_tokens: int = Field(2048, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    # Sample each turn under the GBNF grammar of mesh.worker.grammar (false: the raw model).
    grammar: bool = True


class ToolsSpec(_Model):
    enabled: list[ToolName] = Field(min_length=1)
    max_output_tokens: int = Field(512, ge=16)


class Skill(_Model):
    id: NonEmpty
    name: NonEmpty
    description: NonEmpty
    tags: list[NonEmpty] = []
    examples: list[NonEmpty] = []


# --------------------------------------------------------------------------- scenario


class FixedDist(_Model):
    dist: Literal["fixed"]
    value: float = Field(ge=0.0)


class UniformDist(_Model):
    dist: Literal["uniform"]
    min: float = Field(ge=0.0)
    max: float = Field(ge=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> UniformDist:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class LogNormalDist(_Model):
    """Log-normal around ``median`` with shape ``sigma``, clipped to ``[min, max]``."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0.0)
    sigma: float = Field(ge=0.0)
    min: float = Field(0.0, ge=0.0)
    max: float = Field(gt=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> LogNormalDist:
        if not self.min <= self.median <= self.max:
            raise ValueError("need min <= median <= max")
        return self


Distribution = Annotated[FixedDist | UniformDist | LogNormalDist, Field(discriminator="dist")]


class ScenarioSpec(_Model):
    packages: int = Field(ge=1)
    steps: int = Field(ge=1)
    tokens_per_step: int = Field(ge=1)
    tools: list[NonEmpty] = Field(min_length=1)  # names the scripted calls use, in rotation
    tool_latency_s: Distribution
    tool_output_tokens: Distribution
    # true: each package is sent as plain text, so the coordinator plans it (a planner
    # session, its planned workers running real turns, a synthesis session); the step
    # schedule then does not apply. false (default): explicit subtasks, no planning.
    plan: bool = False


# --------------------------------------------------------------------------- manifest


class Manifest(_Model):
    version: Literal[1] = 1
    name: NonEmpty
    description: NonEmpty
    prefix: PrefixSpec
    tool_calls: ToolCallSyntax
    turns: TurnSpec
    tools: ToolsSpec
    skills: list[Skill] = Field(min_length=1)
    scenario: ScenarioSpec

    @field_validator("skills")
    @classmethod
    def _unique_skill_ids(cls, skills: list[Skill]) -> list[Skill]:
        ids = [s.id for s in skills]
        if len(set(ids)) != len(ids):
            raise ValueError(f"skill ids must be unique, got {ids}")
        return skills

    def files(self) -> list[tuple[str, str]]:
        """Every template file the manifest names, as ``(field, relative path)``."""
        out = [("turns.instructions", self.turns.instructions),
               ("turns.tool_result", self.turns.tool_result)]
        for i, section in enumerate(self.prefix.sections):
            if isinstance(section, TextSection):
                out.append((f"prefix.sections[{i}].file", section.file))
        return out

# -------------------- rendering -----------------------------------------------

class Renderer:
    """Renders the Jinja files of one template folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._env = SandboxedEnvironment(
            loader=jinja2.FileSystemLoader(str(root), followlinks=False),
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
            trim_blocks=True,
            lstrip_blocks=True,
        )

    def check(self, file: str, field: str) -> None:
        """Parse ``file`` (no rendering); a syntax error names the file, field and line."""
        with self._errors(file, field, {}):
            self._env.get_template(file)

    def render(self, file: str, context: Mapping[str, Any]) -> str:
        with self._errors(file, None, context):
            return self._env.get_template(file).render(dict(context))

    @contextlib.contextmanager
    def _errors(self, file: str, field: str | None,
                context: Mapping[str, Any]) -> Iterator[None]:
        """Jinja's errors about ``file`` as :class:`TemplateError` naming it."""
        where = self.root / file
        try:
            yield
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(where, field, f"Jinja syntax error on line {exc.lineno}: "
                                f"{exc.message}") from exc
        except jinja2.TemplateNotFound as exc:
            raise TemplateError(where, field, "file not found") from exc
        except jinja2.UndefinedError as exc:
            names = ", ".join(sorted(context))
            raise TemplateError(where, field,
                                f"{exc.message} (names available: {names})") from exc
        except jinja2.TemplateError as exc:  # SecurityError and other render-time errors
            raise TemplateError(where, field, f"render failed: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise TemplateError(where, field,
                                f"not UTF-8 text (byte {exc.start}); is it binary?") from exc

# -------------------- the outline ---------------------------------------------

_HEAD_LINES = 20


def _first_line(node: ast.AST) -> str:
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        doc = ast.get_docstring(node)
        if doc:
            return doc.strip().splitlines()[0]
    return ""


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _python(text: str) -> str:
    tree = _parse(text)
    if tree is None:
        return _head(text, note="(not parseable as Python; first lines)")
    lines: list[str] = []
    if doc := _first_line(tree):
        lines.append(f'"""{doc}"""')
    for node in tree.body:
        lines.extend(_node(node, indent=""))
    return "\n".join(lines) if lines else "(no definitions)"


def _node(node: ast.stmt, indent: str) -> list[str]:
    out: list[str] = []
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        out.extend(f"{indent}@{ast.unparse(d)}" for d in node.decorator_list)
        if isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
            out.append(f"{indent}class {node.name}" + (f"({bases}):" if bases else ":"))
        else:
            prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            out.append(f"{indent}{prefix} {node.name}({ast.unparse(node.args)}){returns}")
        if doc := _first_line(node):
            out.append(f'{indent}    """{doc}"""')
        for child in node.body if isinstance(node, ast.ClassDef) else ():
            if isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                out.append(f"{indent}    {child.target.id}: {ast.unparse(child.annotation)}")
            else:
                out.extend(_node(child, indent + "    "))
    elif isinstance(node, ast.Assign | ast.AnnAssign) and not indent:
        out.extend(f"{name} = ..." for name in _constants(node))
    return out


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
    kept: list[str] = []
    if rel.endswith((".md", ".rst")):  # the headings
        kept = [line for line in text.splitlines() if line.startswith("#")]
    elif rel.endswith(".toml"):  # the tables
        kept = [line for line in text.splitlines() if line.lstrip().startswith("[")]
    return "\n".join(kept) if kept else _head(text)


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


def _constants(node: ast.Assign | ast.AnnAssign) -> list[str]:
    """The upper-case names an assignment binds."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]


def _python_definitions(text: str) -> tuple[str, tuple[Definition, ...]] | None:
    tree = _parse(text)
    if tree is None:
        return None
    defs: list[Definition] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if not node.name.startswith("_"):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                defs.append(Definition(kind, node.name, node.lineno))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            value = _literal(node.value)
            defs.extend(Definition("const", name, node.lineno, value) for name in _constants(node)
                        if name[0] != "_" and len(name) > 1)
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
        tables = tuple(Definition("table", line.strip(), no)
                       for no, line in enumerate(text.splitlines(), 1)
                       if line.startswith("[") and line.rstrip().endswith("]"))
        return FileEntry(rel, num_bytes, num_lines, "", tables)
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
    """The ``limit`` outline entries that best match ``request``, best first, each keeping
    only the names that share a word with it (all when none does). None unless the best
    scores ``least``, none under half the best; when the best defines a name the request
    holds, only entries that define one too (the pool's file, not its test). A request word
    counts once where the entry's path, summary or names hold it, twice more in a defined
    name; a run of two or three words counts again where the entry writes them as one
    (``SharedKVPool``: "shared KV pool"), more in a defined name. Plurals match singulars."""
    words = [w.lower() for w in _WORDS.findall(request)]
    keys = [w for w in words if w not in _COMMON and len(w) > 1]
    if not keys:
        return []
    stems = {k.rstrip("s") for k in keys}
    runs = [_squash("".join(words[i:i + n])) for n in (2, 3) for i in range(len(words) - n + 1)
            if not all(w in _COMMON for w in words[i:i + n])]
    scored: list[tuple[float, bool, str, FileEntry]] = []
    for entry in entries:
        names = [d.name for d in entry.definitions]
        own = {w.rstrip("s") for part in (entry.path, entry.summary, *names)
               for w in (*_split(part), _squash(part))}
        text = _squash(" ".join((entry.path, entry.summary, *names)))
        defined = {_squash(n) for n in names}
        score = sum(1.0 + 2.0 * (k in defined) for k in keys if k.rstrip("s") in own)
        if not score:
            continue
        defines = any(k in defined for k in keys)
        for run in runs:
            if run in text:
                score += 1.0
            if run in defined:
                score += 2.0
                defines = True
        scored.append((-score, defines, entry.path, entry))
    scored.sort(key=lambda item: (item[0], item[2]))
    if not scored or -scored[0][0] < least:
        return []
    scored = [s for s in scored if s[0] <= scored[0][0] / 2]  # at least half the best
    if scored[0][1]:  # the best defines what was asked: so must the others
        scored = [s for s in scored if s[1]]
    asked = _squash(request)
    out: list[FileEntry] = []
    for _, _, _, entry in scored[:limit]:
        exact = [d for d in entry.definitions
                 if len(_squash(d.name)) > 2 and _squash(d.name) in asked]
        near = [d for d in entry.definitions if d not in exact
                and {w.rstrip("s") for w in _split(d.name)} & stems]
        said = (exact + near)[:_MATCHED_NAMES]
        out.append(replace(entry, definitions=tuple(said)) if said else entry)
    return out

# -------------------- loading -------------------------------------------------

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_TEMPLATES = ("light", "heavy")
MANIFEST_NAME = "template.toml"
# Discriminator values pydantic puts in an error's location; dropped when naming the field.
_UNION_TAGS = frozenset({"text", "tree", "outline", "files", "fixed", "uniform", "lognormal"})


@dataclass(frozen=True)
class Template:
    """A loaded, checked template. Immutable; render its files through the methods."""

    name: str
    root: Path
    manifest: Manifest
    renderer: Renderer
    # The project outline the prefix was built with (mesh.template.prefix.Prefix.outlined;
    # set once the template is bound to a project's prefix, empty before): a worker's first
    # message repeats the lines that match its request, and evidence cites their lines.
    outline: tuple[FileEntry, ...] = ()

    def context(self, **extra: Any) -> dict[str, Any]:
        """The names every template file may use, plus ``extra``."""
        syntax = self.manifest.tool_calls
        return {
            "template": self.name,
            "description": self.manifest.description,
            "tools": list(self.manifest.tools.enabled),
            "syntax": syntax.model_dump(),
            "example_call": syntax.format("read_file", {"path": "README.md"}),
            "answer_example": f"{syntax.answer_open}The answer.{syntax.answer_close}",
            **extra,
        }

    def render(self, file: str, **extra: Any) -> str:
        return self.renderer.render(file, self.context(**extra))

    def instructions(self, subtask_id: str, instructions: str,
                     outline_lines: Sequence[str] = ()) -> str:
        """The content of a worker session's first user message (no chat markup);
        ``outline_lines``: the project outline's lines that match the request."""
        subtask = {"id": subtask_id, "instructions": instructions}
        return self.render(self.manifest.turns.instructions, subtask=subtask,
                           outline_lines=list(outline_lines))

    def tool_result(self, *, call: str, output: str, is_error: bool, turn: int) -> str:
        """The content of the user message that reports a tool's result (no chat markup)."""
        return self.render(self.manifest.turns.tool_result, call=call, output=output,
                           is_error=is_error, turn=turn)


def sample_project_dir() -> Path:
    """The small project shipped with mesh, used when no ``--project`` is given."""
    return BUILTIN_DIR / "sample"


def default_project_dir() -> Path:
    """The project ``mesh serve`` describes without ``--project``: the current directory
    if it is a git checkout, else the sample project."""
    cwd = Path.cwd()
    return cwd if (cwd / ".git").exists() else sample_project_dir()


def export_template(name: str, dest: Path | str) -> Path:
    """Copy a shipped template folder to ``dest`` (which must not exist) to edit it."""
    if name not in BUILTIN_TEMPLATES:
        raise TemplateError(name, None, f"no shipped template named {name!r}")
    return Path(shutil.copytree(BUILTIN_DIR / name, Path(dest), symlinks=True))


def load_template(name_or_path: str | Path) -> Template:
    """Load ``light``/``heavy`` (shipped) or the template folder at a path; check it all."""
    if isinstance(name_or_path, str) and name_or_path in BUILTIN_TEMPLATES:
        root = BUILTIN_DIR / name_or_path
    else:
        root = Path(name_or_path).expanduser()
    if not root.is_dir():
        raise TemplateError(root, None, "not a template folder (no such directory)")
    root = root.resolve()
    path = root / MANIFEST_NAME
    manifest = _read_manifest(path)
    renderer = Renderer(root)
    for field, rel in manifest.files():
        _check_file(root, path, field, rel)
        renderer.check(rel, field)
    template = Template(name=manifest.name, root=root, manifest=manifest, renderer=renderer)
    _dry_render(template)
    return template


def _read_manifest(path: Path) -> Manifest:
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise TemplateError(path, None, "missing (every template folder needs one)") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(path, None, f"cannot read: {exc}") from exc
    try:
        data = tomllib.loads(raw)
    except tomllib.TOMLDecodeError as exc:
        raise TemplateError(path, None, f"invalid TOML: {exc}") from exc
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        more = f" (and {exc.error_count() - 1} more errors)" if exc.error_count() > 1 else ""
        raise TemplateError(path, _field_name(first["loc"]), first["msg"] + more) from exc


def _field_name(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in _UNION_TAGS and i + 1 < len(loc):
            continue
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "(top level)"


def _check_file(root: Path, manifest_path: Path, field: str, rel: str) -> None:
    """A file the manifest names must be a regular file inside the template folder."""
    rel_path = Path(rel)
    if rel_path.is_absolute() or ".." in rel_path.parts:
        raise TemplateError(manifest_path, field, f"{rel!r} must be relative to the folder")
    target = root / rel_path
    if not target.exists():
        raise TemplateError(manifest_path, field, f"file {rel!r} not found in {root}")
    if not target.resolve().is_relative_to(root):
        raise TemplateError(manifest_path, field, f"{rel!r} leaves the template folder")
    if not target.is_file():
        raise TemplateError(manifest_path, field, f"{rel!r} is not a regular file")
    size = target.stat().st_size
    if size > MAX_TEMPLATE_FILE_BYTES:
        raise TemplateError(target, field, f"{size} bytes; template files may hold at most "
                            f"{MAX_TEMPLATE_FILE_BYTES} (project text belongs in the project, "
                            "not the template)")


# Every rendered file ends up in the prefix or in every session's suffix: a file this big
# could never fit a context, and reading it would only slow the start down.
MAX_TEMPLATE_FILE_BYTES = 1_048_576


def _dry_render(template: Template) -> None:
    """Render every file once with sample values so a bad name fails at load."""
    m = template.manifest
    template.instructions("sample", "Say hello.", ["README.md (3 lines): sample"])
    template.tool_result(call="list_files()", output="README.md", is_error=False, turn=1)
    sample: Mapping[str, Any] = {"project": "sample", "target_tokens": m.prefix.target_tokens}
    for section in m.prefix.sections:
        if section.kind == "text":
            template.render(section.file, **sample)
