"""File-system errors under the project tools are tool errors, never a failed subtask.

Issue 27 hole 3: a symlink loop made ``grep`` raise ``RuntimeError("Symlink loop from ...")``
(the worker failed the whole subtask), and a file that vanished between the tool's check
and its read raised ``FileNotFoundError`` out of ``grep``.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import anyio
import pytest

from mesh.worker.tools import ProjectTools, ToolError


@pytest.fixture
def root(tmp_path: Path) -> Path:
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    (project / "src" / "app.py").write_text("# TODO fix\n")
    (project / "src" / "victim.txt").write_text("TODO victim\n")
    (project / "README.md").write_text("TODO: docs\n")
    return project


@pytest.fixture
def looped(root: Path) -> Path:
    """A project with a self-loop, a two-link loop, and a link to the loop."""
    os.symlink("self.txt", root / "self.txt")
    os.symlink("b.txt", root / "src" / "a.txt")
    os.symlink("a.txt", root / "src" / "b.txt")
    os.symlink("src/a.txt", root / "to_loop.txt")
    return root


def test_grep_over_a_symlink_loop_is_an_answer(looped: Path) -> None:
    out = ProjectTools(looped).grep({"text": "TODO"})
    assert "README.md:1: TODO: docs" in out and "src/app.py:1: # TODO fix" in out
    assert "4 skipped: symlink loop" in out


@pytest.mark.parametrize("path", ["self.txt", "src/a.txt", "to_loop.txt"])
def test_every_tool_on_a_symlink_loop_is_a_tool_error(looped: Path, path: str) -> None:
    tools = ProjectTools(looped)
    with pytest.raises(ToolError):
        tools.read_file({"path": path})
    with pytest.raises(ToolError):
        tools.grep({"text": "TODO", "path": path})
    with pytest.raises(ToolError):
        tools.list_files({"path": path})


def test_list_files_shows_a_symlink_loop_as_a_link(looped: Path) -> None:
    listing = ProjectTools(looped).list_files({"depth": 3})
    assert "self.txt@" in listing and "src/a.txt@" in listing and "src/app.py" in listing


def test_the_async_tools_report_a_loop_to_the_model(looped: Path) -> None:
    async def main() -> None:
        tools = ProjectTools(looped).as_tools()
        assert "TODO: docs" in await tools["grep"]({"text": "TODO"})
        with pytest.raises(ToolError):
            await tools["read_file"]({"path": "self.txt"})

    anyio.run(main)


def _vanish_after_check(monkeypatch: pytest.MonkeyPatch, name: str, at: int) -> list[Path]:
    """Delete ``name`` when a tool checks it is a file for the ``at``-th time (grep checks
    twice, read_file once: the last check before the read), answering True as the check
    saw it: the file vanishes between the check and the read."""
    original = Path.is_file
    calls: list[Path] = []
    deleted: list[Path] = []

    def is_file(self: Path) -> bool:
        answer = original(self)
        if answer and self.name == name:
            calls.append(self)
            if len(calls) == at:
                self.unlink()
                deleted.append(self)
        return answer

    monkeypatch.setattr(Path, "is_file", is_file)
    return deleted


def test_a_file_vanishing_mid_grep_is_skipped(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deleted = _vanish_after_check(monkeypatch, "victim.txt", at=2)
    out = ProjectTools(root).grep({"text": "TODO"})
    assert deleted, "the hook never ran"
    assert "README.md:1: TODO: docs" in out and "src/app.py:1: # TODO fix" in out
    assert "victim" not in out


def test_a_file_vanishing_before_read_file_reads_is_a_tool_error(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deleted = _vanish_after_check(monkeypatch, "victim.txt", at=1)
    with pytest.raises(ToolError, match="vanished"):
        ProjectTools(root).read_file({"path": "src/victim.txt"})
    assert deleted


def test_a_file_deleted_between_walk_and_read_is_skipped(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = ProjectTools(root)
    walk = tools._walk

    def walk_then_delete(top: Path, max_depth: int) -> list[tuple[Path, bool]]:
        entries = walk(top, max_depth)
        (root / "src" / "victim.txt").unlink()
        return entries

    monkeypatch.setattr(tools, "_walk", walk_then_delete)
    out = tools.grep({"text": "TODO"})
    assert "src/app.py:1: # TODO fix" in out and "1 skipped" in out


def test_permission_denied_is_a_tool_error(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root ignores file modes, so the refusal is injected where the tool opens the file."""
    real_open = os.open

    def deny(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if Path(path).name == "victim.txt":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr("mesh.worker.tools.os.open", deny)
    tools = ProjectTools(root)
    with pytest.raises(ToolError, match="Permission denied"):
        tools.read_file({"path": "src/victim.txt"})
    out = tools.grep({"text": "TODO"})
    assert "src/app.py:1: # TODO fix" in out and "victim" not in out


def test_undecodable_text_is_a_tool_error(root: Path) -> None:
    (root / "latin.txt").write_bytes("caf\u00e9 TODO\n".encode("latin-1"))
    tools = ProjectTools(root)
    with pytest.raises(ToolError, match="not UTF-8"):
        tools.read_file({"path": "latin.txt"})
    assert "latin.txt" not in tools.grep({"text": "TODO"})


def test_a_fifo_is_refused_without_blocking(root: Path) -> None:
    os.mkfifo(root / "pipe.txt")
    tools = ProjectTools(root)
    with pytest.raises(ToolError, match="not a file"):
        tools.read_file({"path": "pipe.txt"})
    assert "README.md" in tools.grep({"text": "TODO"})
