"""Finding, loading and checking a template folder.

``load_template("light")`` and ``load_template("heavy")`` load the shipped folders in
``mesh/template/builtin/``; any other argument is a path to a user's folder (copy a shipped
one with :func:`export_template` and edit it). Everything that can be checked without a
project is checked here, at start: the TOML parses, the manifest validates, every file it
names exists inside the folder and parses as Jinja, and every turn file renders with a
sample context (so an unknown name is an error now, not in the middle of a task).
"""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mesh.template.manifest import Manifest, TemplateError
from mesh.template.outline import FileEntry
from mesh.template.render import Renderer

__all__ = [
    "BUILTIN_DIR",
    "BUILTIN_TEMPLATES",
    "MANIFEST_NAME",
    "Template",
    "export_template",
    "load_template",
    "sample_project_dir",
]

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
        enabled = list(self.manifest.tools.enabled)
        ctx: dict[str, Any] = {
            "template": self.name,
            "description": self.manifest.description,
            "tools": enabled,
            "syntax": syntax.model_dump(),
            "example_call": syntax.format("read_file", {"path": "README.md"}),
            "answer_example": f"{syntax.answer_open}The answer.{syntax.answer_close}",
        }
        ctx.update(extra)
        return ctx

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
        return self.render(
            self.manifest.turns.tool_result,
            call=call,
            output=output,
            is_error=is_error,
            turn=turn,
        )


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
        raise TemplateError(
            target, field, f"{size} bytes; template files may hold at most "
            f"{MAX_TEMPLATE_FILE_BYTES} (project text belongs in the project, not the template)"
        )


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
