"""Real ``mesh serve --model tiny`` processes on free loopback ports, and raw A2A calls.

Every wait here is bounded; every process started is stopped (SIGKILL as a last resort).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TERMINAL = frozenset(
    {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED"}
)
A2A_HEADERS = {"A2A-Version": "1.0", "content-type": "application/json"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def small_project(root: Path) -> Path:
    """A tiny project folder (a prefix of a few hundred tokens)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("# demo\nA small project for reliability tests.\n")
    (root / "main.py").write_text("def add(a, b):\n    return a + b\n")
    return root


def serve_argv(data_dir: Path, project: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "mesh", "serve", "--model", "tiny", "--threads", "1",
        "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir),
        "--project", str(project), "--prefix-tokens", "256", *extra,
    ]


def serve_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["XDG_CACHE_HOME"] = str(cache)  # the tiny model is written here, not in $HOME
    env.pop("MESH_AUTH_TOKEN", None)
    env.pop("MESH_MODEL", None)
    return env


@dataclass
class ServeProc:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    headers: dict[str, str] = field(default_factory=lambda: dict(A2A_HEADERS))

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def rpc(self, method: str, params: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
        body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
        r = httpx.post(self.url + "/", json=body, headers=self.headers, timeout=timeout)
        assert r.status_code == 200, (r.status_code, r.text)
        doc: dict[str, Any] = r.json()
        return doc

    def send(self, text: str, *, immediately: bool = False) -> dict[str, Any]:
        params = {
            "message": message(text),
            "configuration": {"returnImmediately": immediately},
        }
        doc = self.rpc("SendMessage", params)
        assert "result" in doc, doc
        task: dict[str, Any] = doc["result"]["task"]
        return task

    def get(self, task_id: str) -> dict[str, Any]:
        doc = self.rpc("GetTask", {"id": task_id})
        assert "result" in doc, doc
        task: dict[str, Any] = doc["result"]
        return task

    def wait_terminal(self, task_id: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            task = self.get(task_id)
            if task["status"]["state"] in TERMINAL:
                return task
            if time.monotonic() > deadline:
                raise AssertionError(f"task {task_id} stayed {task['status']['state']}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"mesh serve ignored signal {sig}:\n{self.stderr()}") from None


def message(text: str) -> dict[str, Any]:
    return {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": [{"text": text}]}


def start(
    data_dir: Path, project: Path, cache: Path, *extra: str, timeout: float = 60
) -> ServeProc:
    """Start ``mesh serve`` and wait (bounded) until ``/healthz`` answers."""
    port = free_port()
    log = data_dir.parent / f"serve-{port}.log"
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            serve_argv(data_dir, project, port, *extra),
            stdout=out, stderr=subprocess.STDOUT, env=serve_env(cache),
        )
    served = ServeProc(proc, f"http://127.0.0.1:{port}", log)
    return wait_up(served, timeout)


def wait_up(served: ServeProc, timeout: float, pause: float = 0.05) -> ServeProc:
    """Wait (bounded) until ``served`` answers ``/healthz``; a server that exits or does
    not come up in ``timeout`` seconds fails the test with its log (and is killed)."""
    deadline = time.monotonic() + timeout
    while True:
        if served.proc.poll() is not None:
            raise AssertionError(
                f"mesh serve exited {served.proc.returncode}:\n{served.stderr()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(served.url + "/healthz", timeout=2).status_code == 200:
                return served
        if time.monotonic() > deadline:
            served.stop(signal.SIGKILL)
            raise AssertionError(f"mesh serve did not start:\n{served.stderr()}")
        time.sleep(pause)


@contextlib.contextmanager
def running(data_dir: Path, project: Path, cache: Path, *extra: str) -> Iterator[ServeProc]:
    served = start(data_dir, project, cache, *extra)
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            served.stop(signal.SIGKILL)


def text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(p.get("text", "") for p in parts)


def dumps(doc: Any) -> str:
    return json.dumps(doc, indent=1)[:4000]
