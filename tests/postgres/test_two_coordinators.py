"""Two coordinators on one PostgreSQL (``task_store``): a task made on one is read, listed,
resubscribed and cancelled on the other, and a coordinator whose session dies has its
running tasks failed by the other. Real uvicorn servers on 127.0.0.1, in threads, with the
scripted workers of :mod:`tests.support.coord_helpers`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest
from a2a.client import Client
from a2a.server.cluster import TaskVersion
from a2a.types import a2a_pb2 as pb

from mesh.a2a.postgres import LOCK_SPACE, PostgresStores
from mesh.a2a.store import INTERRUPTED_REASON, owner_context
from tests.support.coord_helpers import (
    Probe,
    S,
    artifact,
    await_for,
    request,
    sdk,
    send_all,
    serve,
    text_of,
    wait_terminal,
)

pytestmark = pytest.mark.anyio


async def test_a_task_made_on_one_is_read_and_listed_on_the_other(
    tmp_path: Path, pg_url: str
) -> None:
    with serve(tmp_path / "a", task_store=pg_url) as a, \
            serve(tmp_path / "b", task_store=pg_url) as b:
        async with sdk(a.url, streaming=False) as on_a, sdk(b.url, streaming=False) as on_b:
            done = (await send_all(on_a, request("made on a")))[0].task
            read = await on_b.get_task(pb.GetTaskRequest(id=done.id))
            listed = await on_b.list_tasks(pb.ListTasksRequest(include_artifacts=True))
            made_on_b = (await send_all(on_b, request("made on b")))[0].task
            listed_on_a = await on_a.list_tasks(pb.ListTasksRequest())
    assert done.status.state == S.TASK_STATE_COMPLETED
    assert read.status.state == S.TASK_STATE_COMPLETED
    assert text_of(artifact(read, "answer").parts) == "echo: made on a"
    assert [t.id for t in listed.tasks] == [done.id]
    assert text_of(artifact(listed.tasks[0], "stream-s1").parts) == "hello world"
    assert {t.id for t in listed_on_a.tasks} == {done.id, made_on_b.id}


async def test_callers_see_only_their_own_tasks_on_either(tmp_path: Path, pg_url: str) -> None:
    tokens = "alice-token-1,bob-token-22"
    with serve(tmp_path / "a", task_store=pg_url, auth_token=tokens) as a, \
            serve(tmp_path / "b", task_store=pg_url, auth_token=tokens) as b:
        async with sdk(a.url, streaming=False, token="alice-token-1") as alice, \
                sdk(b.url, streaming=False, token="bob-token-22") as bob:
            mine = (await send_all(alice, request("alice's")))[0].task
            bobs = await bob.list_tasks(pb.ListTasksRequest())
            with pytest.raises(Exception, match="not found"):
                await bob.get_task(pb.GetTaskRequest(id=mine.id))
    assert list(bobs.tasks) == []


async def test_a_running_task_streams_to_a_subscriber_on_the_other(
    tmp_path: Path, pg_url: str
) -> None:
    probe = Probe()
    with serve(tmp_path / "a", task_store=pg_url, probe=probe) as a, \
            serve(tmp_path / "b", task_store=pg_url) as b:
        async with sdk(a.url, streaming=False) as on_a, sdk(b.url) as on_b:
            task = (await send_all(on_a, request("block here", immediately=True)))[0].task
            await await_for(lambda: f"{task.id}/s1" in probe.started, what="worker start")
            seen: list[pb.StreamResponse] = []

            async def tail() -> None:
                async for response in on_b.subscribe(pb.SubscribeToTaskRequest(id=task.id)):
                    seen.append(response)

            tailing = asyncio.create_task(tail())
            await await_for(lambda: bool(seen), what="the snapshot")
            probe.unblock.set()
            await asyncio.wait_for(tailing, 30)
            final = await on_a.get_task(pb.GetTaskRequest(id=task.id))
    assert seen[0].HasField("task") and seen[0].task.id == task.id
    states = [r.status_update.status.state for r in seen if r.HasField("status_update")]
    assert states[-1] == S.TASK_STATE_COMPLETED
    texts = [text_of(r.status_update.status.message.parts) for r in seen
             if r.HasField("status_update")]
    assert any("unblocked" in t for t in texts), texts  # produced on a after b subscribed
    assert final.status.state == S.TASK_STATE_COMPLETED


async def test_a_cancel_on_the_other_stops_the_worker_at_once(
    tmp_path: Path, pg_url: str
) -> None:
    probe = Probe()
    with serve(tmp_path / "a", task_store=pg_url, probe=probe) as a, \
            serve(tmp_path / "b", task_store=pg_url) as b:
        async with sdk(a.url, streaming=False) as on_a, sdk(b.url, streaming=False) as on_b:
            task = (await send_all(on_a, request("block until cancelled", immediately=True)))
            task_id = task[0].task.id
            await await_for(lambda: f"{task_id}/s1" in probe.started, what="worker start")
            await until_stored(on_b, task_id, 'wait(for="unblock")')
            cancelled = await on_b.cancel_task(pb.CancelTaskRequest(id=task_id))
            # The worker on a is blocked in a tool call and writes nothing more: only the
            # announced cancel can reach it (without it, the worker waits forever).
            await await_for(lambda: f"{task_id}/s1" in probe.cancelled, what="worker cancel")
            await await_for(lambda: f"{task_id}/s1" in a.admission.released, what="ticket")
            on_a_after = await wait_terminal(on_a, task_id)
            on_b_after = await on_b.get_task(pb.GetTaskRequest(id=task_id))
            again = await send_all(on_a, request("still serving"))
    assert cancelled.status.state == S.TASK_STATE_CANCELED
    assert on_a_after.status.state == S.TASK_STATE_CANCELED
    assert on_b_after.status.state == S.TASK_STATE_CANCELED
    assert again[0].task.status.state == S.TASK_STATE_COMPLETED


async def test_a_dead_coordinators_running_tasks_are_failed_by_the_survivor(
    tmp_path: Path, pg_url: str
) -> None:
    # The coordinator that dies: its stores, a task it runs, then its session killed from
    # the database's side (as a SIGKILL or a cut connection ends it).
    doomed = PostgresStores(pg_url)
    await doomed.initialize()
    anyone = owner_context("")
    working = pb.Task(id="t-working", context_id="c",
                      status=pb.TaskStatus(state=S.TASK_STATE_WORKING))
    working.artifacts.append(pb.Artifact(artifact_id="a", parts=[pb.Part(text="partial")]))
    await doomed.tasks.save(working, prev_version=TaskVersion.MISSING, context=anyone)
    finished = pb.Task(id="t-done", context_id="c",
                       status=pb.TaskStatus(state=S.TASK_STATE_COMPLETED))
    await doomed.tasks.save(finished, prev_version=TaskVersion.MISSING, context=anyone)

    try:
        with serve(tmp_path / "b", task_store=pg_url) as survivor:
            # The doomed coordinator is alive at the survivor's start: nothing is swept.
            assert survivor.app.state.coordinator.interrupted_at_start == ()
            async with sdk(survivor.url, streaming=False) as client:
                still = await client.get_task(pb.GetTaskRequest(id="t-working"))
                assert still.status.state == S.TASK_STATE_WORKING
                assert await kill_session_of(pg_url, doomed.membership.id) == 1
                failed = await wait_terminal(client, "t-working")
                done = await client.get_task(pb.GetTaskRequest(id="t-done"))
    finally:
        await doomed.aclose()
    assert failed.status.state == S.TASK_STATE_FAILED
    assert text_of(failed.status.message.parts) == INTERRUPTED_REASON
    assert text_of(failed.artifacts[0].parts) == "partial"
    assert done.status.state == S.TASK_STATE_COMPLETED


async def until_stored(client: Client, task_id: str, text: str) -> None:
    """Wait (bounded) until the stored status of ``task_id`` says ``text``: the runner has
    written everything before it."""
    for _ in range(500):
        task = await client.get_task(pb.GetTaskRequest(id=task_id))
        if text in text_of(task.status.message.parts):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"task {task_id} never said {text!r}")


async def kill_session_of(url: str, seat: int) -> int:
    """Terminate the session holding coordinator ``seat``'s liveness lock; how many."""
    conn = await asyncpg.connect(url)
    try:
        killed: int = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE "
            "locktype = 'advisory' AND classid = $1 AND objid = $2 AND granted",
            LOCK_SPACE, seat)
    finally:
        await conn.close()
    return killed
