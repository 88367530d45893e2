"""The immutable project prefix, built once from a template and a confined view of the
project directory.

**The project scan** is deterministic (sorted, no timestamps, root-relative POSIX paths) and
never leaves the root: symlinked directories are listed, not followed; a symlink pointing
outside the root is an error naming it; hidden entries (``.git``, ``.env``...) and
build/cache folders are left out unless the template asks for hidden ones. Glob patterns are
anchored at the root: ``*`` and ``?`` stay inside one path component, ``**/`` matches any
number of directories (``**/*.py`` is every Python file, ``*.md`` only the top-level ones).

**The prefix** follows the template's ``prefix.sections`` in order (each kind is described
on its model in :mod:`mesh.template.loader`), within a token budget (``prefix.target_tokens``
or the ``target_tokens`` argument): a text section in full, the others within their share.
A file that does not fit is cut to what is left (if at least ``_MIN_PIECE_TOKENS``) or
skipped; binary and too-large files are skipped; :attr:`Prefix.skipped` lists why.

With ``prefix.fill`` on, a prefix under its target gets a labelled appendix of project text
(files repeated in path order) up to the target. Same template, same project bytes, same
counter: same text.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from mesh.template.loader import (
    FileEntry,
    FilesSection,
    OutlineSection,
    Template,
    TemplateError,
    TextSection,
    TreeSection,
    file_entry,
    human_size,
    outline,
    reference_counts,
)

__all__ = [
    "DEFAULT_EXCLUDED_DIRS", "MAX_SCAN_ENTRIES", "CountTokens", "IncludedFile", "Prefix",
    "ProjectScan", "SkippedFile", "build_prefix", "glob_match", "read_text", "scan_project"
]


# -------------------- the project ---------------------------------------------

DEFAULT_EXCLUDED_DIRS = frozenset(
    {"__pycache__", "node_modules", "build", "dist", "site-packages", "venv", "target"}
)
MAX_SCAN_ENTRIES = 50_000


_GLOB = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}


@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern)
    return re.compile("".join(_GLOB.get(part, re.escape(part)) for part in parts))


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
        raise TemplateError(path, None, f"symlink {rel!r} points outside the project (to "
                            f"{target}); remove it or add it to the template's prefix.exclude")
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
            raise TemplateError(root, None, f"more than {MAX_SCAN_ENTRIES} entries; exclude "
                                "folders in prefix.exclude")
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

# -------------------- the prefix ----------------------------------------------

CountTokens = Callable[[str], int]
_MIN_PIECE_TOKENS = 48
_TRUNCATED = "\n... [truncated]"
_MAX_CHARS_PER_TOKEN = 8


@dataclass(frozen=True)
class IncludedFile:
    path: str
    section: str
    # "full" | "outline", with " (truncated)" when cut to fit; "outline line": the file's
    # line in the project outline (a file may be there and in full too)
    mode: str
    num_tokens: int


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclass(frozen=True)
class Prefix:
    """The prefix text and an account of what went into it."""

    text: str
    num_tokens: int  # count_tokens(text): an estimate unless the counter is the model's
    target_tokens: int
    num_fill_tokens: int
    included: tuple[IncludedFile, ...]  # files whose text (whole or outlined) is in it
    skipped: tuple[SkippedFile, ...]
    sha256: str
    # The project outline: the files it has a line for, and the folders folded to fit.
    outlined: tuple[FileEntry, ...] = ()
    folded: tuple[str, ...] = ()


def truncate(text: str, max_tokens: int, count: CountTokens) -> tuple[str, int]:
    """``text`` cut at a line end so it counts at most ``max_tokens`` (marker included)."""
    # No tokenizer packs more than _MAX_CHARS_PER_TOKEN characters a token on average:
    # cut a long text down to that first, so a large file is never tokenized whole.
    bound = max_tokens * _MAX_CHARS_PER_TOKEN
    n = count(text[:bound]) if len(text) > bound else count(text)
    if n <= max_tokens and len(text) <= bound:
        return text, n
    keep = min(len(text), bound) * max_tokens // max(n, 1)
    for _ in range(12):
        cut = text[:keep]
        newline = cut.rfind("\n")
        if newline > keep * 3 // 4:
            cut = cut[:newline]
        candidate = cut + _TRUNCATED
        n = count(candidate)
        if n <= max_tokens:
            return candidate, n
        keep = keep * 9 // 10
    return "", 0


class _Builder:
    def __init__(self, template: Template, scan: ProjectScan, count: CountTokens, target: int):
        self.template = template
        self.scan = scan
        self.count = count
        self.target = target
        self.max_bytes = template.manifest.prefix.max_file_bytes
        self.parts: list[str] = []
        self.used = 0
        self.included: list[IncludedFile] = []
        self.skipped: list[SkippedFile] = []
        self.seen: set[str] = set()
        self.deferred: list[SkippedFile] = []  # over a section's share; reason = section title
        self.outlined: list[FileEntry] = []
        self.folded: list[str] = []

    @cached_property
    def texts(self) -> dict[str, str | None]:
        """Every scanned file's text (None: binary or too large), read once."""
        return {rel: read_text(self.scan.root, rel, self.max_bytes)[0]
                for rel in self.scan.files}

    @cached_property
    def refs(self) -> dict[str, int]:
        """How many other files name each file (:func:`reference_counts`), once."""
        return reference_counts({rel: text for rel, text in self.texts.items()
                                 if text is not None})

    @property
    def remaining(self) -> int:
        return max(self.target - self.used, 0)

    def add(self, text: str, tokens: int | None = None) -> None:
        self.parts.append(text)
        self.used += self.count(text) if tokens is None else tokens

    def text(self, section: TextSection) -> None:
        project = self.scan.root.name
        self.add(self.template.render(section.file, project=project, target_tokens=self.target))

    def tree(self, section: TreeSection) -> None:
        entries = sorted([(d, True) for d in self.scan.dirs]
                         + [(f, False) for f in self.scan.files]
                         + [(link, True) for link in self.scan.links],
                         key=lambda entry: entry[0].split("/"))  # parents first, "a/" < "a-b"
        lines = [f"{self.scan.root.name}/"]
        for rel, is_dir in entries[: section.max_entries]:
            depth = rel.count("/") + 1
            name = rel.rsplit("/", 1)[-1]
            if rel in self.scan.links:
                name += " -> (symlink, not followed)"
            elif is_dir:
                name += "/"
            lines.append("  " * depth + name)
        if len(entries) > section.max_entries:
            lines.append(f"... ({len(entries) - section.max_entries} more entries)")
        budget = min(self.remaining, int(section.share * self.target))
        body, tokens = truncate(f"## {section.title}\n\n" + "\n".join(lines), budget, self.count)
        if body:
            self.add(body, tokens)

    def outline(self, section: OutlineSection) -> None:
        rels = [rel for rel in self.scan.files
                if not any(glob_match(x, rel) for x in section.exclude)]
        entries = {rel: file_entry(rel, self.texts[rel], (self.scan.root / rel).stat().st_size)
                   for rel in rels}
        header = (f"## {section.title}\n\nEvery file: path (size): what it is | its top-level "
                  "names with line numbers (L12 = line 12).")
        budget = min(self.remaining, int(section.share * self.target)) - self.count(header) - 1
        # Every file at its shortest (path and size) first, folding folders until that fits;
        # then the room left buys detail, the most referenced files first.
        lines = {rel: e.line(0, summary=False) for rel, e in entries.items()}
        cost = {rel: self.count(line) + 1 for rel, line in lines.items()}
        refs = self.refs
        folded = _fold(rels, cost, refs, budget, self.count)
        shown = [rel for rel in rels if not any(rel.startswith(d + "/") for d in folded)]
        room = budget - sum(cost[r] for r in shown) - sum(
            self.count(_fold_line(d, [], None)) + 1 for d in folded)
        ranked = sorted(shown, key=lambda rel: (-refs.get(rel, 0), rel))
        for names in range(section.max_definitions + 1):  # a summary, then one name a round
            grew = False
            for rel in ranked:
                entry = entries[rel]
                if names > len(entry.definitions) or (names == 0 and not entry.summary):
                    continue
                line = entry.line(names)
                more = self.count(line) + 1 - cost[rel]
                if 0 < more <= room:
                    lines[rel], cost[rel] = line, cost[rel] + more
                    room -= more
                    grew = True
            if not grew and names > 0:
                break
        body: list[str] = []
        done: set[str] = set()
        for rel in rels:
            top = next((d for d in folded if rel.startswith(d + "/")), None)
            if top is None:
                body.append(lines[rel])
                self.outlined.append(entries[rel])
                self.included.append(IncludedFile(rel, section.title, "outline line", cost[rel]))
            elif top not in done:
                done.add(top)
                body.append(_fold_line(top, [r for r in rels if r.startswith(top + "/")],
                                       self.scan.root))
        self.folded = sorted(folded)
        text, tokens = truncate(header + "\n" + "\n".join(body), max(budget, 0) + 64, self.count)
        if text:
            self.add(text, tokens)

    def files(self, section: FilesSection) -> None:
        for rel in section.required:
            if rel not in self.scan.files:
                raise TemplateError(self.scan.root / rel, None,
                                    f"required by section {section.title!r}: missing")
        rels = self._select(section)
        self.seen.update(rels)
        budget = min(self.remaining, int(section.share * self.target))
        self._add_files(section, rels, budget, section.title)

    def second_chance(self, sections: list[FilesSection]) -> None:
        """Offer what the sections' shares left unused to the files they had to skip."""
        for section in sections:
            rels = [s.path for s in self.deferred if s.reason == section.title]
            if rels:
                self.deferred = [s for s in self.deferred if s.path not in rels]
                self._add_files(section, rels, self.remaining, f"{section.title} (continued)")
        lined = {e.path for e in self.outlined}  # in the prefix as an outline line
        self.skipped.extend(SkippedFile(s.path, "over the prefix token budget")
                            for s in self.deferred if s.path not in lined)

    def _add_files(self, section: FilesSection, rels: list[str], budget: int, title: str) -> None:
        header = f"## {title}"
        head_tokens = self.count(header)
        pieces: list[str] = []
        for i, rel in enumerate(rels):
            if budget - head_tokens - 16 < _MIN_PIECE_TOKENS:  # full: the rest wait, unread
                self.deferred.extend(SkippedFile(r, section.title) for r in rels[i:])
                break
            text, reason = read_text(self.scan.root, rel, self.max_bytes)
            if text is None:
                self.skipped.append(SkippedFile(rel, reason))
                continue
            body = outline(rel, text) if section.mode == "outline" else text.rstrip("\n")
            body, tokens = truncate(body, section.max_tokens_per_file, self.count)
            room = budget - head_tokens - 16  # 16: the piece's own heading and fences
            if tokens > room:
                if room < _MIN_PIECE_TOKENS:
                    self.deferred.append(SkippedFile(rel, section.title))
                    continue
                body, tokens = truncate(body, room, self.count)
            mode = section.mode + (" (truncated)" if body.endswith(_TRUNCATED) else "")
            piece = f"### {rel} ({mode})\n```\n{body}\n```"
            tokens = self.count(piece)
            pieces.append(piece)
            budget -= tokens
            self.included.append(IncludedFile(rel, section.title, mode, tokens))
        if pieces:
            self.add("\n\n".join([header, *pieces]))

    def _select(self, section: FilesSection) -> list[str]:
        out: list[str] = []
        for pattern in section.include:
            for rel in self.scan.files:
                if rel in self.seen or rel in out:
                    continue
                if glob_match(pattern, rel) and not any(glob_match(x, rel)
                                                        for x in section.exclude):
                    out.append(rel)
        if section.order == "referenced":
            out.sort(key=lambda rel: (-self.refs.get(rel, 0), rel))
        return out

    def fill(self) -> int:
        """Append labelled project text until the target; returns the tokens added."""
        sources = [(rel, text) for rel, text in self.texts.items() if text and text.strip()]
        if not sources:
            sources = [("(template text)", "\n\n".join(self.parts) or self.template.name)]
        added = 0
        header = "## Appendix: project text repeated to reach the prefix size"
        if self.remaining < _MIN_PIECE_TOKENS:
            return 0
        self.add(header)
        for i in range(1_000_000):
            if self.remaining < _MIN_PIECE_TOKENS:
                break
            rel, text = sources[i % len(sources)]
            title = f"### {rel} (copy {i // len(sources) + 1})"
            piece, tokens = truncate(f"{title}\n{text}", self.remaining, self.count)
            if not piece:
                break
            self.add(piece, tokens)
            added += tokens
        return added


