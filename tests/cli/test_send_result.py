"""Ctrl-C during ``mesh send --stream`` leaves the task running and says how to reach it;
``mesh result URL ID`` prints a task's answer, or its state while it runs (issue 41 item 7.1).

A real ``mesh send`` process, interrupted with a real SIGINT, against a coordinator on a
real uvicorn (fake gate and worker: :mod:`tests.support.coord_helpers`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.cli import main
from tests.support.coord_helpers import TOKEN_A, Served, serve, wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    with serve(tmp_path / "data", auth_token=TOKEN_A) as served:
        yield served


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_TOKEN", raising=False)


class _Lines:
    """A child's stderr, read line by line on a thread (so a test can wait for a line)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stderr is not None
        stream = proc.stderr
        self.thread = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self.thread.start()

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "".join(self.lines)


def _result(url: str, task_id: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["result", url, task_id, "--token", TOKEN_A])
    out, err = capsys.readouterr()
    return rc, out, err


def test_ctrl_c_during_a_streamed_send_names_the_task_and_the_commands(
    server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MESH_TOKEN"}
    # The child gets SIGINT as a terminal's Ctrl-C would deliver it. A runner started in
    # the background by a shell without job control (CI: `cmd &` in a script) ignores
    # SIGINT, and an ignored signal stays ignored across exec: the child would never see
    # it. A handled signal is reset to its default at exec, so handle it around the spawn.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mesh", "send", server.url, "block until told",
             "--stream", "--token", TOKEN_A],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    finally:
        signal.signal(signal.SIGINT, previous)
    err = _Lines(proc)
    try:
        # The client has seen the task (its first status line) and the worker runs.
        wait_for(lambda: any(line.startswith("[working]") for line in err.lines)
                 and bool(server.probe.started), timeout=60, what="the stream to start")
        task_id = server.probe.started[0].split("/")[0]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        text = err.text()
        assert proc.stderr is not None
        proc.stderr.close()
    assert "Traceback" not in text, text
    assert f"mesh send: interrupted; task {task_id} goes on on the server\n" in text, text
    assert f"mesh result {server.url} {task_id} --token TOKEN\n" in text, text
    assert f"mesh cancel {server.url} {task_id} --token TOKEN\n" in text, text
    assert TOKEN_A not in text  # the token is not echoed

    # The task went on: still working, then done, and `mesh result` prints its answer.
    rc, out, state = _result(server.url, task_id, capsys)
    assert (rc, out) == (3, ""), (rc, out, state)
    assert state.startswith(f"[working] task {task_id} is not finished"), state
    assert f"mesh result {server.url} {task_id} --token TOKEN" in state, state
    server.probe.unblock.set()
    wait_for(lambda: _result(server.url, task_id, capsys)[0] != 3, timeout=30,
             what="the task to finish")
    rc, out, state = _result(server.url, task_id, capsys)
    assert (rc, out) == (0, "unblocked\n"), (rc, out, state)
    assert f"[completed] task {task_id}" in state, state


def test_result_of_finished_tasks_follows_their_state(
    server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    ids: dict[str, str] = {}
    for text in ("hello result", "fail hard"):
        main(["send", server.url, text, "--token", TOKEN_A])
        err = capsys.readouterr().err
        (last,) = [line for line in err.splitlines() if " task " in line and "(context" in line]
        ids[text] = last.split(" task ")[1].split()[0]
    rc, out, err = _result(server.url, ids["hello result"], capsys)
    assert (rc, out) == (0, "echo: hello result\n"), (rc, out, err)
    rc, out, err = _result(server.url, ids["fail hard"], capsys)
    assert rc == 1 and "[failed]" in err and "tool exploded" in err, (rc, out, err)


def test_result_of_an_unknown_task_is_one_clear_line(
    server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _result(server.url, "no-such-task", capsys)
    assert rc == 4 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"mesh result: {server.url} has no task no-such-task"), line
    assert f"`mesh tasks {server.url}` lists yours" in line, line
