"""A task's life end to end: a real uvicorn on 127.0.0.1 and the SDK's own client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict

from tests.support.coord_helpers import (
    FakeAdmission,
    Served,
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

S = pb.TaskState


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with serve(tmp_path / "data") as served:
        yield served


# --------------------------------------------------------------------------- card


def test_card_is_served_with_cache_headers(server: Served) -> None:
    response = httpx.get(server.url + "/.well-known/agent-card.json")
    assert response.status_code == 200
    assert response.headers["cache-control"] == "public, max-age=60"
    card = response.json()
    assert card["name"] == "mesh" and card["version"] and card["description"]
    bindings = {(i["protocolBinding"], i["protocolVersion"]): i["url"]
                for i in card["supportedInterfaces"]}
    assert bindings[("JSONRPC", "1.0")] == server.url + "/"
    assert bindings[("HTTP+JSON", "1.0")] == server.url + "/a2a"
    assert card["capabilities"]["streaming"] and card["capabilities"]["pushNotifications"]
    pool = card["capabilities"]["extensions"][0]
    assert pool["uri"] == "urn:mesh:pool:v1"
    assert pool["params"]["prefix_tokens"] == 900 and pool["params"]["prefix_hash"] == "ab" * 32
    assert card["skills"] and card["skills"][0]["id"] == "delegate"
    assert "securitySchemes" not in card
    again = httpx.get(server.url + "/.well-known/agent-card.json",
                      headers={"if-none-match": response.headers["etag"]})
    assert again.status_code == 304


# --------------------------------------------------------------------------- send / stream


@pytest.mark.parametrize("rest", [False, True], ids=["jsonrpc", "http-json"])
async def test_send_completes_with_final_artifact(server: Served, rest: bool) -> None:
    async with sdk(server.url, streaming=False, rest=rest) as client:
        (response,) = await send_all(client, request("hi there"))
    task = response.task
    assert task.status.state == S.TASK_STATE_COMPLETED
    assert text_of(artifact(task, "answer").parts) == "echo: hi there"
    assert text_of(artifact(task, "stream-s1").parts) == "hello world"
    assert server.admission.released == [f"{task.id}/s1"]


async def test_stream_reports_each_stage_in_order(server: Served) -> None:
    async with sdk(server.url) as client:
        events = await send_all(client, request("stream me"))
    assert events[0].HasField("task")
    assert events[0].task.status.state == S.TASK_STATE_SUBMITTED
    statuses = [(e.status_update.status.state, text_of(e.status_update.status.message.parts))
                for e in events if e.HasField("status_update")]
    assert (S.TASK_STATE_WORKING, "[s1] admitted; worker started") in statuses
    assert (S.TASK_STATE_WORKING, "[s1] turn 1") in statuses
    assert statuses[-1] == (S.TASK_STATE_COMPLETED, "completed 1 subtask(s)")
    chunks = [e.artifact_update for e in events
              if e.HasField("artifact_update") and e.artifact_update.artifact.artifact_id
              == "stream-s1"]
    assert [c.append for c in chunks] == [False, True, True, True]
    assert [c.last_chunk for c in chunks] == [False, False, False, True]
    assert "".join(text_of(c.artifact.parts) for c in chunks) == "hello world"
    answers = [e for e in events if e.HasField("artifact_update")
               and e.artifact_update.artifact.artifact_id == "answer"]
    assert len(answers) == 1


async def test_get_and_list_tasks(server: Served) -> None:
    async with sdk(server.url, streaming=False) as client:
        ids = [(await send_all(client, request(f"job {i}")))[0].task.id for i in range(3)]
        got = await client.get_task(pb.GetTaskRequest(id=ids[1]))
        listed = await client.list_tasks(pb.ListTasksRequest(include_artifacts=True))
        only_failed = await client.list_tasks(pb.ListTasksRequest(status=S.TASK_STATE_FAILED))
    assert got.id == ids[1] and got.status.state == S.TASK_STATE_COMPLETED
    assert text_of(artifact(got, "answer").parts) == "echo: job 1"
    assert {t.id for t in listed.tasks} == set(ids)
    assert all(t.artifacts for t in listed.tasks)
    assert list(only_failed.tasks) == []


async def test_fan_out_runs_every_subtask_through_the_gate(tmp_path: Path) -> None:
    admission = FakeAdmission(slots=1, max_queue=8)
    subtasks = [{"instructions": "block first", "id": "p0"},
                *({"instructions": f"part {i}", "id": f"p{i}"} for i in (1, 2))]
    with serve(tmp_path / "d", admission=admission) as served:
        async with sdk(served.url, streaming=False) as client:
            req = request("shared context", subtasks=subtasks, immediately=True)
            task_id = (await send_all(client, req))[0].task.id
            await await_for(lambda: len(admission.waiting) == 2, what="two subtasks queued")
            served.probe.unblock.set()
            task = await wait_terminal(client, task_id)
    assert task.status.state == S.TASK_STATE_COMPLETED
    answer = artifact(task, "answer")
    assert text_of(answer.parts) == "[p0]\nunblocked\n\n[p1]\necho: part 1\n\n[p2]\necho: part 2"
    summary = MessageToDict(answer.parts[1].data)["subtasks"]
    assert [s["id"] for s in summary] == ["p0", "p1", "p2"]
    for i in (1, 2):
        assert text_of(artifact(task, f"stream-p{i}").parts) == "hello world"
    keys = [f"{task_id}/p{i}" for i in range(3)]
    assert admission.admitted == keys and sorted(admission.released) == keys
    notes = [text_of(m.parts) for m in task.history]
    assert "[p1] queued for the gate at position 1" in notes
    assert "[p2] queued for the gate at position 2" in notes


async def test_worker_failure_fails_the_task_with_the_reason(server: Served) -> None:
    async with sdk(server.url, streaming=False) as client:
        (response,) = await send_all(client, request("fail now"))
    task = response.task
    assert task.status.state == S.TASK_STATE_FAILED
    assert text_of(task.status.message.parts) == "subtask s1 failed: tool exploded"
    assert server.admission.released == [f"{task.id}/s1"]


async def test_a_failing_subtask_leaves_its_siblings_and_the_answer_says_what_is_missing(
    server: Served,
) -> None:
    subtasks = [{"instructions": "block until the other failed", "id": "slow"},
                {"instructions": "fail fast", "id": "bad"},
                {"instructions": "count parcels", "id": "ok"}]
    async with sdk(server.url, streaming=False) as client:
        sent = asyncio.ensure_future(send_all(client, request(subtasks=subtasks)))
        await await_for(lambda: len(server.probe.started) == 3, what="three workers")
        await asyncio.sleep(0.2)  # "bad" has failed by now; "slow" must still be running
        assert not server.probe.cancelled
        server.probe.unblock.set()
        (response,) = await sent
    task = response.task
    assert task.status.state == S.TASK_STATE_COMPLETED
    assert "completed 2 of 3 subtask(s); 1 failed" in text_of(task.status.message.parts)
    (answer,) = [a for a in task.artifacts if a.artifact_id == "answer"]
    text = answer.parts[0].text
    assert "[slow]\nunblocked" in text and "[ok]\necho: count parcels" in text
    assert "Missing from this answer" in text and "subtask bad failed: tool exploded" in text
    rows = {r["id"]: r for r in MessageToDict(answer.parts[1])["data"]["subtasks"]}
    assert rows["bad"]["finishReason"] == "failed" and "tool exploded" in rows["bad"]["error"]
    assert rows["slow"]["finishReason"] == "answer"
    assert len(server.admission.released) == 3


async def test_the_task_fails_when_every_subtask_failed(server: Served) -> None:
    subtasks = [{"instructions": "fail one", "id": "a"}, {"instructions": "fail two", "id": "b"}]
    async with sdk(server.url, streaming=False) as client:
        (response,) = await send_all(client, request(subtasks=subtasks))
    task = response.task
    assert task.status.state == S.TASK_STATE_FAILED
    reason = text_of(task.status.message.parts)
    assert "subtask a failed: tool exploded" in reason and "subtask b failed" in reason


# --------------------------------------------------------------------------- cancel


async def test_cancel_running_task_stops_the_worker(server: Served) -> None:
    async with sdk(server.url, streaming=False) as client:
        (response,) = await send_all(client, request("block here", immediately=True))
        task_id = response.task.id
        await await_for(lambda: f"{task_id}/s1" in server.probe.started, what="worker start")
        canceled = await client.cancel_task(pb.CancelTaskRequest(id=task_id))
        assert canceled.status.state == S.TASK_STATE_CANCELED
        await await_for(lambda: f"{task_id}/s1" in server.probe.cancelled, what="worker cancel")
        await await_for(lambda: f"{task_id}/s1" in server.admission.released, what="release")
        assert f"{task_id}/s1" in server.probe.detached
        stored = await client.get_task(pb.GetTaskRequest(id=task_id))
    assert stored.status.state == S.TASK_STATE_CANCELED
    assert text_of(stored.status.message.parts) == "canceled by the client"


async def test_cancel_queued_task_leaves_the_queue(tmp_path: Path) -> None:
    admission = FakeAdmission(slots=1, max_queue=4)
    with serve(tmp_path / "d", admission=admission) as served:
        async with sdk(served.url, streaming=False) as client:
            first = (await send_all(client, request("block first", immediately=True)))[0].task
            await await_for(lambda: len(admission.active) == 1, what="first admitted")
            second = (await send_all(client, request("echo second", immediately=True)))[0].task
            await await_for(lambda: len(admission.waiting) == 1, what="second queued")
            queued = await client.get_task(pb.GetTaskRequest(id=second.id))
            assert queued.status.state == S.TASK_STATE_SUBMITTED
            assert text_of(queued.status.message.parts) == "[s1] queued for the gate at position 1"
            canceled = await client.cancel_task(pb.CancelTaskRequest(id=second.id))
            assert canceled.status.state == S.TASK_STATE_CANCELED
            await await_for(lambda: admission.dequeued == [f"{second.id}/s1"], what="dequeue")
            assert f"{second.id}/s1" not in served.probe.started
            served.probe.unblock.set()
            done = await wait_terminal(client, first.id)
    assert done.status.state == S.TASK_STATE_COMPLETED
    assert admission.released == [f"{first.id}/s1"]


async def test_cancel_finished_task_is_refused(server: Served) -> None:
    async with sdk(server.url, streaming=False) as client:
        (response,) = await send_all(client, request("quick"))
        with pytest.raises(Exception, match=r"(?i)cancel"):
            await client.cancel_task(pb.CancelTaskRequest(id=response.task.id))


# --------------------------------------------------------------------------- subscribe


async def test_subscribe_after_a_dropped_stream(server: Served) -> None:
    async with sdk(server.url) as client:
        stream = client.send_message(request("block until told"))
        first = await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]  # the client goes away
        task_id = first.task.id
        await await_for(lambda: f"{task_id}/s1" in server.probe.started, what="worker start")
        seen: list[pb.StreamResponse] = []
        async for event in client.subscribe(pb.SubscribeToTaskRequest(id=task_id)):
            seen.append(event)
            if len(seen) == 1:
                assert event.HasField("task")
                assert event.task.status.state == S.TASK_STATE_WORKING
                server.probe.unblock.set()
    last = seen[-1]
    assert last.HasField("status_update")
    assert last.status_update.status.state == S.TASK_STATE_COMPLETED
    assert any(e.HasField("artifact_update") and e.artifact_update.artifact.artifact_id
               == "answer" for e in seen)