def _fold(rels: list[str], cost: dict[str, int], refs: dict[str, int], budget: int,
          count: CountTokens) -> set[str]:
    """The folders to fold so the outline's lines fit ``budget`` tokens: the folder whose
    files the project names least (mean references a file; then the larger, then by
    name) goes first, each fold replacing its files' lines (and any folded subfolder's)
    by one. Empty when everything fits."""
    members: dict[str, list[str]] = {}
    for rel in rels:
        parts = rel.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            members.setdefault("/".join(parts[:depth]), []).append(rel)
    fold_cost = {d: count(_fold_line(d, files, None)) + 1 for d, files in members.items()}
    density = {d: sum(refs.get(r, 0) for r in files) / len(files)
               for d, files in members.items()}
    folded: set[str] = set()

    def covered(rel: str) -> bool:
        return any(rel.startswith(d + "/") for d in folded)

    total = sum(cost.values())
    while total > budget:
        open_dirs = [d for d in members if not any(d == f or d.startswith(f + "/")
                                                     for f in folded)]
        if not open_dirs:
            break
        pick = min(open_dirs, key=lambda d: (density[d], -len(members[d]), d))
        inside = {f for f in folded if f.startswith(pick + "/")}
        total -= sum(cost[r] for r in members[pick] if not covered(r))
        total -= sum(fold_cost[f] for f in inside)
        folded -= inside
        folded.add(pick)
        total += fold_cost[pick]
    return folded


