"""ProjectTools: useful inside the project, and no way out of it."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from mesh.worker.tools import ProjectTools, ToolError, delegate_tool


@pytest.fixture
def root(tmp_path: Path) -> Path:
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    (project / "src" / "app.py").write_text("def main():\n    return 42\n# TODO fix\n")
    (project / "README.md").write_text("# proj\nTODO: docs\n")
    (project / ".env").write_text("SECRET=1\n")
    (tmp_path / "secret.txt").write_text("TODO secret outside\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x.py").write_text("TODO outside dir\n")
    return project


def test_read_list_grep(root: Path) -> None:
    tools = ProjectTools(root)
    out = tools.read_file({"path": "src/app.py", "start": 2, "lines": 1})
    assert "2\t    return 42" in out and "lines 2-2 of 3" in out
    listing = tools.list_files({})
    assert "src/" in listing and "src/app.py" in listing and ".env" not in listing
    found = tools.grep({"text": "TODO"})
    assert "README.md:2: TODO: docs" in found and "src/app.py:3: # TODO fix" in found
    assert "secret" not in found


@pytest.mark.parametrize(
    "path",
    [
        "../secret.txt",
        "src/../../secret.txt",
        "/etc/passwd",
        "~/x",
        "C:/x",
        ".env",
        "src/.hidden",
        "a\x00b",
        "nope.txt",
    ],
)
def test_bad_paths_are_refused(root: Path, path: str) -> None:
    tools = ProjectTools(root)
    with pytest.raises(ToolError):
        tools.read_file({"path": path})


def test_symlink_out_is_refused(root: Path, tmp_path: Path) -> None:
    os.symlink(tmp_path / "secret.txt", root / "src" / "leak.txt")
    tools = ProjectTools(root)
    with pytest.raises(ToolError, match="outside"):
        tools.read_file({"path": "src/leak.txt"})
    assert "secret outside" not in tools.grep({"text": "TODO"})


def test_symlinked_dir_out_is_refused(root: Path, tmp_path: Path) -> None:
    os.symlink(tmp_path / "outside", root / "ext")
    tools = ProjectTools(root)
    with pytest.raises(ToolError, match="outside"):
        tools.read_file({"path": "ext/x.py"})
    with pytest.raises(ToolError, match="outside"):
        tools.list_files({"path": "ext"})
    assert "outside dir" not in tools.grep({"text": "TODO"})
    assert "ext@" in tools.list_files({})


def test_symlink_inside_is_allowed_but_not_into_hidden(root: Path) -> None:
    os.symlink(root / "src" / "app.py", root / "alias.py")
    os.symlink(root / ".env", root / "env.txt")
    tools = ProjectTools(root)
    assert "return 42" in tools.read_file({"path": "alias.py"})
    with pytest.raises(ToolError, match="hidden"):
        tools.read_file({"path": "env.txt"})


def test_bad_arguments(root: Path) -> None:
    tools = ProjectTools(root)
    with pytest.raises(ToolError, match="unknown arguments"):
        tools.read_file({"path": "README.md", "mode": "w"})
    with pytest.raises(ToolError, match="must be int"):
        tools.read_file({"path": "README.md", "start": "1"})
    with pytest.raises(ToolError, match="must be int"):
        tools.read_file({"path": "README.md", "start": True})
    with pytest.raises(ToolError, match="missing"):
        tools.grep({})


def test_output_is_capped(root: Path) -> None:
    (root / "big.txt").write_text("line of text\n" * 5000)
    out = ProjectTools(root, max_output_chars=1000).read_file({"path": "big.txt", "lines": 2000})
    assert "output truncated" in out and len(out) < 1200


def test_binary_files_are_refused(root: Path) -> None:
    (root / "b.bin").write_bytes(b"\x00\xff")
    with pytest.raises(ToolError, match="binary"):
        ProjectTools(root).read_file({"path": "b.bin"})


def test_async_tools_and_delegate(root: Path) -> None:
    sent: list[tuple[str, str]] = []

    async def send(peer: str, text: str) -> str:
        sent.append((peer, text))
        if peer == "down":
            raise ConnectionError("refused")
        return "done"

    async def main() -> None:
        tools = ProjectTools(root).as_tools()
        assert "return 42" in await tools["read_file"]({"path": "src/app.py"})
        delegate = delegate_tool(send)
        assert await delegate({"peer": "reviewer", "text": "look"}) == "done"
        with pytest.raises(ToolError, match="down"):
            await delegate({"peer": "down", "text": "look"})
        with pytest.raises(ToolError):
            await delegate({"peer": "", "text": "x"})

    anyio.run(main)
    assert sent[0] == ("reviewer", "look")
