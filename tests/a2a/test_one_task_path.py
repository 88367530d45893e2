"""One task path, parse once (issue 26, items 1 and 2): explicit subtasks are a plan
(``source="explicit"``) answered in the one schema; the subtask list and the hops are read
once, at the door, and travel with the request (the call context) and the subtasks (their
``hops``), never through a ContextVar."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from mesh.a2a import validation as shapes_mod
from mesh.agent import plans as subtasks_mod
from mesh.worker.tools import DelegateTool, ToolError, delegate_tool
from mesh.worker.types import NO_HOPS, Hops, Subtask, WorkerResult
from tests.support.coord_helpers import FakeAdmission

pytestmark = pytest.mark.anyio


def send(parts: list[dict[str, Any]], metadata: dict[str, Any] | None = None,
         method: str = "SendMessage") -> dict[str, Any]:
    msg: dict[str, Any] = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": parts}
    if metadata is not None:
        msg["metadata"] = metadata
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": {"message": msg}}


async def get_task(client: Any, task_id: str) -> dict[str, Any]:
    r = await client.post("/", json={"jsonrpc": "2.0", "id": 2, "method": "GetTask",
                                     "params": {"id": task_id}})
    return dict(r.json()["result"])


def answer_data(task: dict[str, Any]) -> dict[str, Any]:
    answer = next(a for a in task["artifacts"] if a["artifactId"] == "answer")
    return dict(next(p["data"] for p in answer["parts"] if "data" in p))


async def test_explicit_subtasks_are_a_plan_answered_in_the_one_schema(asgi: Any) -> None:
    subtasks = [{"id": "a", "instructions": "count parcels"},
                {"id": "b", "instructions": "weigh parcels"}]
    async with asgi() as (client, _):
        r = await client.post("/", json=send([{"text": "the depot"},
                                              {"data": {"subtasks": subtasks}}]))
        task = r.json()["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    data = answer_data(task)
    assert data["plan"]["source"] == "explicit"
    assert [s["id"] for s in data["plan"]["subtasks"]] == ["a", "b"]
    rows = {row["id"]: row for row in data["subtasks"]}
    for sid, spec in zip("ab", subtasks, strict=True):
        row = rows[sid]
        assert row["instructions"] == spec["instructions"]
        assert (row["turns"], row["tokens"], row["toolCalls"]) == (1, 3, 0)
        # the explicit schema's names, kept readable for one release
        assert (row["turns"], row["tokens"], row["toolCalls"]) == (1, 3, 0)


async def test_the_subtask_list_is_checked_once_per_request(
    asgi: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = subtasks_mod.check_subtask_list

    def counted(value: Any, max_subtasks: int, where: str = "subtasks") -> Any:
        calls.append(where)
        return real(value, max_subtasks, where)

    # wherever a copy of the check is reached from (the door, or a second parse)
    monkeypatch.setattr(subtasks_mod, "check_subtask_list", counted)
    monkeypatch.setattr(shapes_mod, "check_subtask_list", counted)
    async with asgi() as (client, _):
        r = await client.post("/", json=send([{"data": {"subtasks": [
            {"instructions": "count parcels"}, {"instructions": "weigh parcels"}]}}]))
        assert r.json()["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    assert calls == ["params.message.parts[0].data.subtasks"]


seen_hops: list[Hops] = []


class HopRecorder:
    async def run(self, subtask: Subtask, emit: Any) -> WorkerResult:
        seen_hops.append(subtask.hops)
        return WorkerResult("ok", 1, 1, 0, "answer")


async def test_the_incoming_hops_reach_every_subtask_as_an_argument(tmp_path: Any) -> None:
    import httpx

    from mesh.a2a.app import build_app
    from mesh.a2a.config import CoordinatorConfig

    seen_hops.clear()
    app = build_app(CoordinatorConfig(data_dir=str(tmp_path / "data")),
                    worker_factory=HopRecorder, admission=FakeAdmission(), pool_info=None)
    meta = {"meshHops": 2, "meshChain": ["x", "y"]}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://mesh",
        headers={"A2A-Version": "1.0"},
    ) as client:
        parts = [{"data": {"subtasks": [{"instructions": "one"}, {"instructions": "two"}]}}]
        r = await client.post("/", json=send(parts, meta))
        assert r.json()["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
        r = await client.post("/", json=send([{"text": "no hops"}]))
        assert r.json()["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    assert seen_hops == [Hops(2, ("x", "y")), Hops(2, ("x", "y")), NO_HOPS]


async def test_a_0_3_message_with_bad_subtasks_is_refused_at_the_door(asgi: Any) -> None:
    msg = {"kind": "message", "messageId": uuid.uuid4().hex, "role": "user",
           "parts": [{"kind": "data", "data": {"subtasks": [{"instructions": "  "}]}}]}
    async with asgi() as (client, _):
        r = await client.post("/", json={"jsonrpc": "2.0", "id": 7, "method": "message/send",
                                         "params": {"message": msg}},
                              headers={"A2A-Version": "0.3"})
    error = r.json()["error"]
    assert error["code"] == -32602 and "instructions must be a non-empty string" in (
        error["message"])


async def test_0_3_messages_run_their_subtasks_on_both_surfaces(asgi: Any) -> None:
    subtasks = [{"id": "a", "instructions": "count parcels"},
                {"id": "b", "instructions": "weigh parcels"}]
    rpc_msg = {"kind": "message", "messageId": uuid.uuid4().hex, "role": "user",
               "parts": [{"kind": "text", "text": "the depot"},
                         {"kind": "data", "data": {"subtasks": subtasks}}]}
    rest_msg = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER",
                "content": [{"text": "the depot"}, {"data": {"data": {"subtasks": subtasks}}}]}
    admission = FakeAdmission()
    async with asgi(admission=admission) as (client, _):
        r = await client.post("/", json={"jsonrpc": "2.0", "id": 7, "method": "message/send",
                                         "params": {"message": rpc_msg}},
                              headers={"A2A-Version": "0.3"})
        rpc_id = r.json()["result"]["id"]
        r = await client.post("/a2a/v1/message:send", json={"message": rest_msg},
                              headers={"A2A-Version": "0.3"})
        assert r.status_code == 200, r.text
        rest_id = r.json()["task"]["id"]
        for task_id in (rpc_id, rest_id):
            task = await get_task(client, task_id)
            assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
            rows = answer_data(task)["subtasks"]
            assert [row["answer"] for row in rows] == [
                "echo: count parcels", "echo: weigh parcels"]
    assert sorted(admission.admitted) == sorted(
        f"{t}/{s}" for t in (rpc_id, rest_id) for s in "ab")


async def test_the_delegate_tool_sends_the_hops_it_is_bound_to() -> None:
    sent: list[tuple[Any, ...]] = []

    async def send_to(peer: str, text: str, *hops: Hops) -> str:
        sent.append((peer, text, *hops))
        return "done"

    tool = delegate_tool(send_to)
    assert isinstance(tool, DelegateTool)
    bound = tool.for_hops(Hops(1, ("a",)))
    assert await bound({"peer": "b", "text": "go"}) == "done"
    assert await tool({"peer": "b", "text": "go"}) == "done"  # unbound: send(peer, text)
    assert sent == [("b", "go", Hops(1, ("a",))), ("b", "go")]
    with pytest.raises(ToolError):
        await bound({"peer": "", "text": "go"})


async def test_progress_never_takes_a_working_task_back_to_submitted() -> None:
    """A planned task is working once its planning turn is admitted; its subtasks' queue
    positions are then said in the working state, not as a step back to submitted."""
    from a2a.types import a2a_pb2 as pb

    from mesh.a2a import executor as executor_mod

    states: list[int] = []

    class Updater:
        def new_agent_message(self, parts: Any, metadata: Any = None) -> Any:
            return None

        async def update_status(self, state: int, message: Any = None) -> None:
            states.append(state)

    run = executor_mod._Run(Updater())  # type: ignore[arg-type]
    await run.progress("[plan] queued for the gate at position 1", {})
    await run.status(pb.TaskState.TASK_STATE_WORKING, "[plan] admitted; plan turn")
    await run.progress("[p1] queued for the gate at position 1", {})
    assert states == [pb.TaskState.TASK_STATE_SUBMITTED, pb.TaskState.TASK_STATE_WORKING,
                      pb.TaskState.TASK_STATE_WORKING]
