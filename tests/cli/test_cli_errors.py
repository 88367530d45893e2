"""Errors a ``mesh`` user can cause are one line naming the fix and a non-zero exit; the
traceback comes only with ``--debug`` (issue 30 item 4)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.cli import main
from tests.reliability.serve_proc import free_port
from tests.support.coord_helpers import TOKEN_A, Served, serve


def _closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # bound, then closed: nothing listens


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["send", "{url}", "hello"],
        ["result", "{url}", "some-task"],
        ["tasks", "{url}"],
        ["cancel", "{url}", "some-task"],
        ["capacity", "{url}"],
        ["simulate", "--url", "{url}", "--no-progress", "--packages", "1", "--out", "{out}"],
    ],
    ids=["send", "result", "tasks", "cancel", "capacity", "simulate"],
)
def test_a_server_that_is_not_there(tmp_path: Path, argv: list[str]) -> None:
    url = _closed_url()
    args = [a.format(url=url, out=tmp_path / "out") for a in argv]
    proc = subprocess.run([sys.executable, "-m", "mesh", *args], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode != 0
    line = _one_line(proc.stderr)
    assert url in line and "cannot connect" in line and "mesh serve" in line, line
    if argv[0] != "simulate":  # mesh/cli/simulate.py still writes "mesh: ..."
        assert line.startswith(f"mesh {argv[0]}: cannot connect"), line


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    """A coordinator with auth on and scenario params off (no --simulation)."""
    with serve(tmp_path / "data", auth_token=TOKEN_A) as served:
        yield served


def test_a_server_that_refuses_the_token(server: Served, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_TOKEN", raising=False)
    for argv in (["send", server.url, "hi"], ["tasks", server.url], ["capacity", server.url],
                 ["send", server.url, "hi", "--token", "not-the-token"]):
        assert main(argv) != 0
        line = _one_line(capsys.readouterr().err)
        assert "401" in line and "--token" in line and "MESH_TOKEN" in line, line
        assert line.startswith(f"mesh {argv[0]}: "), line


def test_simulate_against_a_server_without_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The server answers every package with a JSON-RPC invalid-params error whose message
    # names the fix; this used to end a 40-line traceback.
    with serve(tmp_path / "data") as plain:
        rc = main(["simulate", "--url", plain.url, "--no-progress", "--packages", "1",
                   "--out", str(tmp_path / "out")])
    assert rc != 0
    line = _one_line(capsys.readouterr().err)
    assert "scenario params are off" in line and "mesh serve --simulation" in line, line


def test_a_4xx_with_a_message_keeps_the_message(server: Served,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", server.url + "/nowhere", "--token", TOKEN_A]) != 0
    line = _one_line(capsys.readouterr().err)
    assert "404" in line and "check the URL" in line, line


@pytest.mark.parametrize(
    ("argv", "help_of"),
    [
        (["send"], "mesh send"),
        (["serve", "--no-such-flag"], "mesh serve"),
        (["serve", "--port", "eighty"], "mesh serve"),
        (["--no-such-flag"], "mesh"),
        (["tasks", "http://x", "--state", "sleeping"], "mesh tasks"),
    ],
)
def test_a_bad_flag_is_one_line(argv: list[str], help_of: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    line = _one_line(capsys.readouterr().err)
    assert line.endswith(f"see `{help_of} --help`"), line
    assert line.startswith(f"{help_of}: ") and "error:" not in line, line  # the one style


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_lets_the_traceback_through(where: str) -> None:
    argv = ["send", _closed_url(), "hi"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(Exception, match=r"(?i)connect"):
        main(argv)


def test_ctrl_c_in_any_command_is_one_line_in_the_style(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mesh.cli import client

    async def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "_capacity", interrupted)
    assert main(["capacity", _closed_url()]) == 130
    assert _one_line(capsys.readouterr().err) == "mesh capacity: interrupted"
