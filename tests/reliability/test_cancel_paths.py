"""Every way a task ends gives back what it held (issue 42, item 1), on a real
``mesh serve --model tiny --simulation``: a streamed task is cancelled the moment it
reaches a phase (queued at the gate, planning, a worker's turn, a tool call, synthesis),
or its client drops the stream, and ``/capacity`` must be back at its idle baseline
(sessions 0, cells = the prefix's) before the orphan reaper could act, with nothing reaped.

Scenario subtasks (``--simulation``) make the worker phases deterministic: a turn of 400
tokens, then a scripted tool call that sleeps 3 s.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.reliability.serve_proc import (
    A2A_HEADERS,
    ServeProc,
    message,
    running,
    small_project,
)

SCENARIO = {"scenario": True, "steps": 3, "tokens_per_step": 400,
            "tool_latency_s": {"dist": "fixed", "value": 3.0}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    root = tmp_path_factory.mktemp("cancel-paths")
    project = small_project(root / "project")
    with running(root / "data", project, root / "cache", "--simulation",
                 "--max-sessions", "2", "--max-attached", "2") as srv:
        yield srv


def scenario_message() -> dict[str, Any]:
    return {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": [{"data": {
        "subtasks": [{"id": "p1", "instructions": "Deliver parcel 1.", "params": SCENARIO}]}}]}


def planned_message() -> dict[str, Any]:
    return message("Which file defines add? And what does add return?")


def stream_until(srv: ServeProc, msg: dict[str, Any], marker: str | None,
                 then: str) -> tuple[str, bool]:
    """Stream ``msg``; when an event contains ``marker``, ``then`` is "cancel" (CancelTask,
    read on to the end) or "drop" (close the stream). (task id, marker seen)."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage",
            "params": {"message": msg}}
    task_id, seen = "", False
    with httpx.stream("POST", srv.url + "/", json=body, headers=A2A_HEADERS,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            result = event.get("result", {})
            for key in ("task", "statusUpdate", "artifactUpdate"):
                if key in result:
                    task_id = task_id or result[key].get("id") or result[key].get("taskId", "")
            if not seen and marker is not None and marker in line:
                seen = True
                if then == "drop":
                    return task_id, seen
                doc = srv.rpc("CancelTask", {"id": task_id})
                assert "result" in doc, doc
    return task_id, seen


def assert_idle(srv: ServeProc, idle_cells: int, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        cap = httpx.get(srv.url + "/capacity", timeout=10).json()
        if cap["sessions"]["total"] == 0 and cap["kv_cells"]["used"] == idle_cells:
            assert cap["pool_totals"]["sessions_reaped"] == 0
            assert cap["in_flight"] == 0 and cap["queue_len"] == 0, cap
            return
        assert time.monotonic() < deadline, (cap["sessions"], cap["kv_cells"], cap["reasons"])
        time.sleep(0.1)


def idle_cells(srv: ServeProc) -> int:
    cap = httpx.get(srv.url + "/capacity", timeout=10).json()
    assert cap["sessions"]["total"] == 0, cap["sessions"]
    cells: int = cap["kv_cells"]["used"]
    return cells


@pytest.mark.parametrize(("name", "planned", "marker", "then", "state"), [
    ("cancel while planning", True, "[plan] admitted", "cancel", "TASK_STATE_CANCELED"),
    ("cancel while synthesizing", True, "[synthesis] admitted", "cancel",
     "TASK_STATE_CANCELED"),
    ("cancel mid-turn", False, "stream-p1", "cancel", "TASK_STATE_CANCELED"),
    ("cancel during a tool call", False, "tool call:", "cancel", "TASK_STATE_CANCELED"),
    ("client drops the stream mid-turn", False, "stream-p1", "drop", "TASK_STATE_COMPLETED"),
    ("completed", False, None, "cancel", "TASK_STATE_COMPLETED"),
])
def test_a_task_ending_in_any_phase_gives_everything_back(
    served: ServeProc, name: str, planned: bool, marker: str | None, then: str, state: str
) -> None:
    baseline = idle_cells(served)
    msg = planned_message() if planned else scenario_message()
    task_id, seen = stream_until(served, msg, marker, then)
    assert task_id
    assert marker is None or seen, f"{name}: the task never reached {marker!r}"
    done = served.wait_terminal(task_id, timeout=120)
    assert done["status"]["state"] == state, done["status"]
    assert_idle(served, baseline)


def test_a_task_cancelled_while_queued_at_the_gate(served: ServeProc) -> None:
    baseline = idle_cells(served)
    held = [httpx.post(served.url + "/v1/sessions", json={}, timeout=30).json()["id"]
            for _ in range(2)]  # every place taken: the task queues
    try:
        task_id, seen = stream_until(served, scenario_message(),
                                     "queued for the gate at position", "cancel")
        assert seen
        assert served.wait_terminal(task_id)["status"]["state"] == "TASK_STATE_CANCELED"
    finally:
        for sid in held:
            httpx.delete(f"{served.url}/v1/sessions/{sid}", timeout=30)
    assert_idle(served, baseline)
