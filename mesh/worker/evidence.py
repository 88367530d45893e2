"""The evidence an answer names: project files, with the lines that show what it says.

A worker records what its tools showed (:func:`evidence_of`: ``read_file``'s line range,
``grep``'s matching lines) and, once it has an answer, :func:`cited` lists the evidence
the answer rests on: first each project file the answer names (with the lines the tools
showed of it, if any), then the other lines the tools showed. Pure functions; the worker
puts the result in ``WorkerResult.data["evidence"]`` and the task shows it beside the
answer (:func:`render_evidence`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mesh.template.loader import FileEntry

__all__ = ["Evidence", "cited", "defined_lines", "evidence_of", "named_files",
           "outline_lines", "render_evidence", "unknown_files"]

# read_file's footer: "(courier/parcels.py: lines 1-80 of 120)"
_READ = re.compile(r"^\((?P<path>[^\n():]+): lines (?P<a>\d+)-(?P<b>\d+) of \d+\)$", re.M)
# a grep match: "courier/parcels.py:12: MAX_WEIGHT_KG = 30"
_GREP = re.compile(r"^(?P<path>[^\n:]+):(?P<line>\d+): ", re.M)
_PATHISH = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./-]*[A-Za-z0-9_]")
# read_file's numbered line holding a top-level definition or a heading
_DEFINED = re.compile(r"^(?P<no>\d+)\t(?:(?:async\s+)?def\s+(?P<f>\w+)|class\s+(?P<c>\w+)"
                      r"|(?P<k>[A-Z][A-Z0-9_]*)\s*[:=]|#+\s+(?P<h>.+))", re.M)
_MIN_NAME = 4  # shorter names match too much prose
_MAX_GREP_LINES = 8  # lines of one grep a citation lists


@dataclass(frozen=True)
class Evidence:
    """A project file and, when known, the lines (``"12"``, ``"1-80"``, ``"12, 40"``) that
    show it; ``source`` says where they were seen: ``read_file``, ``grep``, ``outline``
    (the answer names the file; the lines are its outline entry's) or ``named`` (the
    answer names a file no tool showed and the outline does not hold)."""

    path: str
    lines: str
    source: str

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "lines": self.lines, "source": self.source}

    def label(self) -> str:
        return f"{self.path} lines {self.lines}" if self.lines else self.path


def evidence_of(tool: str, output: str) -> list[Evidence]:
    """What one successful tool call showed of the project."""
    if tool == "read_file":
        return [Evidence(m["path"], f"{m['a']}-{m['b']}", "read_file")
                for m in _READ.finditer(output)]
    if tool == "grep":
        by_path: dict[str, list[str]] = {}
        for m in _GREP.finditer(output):
            by_path.setdefault(m["path"], []).append(m["line"])
        return [Evidence(path, ", ".join(lines[:_MAX_GREP_LINES]), "grep")
                for path, lines in by_path.items()]
    return []


def named_files(text: str, files: Iterable[str]) -> list[str]:
    """The project ``files`` that ``text`` names, in the order it names them: by path, or
    by file name when only one project file has that name."""
    files = list(files)
    known = set(files)
    by_name: dict[str, list[str]] = {}
    for path in files:
        by_name.setdefault(path.rsplit("/", 1)[-1], []).append(path)
    out: list[str] = []
    for found in _PATHISH.findall(text):
        word = found.strip("./")
        rel = word if word in known else None
        if rel is None and len(by_name.get(word, ())) == 1:
            rel = by_name[word][0]
        if rel is not None and rel not in out:
            out.append(rel)
    return out


def unknown_files(text: str, files: Sequence[str]) -> list[str]:
    """The file names ``text`` gives that the project (``files``) does not have: words
    with a "/" or ending in one of the project's own extensions (``courier.py`` in a
    project of ``.py`` files) that are neither a project path nor the name of one."""
    if not files:
        return []
    known = set(files) | {f.rsplit("/", 1)[-1] for f in files}
    folders = {f.rsplit("/", 1)[0] for f in files if "/" in f}
    exts = {f.rsplit(".", 1)[-1] for f in files if "." in f.rsplit("/", 1)[-1]}
    out: list[str] = []
    for found in _PATHISH.findall(text):
        word = found.strip("./")
        ext = word.rsplit(".", 1)[-1] if "." in word else ""
        filelike = "/" in word or (ext in exts and not ext.isdigit())
        if filelike and word not in known and word not in folders and word not in out:
            out.append(word)
    return out


def cited(answer: str, shown: Sequence[Evidence], files: Iterable[str] = ()) -> list[Evidence]:
    """The evidence ``answer`` rests on: the project files it names (among ``files``, or
    among the files the tools showed when ``files`` is empty), each with what the tools
    showed of it; then everything else the tools showed. One entry per file and source."""
    seen_paths = [e.path for e in shown]
    named = named_files(answer, list(files) or seen_paths)
    out: list[Evidence] = []
    for rel in named:
        mine = [e for e in shown if e.path == rel]
        out.extend(mine or [Evidence(rel, "", "named")])
    out.extend(e for e in shown if e.path not in named)
    unique: list[Evidence] = []
    for e in out:
        if all((e.path, e.source) != (u.path, u.source) for u in unique):
            unique.append(e)
    return unique


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def defined_lines(answer: str, numbered: str) -> str:
    """The lines of a file (``numbered``: ``read_file``'s output, ``N<TAB>text`` lines)
    that define what ``answer`` speaks of: its top-level classes, functions, upper-case
    constants and headings whose name the answer holds, spaces and case aside ("the
    shared KV pool" holds ``SharedKVPool``), as ``"78"`` or ``"12, 40"``; '' if none."""
    said = _squash(answer)
    found: list[str] = []
    for m in _DEFINED.finditer(numbered):
        name: str = m["f"] or m["c"] or m["k"] or m["h"] or ""
        key = _squash(name)
        if len(key) >= _MIN_NAME and key in said and m["no"] not in found:
            found.append(m["no"])
    return ", ".join(found[:_MAX_GREP_LINES])


def outline_lines(answer: str, entry: FileEntry) -> str:
    """The lines of an outline ``entry`` that define what ``answer`` speaks of (as
    :func:`defined_lines`), else '' ."""
    said = _squash(answer)
    found = [str(d.line) for d in entry.definitions
             if len(_squash(d.name)) >= _MIN_NAME and _squash(d.name) in said]
    return ", ".join(dict.fromkeys(found[:_MAX_GREP_LINES]))


def render_evidence(evidence: Sequence[dict[str, object]]) -> str:
    """The evidence as a line a client shows under the answer ('' when there is none)."""
    if not evidence:
        return ""
    items = [f"{e['path']} lines {e['lines']}" if e.get("lines") else str(e["path"])
             for e in evidence]
    return "Evidence: " + "; ".join(items)
