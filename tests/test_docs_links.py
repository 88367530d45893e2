"""Every relative link in the README and ``docs/`` points at a file that exists, and every
``#anchor`` at a heading of the page it names (GitHub's heading slugs)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target); the target stops at whitespace or ')'.
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, with inline code removed."""
    out: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, _INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than
    '-' and '_' removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    kept = [c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN"]
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of ``path`` (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link on the page."""
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
                continue
            found.append((number, target))
    return found


def broken(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the page's relative links, one line each (paths shown from
    ``root``)."""
    problems = []
    for number, target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {file_part or 'it'}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken(page) == []


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## The pool — `bench/pool.py`\n")
    page.write_text(
        "# Page\n\n[ok](other.md#the-pool--benchpoolpy) [self](#page)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) ![img](nope.png)\n"
        "`[in code](skipped.md)` [web](https://example.com/x.md)\n\n"
        "```\n[in a block](skipped.md)\n```\n"
    )
    assert broken(page, tmp_path) == [
        "page.md:4: missing.md: missing.md does not exist",
        "page.md:4: other.md#nope: no heading with anchor #nope in other.md",
        "page.md:4: nope.png: nope.png does not exist",
    ]


def test_the_readme_is_a_front_page() -> None:
    """Issue 26: the README stays a front page (details go to docs/), and keeps the two
    commands that .ci/run and the project's checks look for."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    blocks = "\n".join(line for _, line in _code_lines(text))
    assert "bash scripts/run.sh" in blocks.splitlines()
    assert "bash scripts/test.sh" in blocks.splitlines()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _code_lines(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif fenced:
            out.append((number, line.strip()))
    return out
