"""The project prefix: deterministic, sized by the template, confined to the project.

Token counts here use a character counter, ``ceil(len / 4)`` (about 4 characters per
token, the usual ratio for English and code with BPE tokenizers), so sizes are stable
without a model; the real pool counts with the model's tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mesh.template.loader import (
    TemplateError,
    file_entry,
    load_template,
    matching,
    reference_counts,
    sample_project_dir,
)
from mesh.template.prefix import build_prefix, glob_match


def count(text: str) -> int:
    return (len(text) + 3) // 4


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "README.md").write_text("# proj\n\nA project.\n" + "Some words here.\n" * 40)
    (root / "pkg" / "__init__.py").write_text('"""The package."""\n')
    core = (
        '"""Core logic."""\n\n\nclass Engine:\n    """Runs."""\n\n'
        '    def go(self, n: int) -> int:\n        """Go n times."""\n        return n\n\n\n'
        "def helper(x: str) -> str:\n    return x\n"
    )
    (root / "pkg" / "core.py").write_text(core + "# filler\n" * 200)
    return root


@pytest.mark.parametrize("name", ["light", "heavy"])
def test_prefix_is_deterministic(name: str, project: Path) -> None:
    template = load_template(name)
    first = build_prefix(template, project, count)
    second = build_prefix(load_template(name), project, count)
    assert first.text == second.text
    assert first.sha256 == second.sha256
    assert first.included == second.included


def test_light_prefix_outlines_every_file_then_shows_whole_ones() -> None:
    prefix = build_prefix(load_template("light"), sample_project_dir(), count)
    assert prefix.target_tokens == 5632 and prefix.num_tokens <= 5632
    assert prefix.num_fill_tokens == 0  # no padding: a small project, a small prefix
    files = sorted(p.relative_to(sample_project_dir()).as_posix()
                   for p in sample_project_dir().rglob("*") if p.is_file())
    assert [e.path for e in prefix.outlined] == files and prefix.folded == ()
    assert "courier/parcels.py (" in prefix.text and "class Parcel L" in prefix.text
    whole = [f.path for f in prefix.included if f.mode == "full"]
    assert "courier/parcels.py" in whole  # the sample is small: its files fit whole
    # the outline comes first, whole files after it, the most referenced first
    assert prefix.text.index("## Project outline") < prefix.text.index("## Files in full")


def test_heavy_prefix_is_at_least_8k_tokens_and_scales() -> None:
    heavy = load_template("heavy")
    prefix = build_prefix(heavy, sample_project_dir(), count)
    assert prefix.num_tokens >= 8000
    for section in ("# Tools", "## Project tree", "## Source outlines", "## Latest test results"):
        assert section in prefix.text
    big = build_prefix(heavy, sample_project_dir(), count, target_tokens=32_768)
    assert 32_000 <= big.num_tokens <= 33_500
    assert big.num_fill_tokens > prefix.num_fill_tokens


def test_prefix_lists_included_files_and_outlines_python(project: Path) -> None:
    prefix = build_prefix(load_template("heavy"), project, count)
    modes = {f.path: f.mode for f in prefix.included}
    assert modes["README.md"] == "full"
    assert modes["pkg/core.py"] == "outline"
    assert "def go(self, n: int) -> int" in prefix.text
    assert "class Engine:" in prefix.text


def test_binary_and_huge_files_are_skipped_and_listed(project: Path) -> None:
    (project / "pkg" / "blob.py").write_bytes(b"\x00\x01binary")
    (project / "pkg" / "huge.py").write_text("x = 1\n" * 100_000)
    prefix = build_prefix(load_template("heavy"), project, count)
    skipped = {s.path: s.reason for s in prefix.skipped}
    assert "binary" in skipped["pkg/blob.py"]
    assert "too large" in skipped["pkg/huge.py"]
    assert "\x00" not in prefix.text


def test_symlink_out_of_the_project_is_an_error_naming_it(project: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    os.symlink(secret, project / "pkg" / "leak.py")
    with pytest.raises(TemplateError, match=r"leak\.py.*outside the project"):
        build_prefix(load_template("light"), project, count)


def test_symlinked_dir_out_of_the_project_is_an_error(project: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.py").write_text("secret = 1\n")
    os.symlink(outside, project / "pkg" / "ext")
    with pytest.raises(TemplateError, match="ext"):
        build_prefix(load_template("heavy"), project, count)


def test_symlinks_inside_the_project_are_not_followed_twice(project: Path) -> None:
    os.symlink(project / "pkg", project / "alias")
    prefix = build_prefix(load_template("heavy"), project, count)
    assert "alias -> (symlink, not followed)" in prefix.text
    assert not any(f.path.startswith("alias/") for f in prefix.included)


def test_hidden_files_stay_out(project: Path) -> None:
    (project / ".env").write_text("TOKEN=abc\n")
    (project / ".git").mkdir()
    (project / ".git" / "config").write_text("[core]\n")
    prefix = build_prefix(load_template("heavy"), project, count)
    assert "TOKEN=abc" not in prefix.text
    assert ".git" not in prefix.text


def test_missing_project_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="project directory not found"):
        build_prefix(load_template("light"), tmp_path / "nope", count)


def test_required_file_missing_is_an_error(tmp_path: Path, project: Path) -> None:
    from mesh.template.loader import export_template

    folder = export_template("light", tmp_path / "t")
    manifest = folder / "template.toml"
    manifest.write_text(
        manifest.read_text().replace('mode = "full"', 'mode = "full"\nrequired = ["DESIGN.md"]')
    )
    with pytest.raises(TemplateError, match=r"DESIGN\.md.*missing"):
        build_prefix(load_template(folder), project, count)


def test_budget_skips_are_listed(project: Path) -> None:
    for i in range(30):
        (project / "pkg" / f"mod{i:02d}.py").write_text(f"def f{i}() -> None:\n    pass\n" * 40)
    prefix = build_prefix(load_template("light"), project, count)
    assert prefix.num_tokens <= prefix.target_tokens


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("*.md", "README.md", True),
        ("*.md", "docs/a.md", False),
        ("**/*.py", "a.py", True),
        ("**/*.py", "a/b/c.py", True),
        ("tests/**", "tests/x/y.py", True),
        ("pkg/?.py", "pkg/a.py", True),
        ("pkg/?.py", "pkg/ab.py", False),
    ],
)
def test_glob_semantics(pattern: str, path: str, expected: bool) -> None:
    assert glob_match(pattern, path) is expected


# --------------------------------------------------------------------------- the outline


def test_an_outline_line_names_path_size_summary_and_definitions() -> None:
    text = ('"""Parcels: what a courier carries.\n\nMore."""\n\nMAX_KG = 30\n\n\n'
            "class Parcel:\n    pass\n\n\ndef weigh(p: Parcel) -> int:\n    return 1\n\n\n"
            "def _private() -> None:\n    pass\n")
    entry = file_entry("courier/parcels.py", text, len(text))
    assert entry.summary == "Parcels"
    assert [(d.kind, d.name, d.line) for d in entry.definitions] == [
        ("const", "MAX_KG", 5), ("class", "Parcel", 8), ("def", "weigh", 12)]
    assert entry.line(3) == ("courier/parcels.py (17 lines): Parcels | MAX_KG = 30 L5, "
                             "class Parcel L8, def weigh L12")
    # fewer names: classes first, then functions, then constants; how many were left out
    assert entry.line(1) == "courier/parcels.py (17 lines): Parcels | class Parcel L8 +2"
    assert entry.line(0, summary=False) == "courier/parcels.py (17 lines)"


def test_markdown_lines_are_headings_and_binary_files_a_size() -> None:
    md = file_entry("docs/a.md", "# Guide\n\n## Install\n```\n# not a heading\n```\n## Use\n", 60)
    assert md.summary == "Guide"
    assert [(d.name, d.line) for d in md.definitions] == [("Install", 3), ("Use", 7)]
    assert file_entry("logo.png", None, 2048).line(4) == "logo.png (2 KB, not text)"


def test_references_count_other_files_naming_a_file() -> None:
    refs = reference_counts({
        "pkg/core.py": "def f(): pass",
        "pkg/use.py": "from pkg.core import f",
        "tests/test_core.py": "import pkg.core\nimport pkg.use",
        "README.md": "See pkg/core.py and core.py.",
    })
    assert refs == {"pkg/core.py": 3, "pkg/use.py": 1, "tests/test_core.py": 0, "README.md": 0}


def test_an_outline_over_its_share_folds_the_least_named_folders(project: Path) -> None:
    (project / "data").mkdir()
    for i in range(300):
        (project / "data" / f"row{i:03d}.csv").write_text("a,b\n")
    (project / "pkg" / "use.py").write_text("from pkg.core import Engine\n")
    prefix = build_prefix(load_template("light"), project, count, target_tokens=1024)
    assert prefix.folded == ("data",)
    assert "data/ (300 files, " in prefix.text and "data/row000.csv" not in prefix.text
    assert {e.path for e in prefix.outlined} == {"README.md", "pkg/__init__.py",
                                                 "pkg/core.py", "pkg/use.py"}
    assert prefix.num_tokens <= 1024


def test_whole_files_come_most_referenced_first(project: Path) -> None:
    (project / "pkg" / "use.py").write_text("from pkg.core import Engine\n")
    (project / "pkg" / "more.py").write_text("import pkg.core\n")
    prefix = build_prefix(load_template("light"), project, count)
    whole = [f.path for f in prefix.included if f.mode.startswith("full")]
    assert whole[0] == "pkg/core.py"


def test_matching_lines_rank_the_outline_by_the_words_of_a_request() -> None:
    pool = file_entry("mesh/engine/pool.py", '"""The shared KV pool."""\n\n\nclass SharedKVPool:'
                      "\n    pass\n\n\nclass OrphanReaper:\n    pass\n", 90)
    init = file_entry("mesh/engine/__init__.py", '"""The shared KV pool engine."""\n', 40)
    parcels = file_entry("courier/parcels.py", "MAX_WEIGHT_KG = 30.0\n\n\nclass Parcel:\n"
                         "    pass\n", 50)
    entries = [init, parcels, pool]
    best = matching("Which file defines the shared KV pool?", entries)
    # The package's docstring mentions the pool too; only the file that defines it stays.
    assert [e.path for e in best] == ["mesh/engine/pool.py"]
    assert [d.name for d in best[0].definitions] == ["SharedKVPool"]  # what it asks about
    (weight,) = matching("What is the maximum parcel weight in kilograms?", entries)
    assert weight.line(3) == ("courier/parcels.py (5 lines): MAX_WEIGHT_KG = 30.0 L1, "
                              "class Parcel L4")
    assert matching("Reply with the single word: ok", entries) == []  # nothing matches
