"""Tasks persist in SQLite; a restart keeps finished tasks and fails interrupted ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from a2a.types import a2a_pb2 as pb

from mesh.a2a.store import INTERRUPTED_REASON, open_stores, owner_context
from tests.support.coord_helpers import (
    S,
    artifact,
    await_for,
    request,
    sdk,
    send_all,
    serve,
    text_of,
)

pytestmark = pytest.mark.anyio


async def test_restart_keeps_finished_tasks_and_fails_running_ones(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve(data) as first:
        async with sdk(first.url, streaming=False) as client:
            done = (await send_all(client, request("keep me")))[0].task
            running = (await send_all(client, request("block forever", immediately=True)))[0]
            running_id = running.task.id
            await await_for(lambda: f"{running_id}/s1" in first.probe.started, what="start")
    # The first server is gone (its shutdown cancelled the worker and released the ticket).
    assert f"{running_id}/s1" in first.probe.cancelled
    assert first.admission.released == [f"{done.id}/s1", f"{running_id}/s1"]

    with serve(data) as second:
        async with sdk(second.url, streaming=False) as client:
            kept = await client.get_task(pb.GetTaskRequest(id=done.id))
            lost = await client.get_task(pb.GetTaskRequest(id=running_id))
            listed = await client.list_tasks(pb.ListTasksRequest())
    assert kept.status.state == S.TASK_STATE_COMPLETED
    assert text_of(artifact(kept, "answer").parts) == "echo: keep me"
    assert text_of(artifact(kept, "stream-s1").parts) == "hello world"
    assert lost.status.state == S.TASK_STATE_FAILED
    assert text_of(lost.status.message.parts) == INTERRUPTED_REASON
    assert {t.id for t in listed.tasks} == {done.id, running_id}


async def test_startup_sweep_fails_tasks_left_by_a_crash(tmp_path: Path) -> None:
    """A process killed mid-task never ran its shutdown; the next start cleans up."""
    data = tmp_path / "data"
    stores = open_stores(data)
    await stores.initialize()
    for owner, task_id, state in [
        ("", "t-working", S.TASK_STATE_WORKING),
        ("caller-x", "t-submitted", S.TASK_STATE_SUBMITTED),
        ("", "t-done", S.TASK_STATE_COMPLETED),
    ]:
        task = pb.Task(id=task_id, context_id="c", status=pb.TaskStatus(state=state))
        task.artifacts.append(pb.Artifact(artifact_id="a", parts=[pb.Part(text="partial")]))
        await stores.tasks.save(task, owner_context(owner))
    await stores.aclose()

    with serve(data) as served:
        coordinator = served.app.state.coordinator
        assert sorted(coordinator.interrupted_at_start) == ["t-submitted", "t-working"]

    stores = open_stores(data)
    try:
        working = await stores.tasks.get("t-working", owner_context(""))
        submitted = await stores.tasks.get("t-submitted", owner_context("caller-x"))
        finished = await stores.tasks.get("t-done", owner_context(""))
        assert await stores.mark_interrupted() == []  # idempotent
    finally:
        await stores.aclose()
    assert working is not None and submitted is not None and finished is not None
    for task in (working, submitted):
        assert task.status.state == S.TASK_STATE_FAILED
        assert text_of(task.status.message.parts) == INTERRUPTED_REASON
        assert text_of(task.artifacts[0].parts) == "partial"  # nothing else was lost
    assert finished.status.state == S.TASK_STATE_COMPLETED


async def test_many_concurrent_tasks_all_persist(tmp_path: Path) -> None:
    with serve(tmp_path / "data") as served:
        async with sdk(served.url, streaming=False) as client:
            results = await asyncio.gather(
                *(send_all(client, request(f"n{i}")) for i in range(20))
            )
            listed = await client.list_tasks(pb.ListTasksRequest(page_size=100))
    states = {r[0].task.status.state for r in results}
    assert states == {S.TASK_STATE_COMPLETED}
    assert listed.total_size == 20
