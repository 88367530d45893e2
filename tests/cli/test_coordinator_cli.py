"""``mesh send|tasks|cancel|capacity`` against a real server."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mesh.cli import client as cli
from tests.support.coord_helpers import TOKEN_A, Served, serve, wait_for


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mesh")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


async def capacity(request: Request) -> Response:
    return JSONResponse({"queued": 0, "slots": 4})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    with serve(tmp_path / "data", auth_token=TOKEN_A,
               extra_routes=[Route("/capacity", capacity)]) as served:
        yield served


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_TOKEN", TOKEN_A)


def test_send_prints_the_answer_and_exits_0(server: Served, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    assert run("send", server.url, "hello cli") == 0
    out, err = capsys.readouterr()
    assert out.strip() == "echo: hello cli"
    assert "[completed]" in err


def test_send_stream_prints_chunks_and_statuses(server: Served,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert run("send", server.url, "streamed", "--stream") == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[s1] hello world", "echo: streamed"]
    assert "[working] [s1] turn 1" in err and "[completed]" in err


def test_send_exit_status_follows_the_final_state(server: Served,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert run("send", server.url, "fail hard") == 1
    assert "tool exploded" in capsys.readouterr().err


def test_wrong_token_is_a_clear_error(server: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("send", server.url, "x", "--token", "not-the-token") == 4
    assert "401" in capsys.readouterr().err


def test_tasks_and_cancel(server: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("send", server.url, "first") == 0
    capsys.readouterr()
    assert run("tasks", server.url) == 0
    out = capsys.readouterr().out
    assert re.search(r"completed\s+\S+ \S+\s+completed 1 subtask", out), out
    task_id = out.splitlines()[1].split()[0]
    assert run("cancel", server.url, task_id) == 1  # finished tasks cannot be canceled
    assert "cannot cancel" in capsys.readouterr().err


def test_cancel_a_running_task(server: Served, capsys: pytest.CaptureFixture[str]) -> None:
    import threading

    codes: list[int] = []
    sender = threading.Thread(target=lambda: codes.append(run("send", server.url, "block me")))
    sender.start()
    wait_for(lambda: bool(server.probe.started), what="worker start")
    task_id = server.probe.started[0].split("/")[0]
    assert run("cancel", server.url, task_id) == 0
    sender.join(timeout=20)
    assert codes == [2]
    assert "[canceled]" in capsys.readouterr().out


def test_capacity_is_pretty_json(server: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("capacity", server.url) == 0
    assert capsys.readouterr().out == '{\n  "queued": 0,\n  "slots": 4\n}\n'
