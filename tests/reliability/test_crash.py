"""A killed or stopped ``mesh serve`` loses no finished task and leaves no task running.

Real ``mesh serve --model tiny`` processes on free loopback ports, one data dir each test.
``--policy static:1`` runs one worker at a time, so a batch of multi-subtask tasks is still
queued or running when the signal arrives.
"""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.serve_proc import ServeProc, message, running, small_project, text_of

# --plan never: these tests are about signals, not what a random tiny model plans.
SERIAL = ("--policy", "static:1", "--plan", "never")
NUM_BATCH = 6
SUBTASKS_PER_TASK = 8


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return small_project(tmp_path / "project")


def integrity(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        (result,) = conn.execute("PRAGMA integrity_check").fetchone()
        return str(result)
    finally:
        conn.close()


def finish_some(served: ServeProc) -> dict[str, dict[str, Any]]:
    """Two tasks that complete, returned as GetTask saw them."""
    done = {}
    for text in ("first finished task", "second finished task"):
        task = served.send(text)
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
        done[task["id"]] = served.get(task["id"])
    return done


def start_batch(served: ServeProc) -> list[str]:
    """Tasks of several subtasks each, returned at once (they queue behind one slot)."""
    ids = []
    for i in range(NUM_BATCH):
        msg = message("shared context")
        msg["parts"].append(
            {"data": {"subtasks": [{"instructions": f"task {i} step {j}: list the files"}
                                   for j in range(SUBTASKS_PER_TASK)]}}
        )
        doc = served.rpc("SendMessage", {"message": msg,
                                         "configuration": {"returnImmediately": True}})
        assert "result" in doc, doc
        ids.append(doc["result"]["task"]["id"])
    return ids


def check_after(
    served: ServeProc, done: dict[str, dict[str, Any]], batch: list[str]
) -> tuple[int, int]:
    """Finished tasks are intact; the rest are terminal. Returns (interrupted, completed)."""
    for task_id, before in done.items():
        after = served.get(task_id)
        assert after["status"] == before["status"]
        assert after["artifacts"] == before["artifacts"]
        names = {a["name"] for a in after["artifacts"]}
        assert {"answer", "s1 output"} <= names
    interrupted = completed = 0
    for task_id in batch:
        task = served.get(task_id)
        state = task["status"]["state"]
        if state == "TASK_STATE_COMPLETED":
            completed += 1
            assert any(a["name"] == "answer" for a in task["artifacts"])
        else:
            assert state == "TASK_STATE_FAILED", task["status"]
            assert "interrupted" in text_of(task["status"]["message"]["parts"])
            interrupted += 1
    listed = served.rpc("ListTasks", {"pageSize": 100})["result"]
    assert listed["totalSize"] == len(done) + len(batch)
    return interrupted, completed


def test_sigkill_mid_run_keeps_finished_tasks_and_fails_running_ones(
    tmp_path: Path, project: Path, cache: Path
) -> None:
    data = tmp_path / "data"
    with running(data, project, cache, *SERIAL) as first:
        done = finish_some(first)
        batch = start_batch(first)
        states = [first.get(t)["status"]["state"] for t in batch]
        assert "TASK_STATE_COMPLETED" not in states[-1:], "the batch finished before the kill"
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert integrity(data / "tasks.db") == "ok"  # WAL replayed as SQLite would on open

    with running(data, project, cache, *SERIAL) as second:
        interrupted, _ = check_after(second, done, batch)
        assert interrupted >= 1
        assert "marked" in second.stderr() and "interrupted" in second.stderr()
        # The restarted server works: a new task completes.
        assert second.send("after the crash")["status"]["state"] == "TASK_STATE_COMPLETED"
        second.stop()
    assert integrity(data / "tasks.db") == "ok"


def test_sigterm_mid_run_marks_running_tasks_and_closes_the_store(
    tmp_path: Path, project: Path, cache: Path
) -> None:
    data = tmp_path / "data"
    with running(data, project, cache, *SERIAL) as first:
        done = finish_some(first)
        batch = start_batch(first)
        code = first.stop(signal.SIGTERM)
        log = first.stderr()
    # uvicorn re-raises the signal after a clean shutdown.
    assert code in (0, -signal.SIGTERM), log
    assert "Application shutdown complete" in log
    assert integrity(data / "tasks.db") == "ok"
    # Every row is terminal before any restart sweep runs: the shutdown marked them.
    conn = sqlite3.connect(data / "tasks.db")
    try:
        rows = conn.execute("SELECT id, json_extract(status, '$.state') FROM tasks").fetchall()
    finally:
        conn.close()
    assert len(rows) == len(done) + len(batch)
    assert {state for _, state in rows} <= {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED"}, rows

    with running(data, project, cache, *SERIAL) as second:
        interrupted, _ = check_after(second, done, batch)
        assert interrupted >= 1
        assert "marked" not in second.stderr()  # nothing was left for the startup sweep
        second.stop()
