"""Real ``mesh serve --model tiny --task-store`` processes on one PostgreSQL: SIGKILL of one
loses no finished task and the other fails the running ones; a bad or unreachable
``--task-store`` stops the start in one line naming the flag."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.reliability.serve_proc import free_port, running, serve_argv, serve_env, small_project
from tests.reliability.test_crash import SERIAL, check_after, finish_some, start_batch


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return small_project(tmp_path / "project")


def test_sigkill_of_one_coordinator_loses_nothing_and_the_other_fails_its_tasks(
    tmp_path: Path, project: Path, cache: Path, pg_url: str
) -> None:
    store = ("--task-store", pg_url)
    with running(tmp_path / "a", project, cache, *store, *SERIAL) as doomed, \
            running(tmp_path / "b", project, cache, *store, *SERIAL) as survivor:
        done = finish_some(doomed)
        batch = start_batch(doomed)
        states = [survivor.get(t)["status"]["state"] for t in batch]  # read on the other
        assert "TASK_STATE_COMPLETED" not in states[-1:], "the batch finished before the kill"
        assert doomed.stop(signal.SIGKILL) == -signal.SIGKILL
        for task_id in batch:  # the survivor's sweep (every second) ends each of them
            survivor.wait_terminal(task_id, timeout=60)
        interrupted, _ = check_after(survivor, done, batch)
        assert interrupted >= 1
        assert "gone: marked" in survivor.stderr()
        assert survivor.send("after the kill")["status"]["state"] == "TASK_STATE_COMPLETED"
        assert survivor.stop() in (0, -signal.SIGTERM)


def start_failure(tmp_path: Path, project: Path, cache: Path, url: str) -> tuple[int, str]:
    argv = serve_argv(tmp_path / "data", project, free_port(), "--task-store", url)
    done = subprocess.run(argv, capture_output=True, text=True, env=serve_env(cache),
                          timeout=120, check=False)
    return done.returncode, done.stderr


def test_an_unreachable_task_store_fails_at_start_in_one_line(
    tmp_path: Path, project: Path, cache: Path
) -> None:
    port = free_port()  # nothing listens there
    code, stderr = start_failure(tmp_path, project, cache,
                                 f"postgresql://mesh:s3cret@127.0.0.1:{port}/mesh")
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mesh serve:")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(
        f"mesh serve: cannot reach PostgreSQL at postgresql://mesh:***@127.0.0.1:{port}/mesh: ")
    assert lines[0].endswith("; check --task-store")
    assert "s3cret" not in stderr
    assert "Traceback" not in stderr


def test_a_task_store_that_is_not_postgresql_is_refused_before_anything_starts(
    tmp_path: Path, project: Path, cache: Path
) -> None:
    code, stderr = start_failure(tmp_path, project, cache, "mysql://root:pw@db/tasks")
    assert code == 2, stderr
    assert stderr.strip().splitlines()[-1] == (
        "mesh serve: --task-store must be a postgresql:// URL, got one starting 'mysql'; "
        "pass --task-store postgresql://USER:PASSWORD@HOST:PORT/DB, or leave it out to keep "
        "tasks in SQLite under --data-dir")