def _fold_line(folder: str, files: list[str], root: Path | None) -> str:
    """The line standing for a folded folder: its file count and (with ``root``) size."""
    if root is None:
        return f"{folder}/ ({len(files)} files, 999.9 MB; not outlined)"
    size = sum((root / rel).stat().st_size for rel in files)
    return f"{folder}/ ({len(files)} files, {human_size(size)}; not outlined)"


def build_prefix(template: Template, project_dir: Path | str, count_tokens: CountTokens, *,
                 target_tokens: int | None = None) -> Prefix:
    """Compose the prefix of ``template`` for ``project_dir`` (see the module doc)."""
    spec = template.manifest.prefix
    target = spec.target_tokens if target_tokens is None else target_tokens
    if target < 64:
        raise ValueError(f"target_tokens must be >= 64, got {target}")
    root = Path(project_dir).expanduser().resolve()
    builder = _Builder(template, scan_project(root, tuple(spec.exclude), spec.include_hidden),
                       count_tokens, target)
    for section in spec.sections:
        getattr(builder, section.kind)(section)  # text, tree, outline or files
    builder.second_chance([s for s in spec.sections if isinstance(s, FilesSection)])
    num_fill = builder.fill() if spec.fill else 0
    text = "\n\n".join(builder.parts) + "\n"
    return Prefix(text=text, num_tokens=count_tokens(text), target_tokens=target,
                  num_fill_tokens=num_fill, included=tuple(builder.included),
                  skipped=tuple(builder.skipped),
                  sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                  outlined=tuple(builder.outlined), folded=tuple(builder.folded))
