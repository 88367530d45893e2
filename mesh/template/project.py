"""A read-only, confined view of a project directory: its files, sorted, and their text.

The scan is deterministic (sorted, no timestamps, paths relative to the root in POSIX form)
and never leaves the root: directories are not followed through symlinks, a symlink whose
target lies outside the root is an error naming it, and hidden entries (``.git``, ``.env``,
``.venv``...) and build/cache folders are left out unless the template asks for hidden ones.

Glob patterns are anchored at the root: ``*`` and ``?`` stay inside one path component,
``**/`` matches any number of directories (``**/*.py`` is every Python file, ``*.md`` only
the top-level ones).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from mesh.template.manifest import TemplateError

__all__ = [
    "DEFAULT_EXCLUDED_DIRS",
    "MAX_SCAN_ENTRIES",
    "ProjectScan",
    "glob_match",
    "read_text",
    "scan_project",
]

DEFAULT_EXCLUDED_DIRS = frozenset(
    {"__pycache__", "node_modules", "build", "dist", "site-packages", "venv", "target"}
)
MAX_SCAN_ENTRIES = 50_000


@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def glob_match(pattern: str, rel: str) -> bool:
    """Does the root-relative POSIX path ``rel`` match ``pattern`` (see module doc)?"""
    return _glob_regex(pattern).fullmatch(rel) is not None


@dataclass(frozen=True)
class ProjectScan:
    """Every eligible entry of a project, sorted. ``links`` are in-tree symlinked dirs."""

    root: Path
    files: tuple[str, ...]
    dirs: tuple[str, ...]
    links: tuple[str, ...]


def _is_excluded(rel: str, name: str, excludes: tuple[str, ...], include_hidden: bool) -> bool:
    if name.startswith(".") and not include_hidden:
        return True
    if name in DEFAULT_EXCLUDED_DIRS or name.endswith(".egg-info"):
        return True
    return any(glob_match(p, rel) for p in excludes)


def _check_link(root: Path, path: Path, rel: str) -> bool:
    """True if ``path`` is a symlink (inside the root); raise if it points outside."""
    if not path.is_symlink():
        return False
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise TemplateError(path, None, f"broken or looping symlink {rel!r}: {exc}") from exc
    if not target.is_relative_to(root):
        raise TemplateError(
            path,
            None,
            f"symlink {rel!r} points outside the project (to {target}); "
            "remove it or add it to the template's prefix.exclude",
        )
    return True


def scan_project(root: Path, excludes: tuple[str, ...], include_hidden: bool) -> ProjectScan:
    """Walk ``root`` (already resolved) deterministically; see the module doc for the rules."""
    if not root.is_dir():
        raise TemplateError(root, None, "project directory not found")
    files: list[str] = []
    dirs: list[str] = []
    links: list[str] = []
    for here, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(here)
        rel_base = base.relative_to(root).as_posix()
        prefix = "" if rel_base == "." else rel_base + "/"
        kept: list[str] = []
        for name in sorted(dirnames):
            rel = prefix + name
            if _is_excluded(rel, name, excludes, include_hidden):
                continue
            if _check_link(root, base / name, rel):
                links.append(rel)  # listed, never followed: no loops, no double counting
            else:
                kept.append(name)
                dirs.append(rel)
        dirnames[:] = kept
        for name in sorted(filenames):
            rel = prefix + name
            if _is_excluded(rel, name, excludes, include_hidden):
                continue
            _check_link(root, base / name, rel)
            files.append(rel)
        if len(files) + len(dirs) > MAX_SCAN_ENTRIES:
            raise TemplateError(
                root,
                None,
                f"more than {MAX_SCAN_ENTRIES} entries; exclude folders in prefix.exclude",
            )
    return ProjectScan(root, tuple(sorted(files)), tuple(sorted(dirs)), tuple(sorted(links)))


def read_text(root: Path, rel: str, max_bytes: int) -> tuple[str | None, str]:
    """The file's text, or ``(None, reason)`` when it is too large or not UTF-8 text."""
    path = root / rel
    size = path.stat().st_size
    if size > max_bytes:
        return None, f"too large ({size} bytes > max_file_bytes {max_bytes})"
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        return None, "binary (contains NUL bytes)"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError:
        return None, "binary (not UTF-8 text)"
