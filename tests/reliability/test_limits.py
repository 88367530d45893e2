"""Bad input at the edges: bodies too large, messages too long for a session, and
malformed templates or project folders (clear errors at start, naming the file)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.real_stack import real_stack
from tests.reliability.serve_proc import free_port, message, serve_argv, serve_env, text_of
from tests.support.coord_helpers import Served, serve


def raw_exchange(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` (+ ``body``) on a fresh socket; return what the server answers."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with serve(tmp_path / "data") as served:
        yield served


@pytest.mark.parametrize("path", ["/", "/a2a/message:send", "/v1/sessions"])
def test_oversized_body_is_413_before_it_is_read(server: Served, path: str) -> None:
    # 50 MB announced, none of it sent: the answer cannot have waited for the body.
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"A2A-Version: 1.0\r\nContent-Length: {50 * 1024 * 1024}\r\n\r\n").encode()
    answer = raw_exchange(server.url, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"exceeds" in answer


def test_chunked_body_is_cut_off_at_the_limit(server: Served) -> None:
    # No Content-Length: 2 MB in chunks; the server answers 413 once it passes 1 MiB.
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(32)) + b"0\r\n\r\n"
    head = (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    answer = raw_exchange(server.url, head, body)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.anyio
async def test_message_too_long_for_a_session_fails_the_task_with_the_reason(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    async with real_stack(tiny_model_path, tmp_path, session_budget=64) as stack:
        long_text = "please read every file and explain it " * 40  # far past 64 tokens
        r = await stack.client.post("/", json={
            "jsonrpc": "2.0", "id": 1, "method": "SendMessage",
            "params": {"message": message(long_text)}})
        task = r.json()["result"]["task"]
        reason = text_of(task["status"]["message"]["parts"])
        assert task["status"]["state"] == "TASK_STATE_FAILED", task["status"]
        assert "budget" in reason or "overflow" in reason, reason
        # The pool is fine: no session left behind, a short task completes.
        assert stack.pool.load().sessions == ()
        ok = await stack.client.post("/", json={
            "jsonrpc": "2.0", "id": 2, "method": "SendMessage",
            "params": {"message": message("hi")}})
        assert ok.json()["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"


# --------------------------------------------------------------------------- bad folders


def start_fails(tmp_path: Path, *extra: str) -> str:
    """``mesh serve --model tiny ...`` must exit non-zero by itself; returns its stderr."""
    argv = serve_argv(tmp_path / "data", tmp_path / "project", free_port(), *extra)
    done = subprocess.run(argv, env=serve_env(tmp_path / "cache"), capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


def good_project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    (root / "README.md").write_text("# p\n")
    return root


def test_project_with_a_symlink_out_is_refused_naming_it(tmp_path: Path) -> None:
    root = good_project(tmp_path)
    os.symlink("/etc", root / "escape")
    err = start_fails(tmp_path)
    assert "escape" in err and "outside the project" in err


def test_missing_project_is_refused(tmp_path: Path) -> None:
    err = start_fails(tmp_path)
    assert "project" in err and "not found" in err


def test_binary_and_huge_project_files_are_skipped_not_fatal(tmp_path: Path) -> None:
    # Binary and huge files are listed as skipped in the prefix; only the start is checked.
    root = good_project(tmp_path)
    (root / "blob.bin.dat").write_bytes(b"\x00\x01" * 1000)
    (root / "huge.txt").write_text("y" * 3_000_000)
    port = free_port()
    argv = serve_argv(tmp_path / "data", root, port)
    proc = subprocess.Popen(argv, env=serve_env(tmp_path / "cache"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # bounded: the process prints a handful of lines at start
            lines.append(line)
            if "agent card:" in line or len(lines) > 50:
                break
        assert any("skipped" in line for line in lines), lines
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()


def copy_template(tmp_path: Path) -> Path:
    from mesh.template.loader import export_template

    dest = tmp_path / "tpl"
    export_template("light", dest)
    return dest


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        ("missing", "instructions.j2"),
        ("binary", "instructions.j2"),
        ("huge", "instructions.j2"),
        ("symlink-out", "instructions.j2"),
        ("bad-toml", "template.toml"),
        ("no-manifest", "template.toml"),
    ],
)
def test_malformed_template_is_refused_naming_the_file(
    tmp_path: Path, damage: str, expect: str
) -> None:
    good_project(tmp_path)
    tpl = copy_template(tmp_path)
    target = tpl / "instructions.j2"
    if damage == "missing":
        target.unlink()
    elif damage == "binary":
        target.write_bytes(b"\xff\xfe\x00\x00 {{ x }} \x89PNG")
    elif damage == "huge":
        target.write_text("{{ subtask.instructions }}\n" + "z" * 20_000_000)
    elif damage == "symlink-out":
        outside = tmp_path / "outside.j2"
        outside.write_text("{{ subtask.instructions }}")
        target.unlink()
        os.symlink(outside, target)
    elif damage == "bad-toml":
        (tpl / "template.toml").write_text("version = [")
    else:
        (tpl / "template.toml").unlink()
    err = start_fails(tmp_path, "--template", str(tpl))
    assert expect in err, err
