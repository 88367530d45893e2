"""Issue 41, "the first answer is right": what a generic A2A client shows of a planned
task is its answer, never the plan's JSON.

The rule tested, for a streamed and a blocking task with planning on (fake engine):

* the task's last artifact is ``answer`` (id and name), its first part the answer's text:
  what a client that shows a task's last artifact (ADK's ``RemoteA2aAgent``) shows;
* no artifact holds the plan (neither its JSON nor its text forming): the plan is the
  task's metadata (``plan``) and its ``event: plan`` status line; the plan forming
  streams as status lines (``event: text``);
* every other artifact is a ``stream-<id>`` of generated text, before the answer; a task
  the plan answered has the answer as its only artifact (its first and its last), and a
  stream's last artifact event is the answer's, marked ``last_chunk``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict

from tests.support.agent_helpers import Scripted, ScriptedEngine, plan_json, serve_agent
from tests.support.coord_helpers import request, sdk, send_all, text_of

pytestmark = pytest.mark.anyio

S = pb.TaskState

DIRECT = "The weight is checked by check_weight in courier/parcels.py."
PLANS = {
    "delegate": (plan_json("find the weight check", "say what 40 kg does"),
                 "One synthesized answer."),
    "answer": (json.dumps({"action": "answer", "answer": DIRECT}), DIRECT),
}


def _is_plan_json(text: str) -> bool:
    try:
        data = json.loads(text)
    except ValueError:
        return '"action"' in text
    return isinstance(data, dict) and "action" in data


def _assert_generic_view(task: pb.Task, action: str, answer: str) -> None:
    assert task.status.state == S.TASK_STATE_COMPLETED, task.status
    ids = [a.artifact_id for a in task.artifacts]
    last = task.artifacts[-1]
    assert (last.artifact_id, last.name) == ("answer", "answer"), ids
    assert last.parts[0].HasField("text") and last.parts[0].text == answer
    assert ids.count("answer") == 1
    assert all(i.startswith("stream-") and i != "stream-plan" for i in ids[:-1]), ids
    for a in task.artifacts:
        assert not _is_plan_json(text_of(a.parts)), (a.artifact_id, text_of(a.parts))
    if action == "answer":  # no worker: the answer is the only artifact, first and last
        assert ids == ["answer"]
    plan = MessageToDict(task.metadata)["plan"]
    assert plan["action"] == action


@pytest.mark.parametrize("action", sorted(PLANS))
async def test_a_blocking_planned_task_ends_with_the_answer(tmp_path: Path, action: str) -> None:
    plan, answer = PLANS[action]
    engine = ScriptedEngine(Scripted([plan]))
    with serve_agent(tmp_path, engine) as served:
        async with sdk(served.url, streaming=False) as client:
            (response,) = await send_all(client, request("where is the weight checked?"))
            stored = await client.get_task(pb.GetTaskRequest(id=response.task.id))
    _assert_generic_view(response.task, action, answer)
    _assert_generic_view(stored, action, answer)


@pytest.mark.parametrize("action", sorted(PLANS))
async def test_a_streamed_planned_task_ends_with_the_answer(tmp_path: Path, action: str) -> None:
    plan, answer = PLANS[action]
    engine = ScriptedEngine(Scripted([plan]))
    with serve_agent(tmp_path, engine) as served:
        async with sdk(served.url) as client:
            events = await send_all(client, request("where is the weight checked?"))
            task = await client.get_task(pb.GetTaskRequest(id=events[0].task.id))
    _assert_generic_view(task, action, answer)
    updates = [e.artifact_update for e in events if e.HasField("artifact_update")]
    assert updates[-1].artifact.artifact_id == "answer" and updates[-1].last_chunk
    assert text_of(updates[-1].artifact.parts) == answer
    if action == "answer":
        assert [u.artifact.artifact_id for u in updates] == ["answer"]
    assert not any(u.artifact.artifact_id in ("plan", "stream-plan") for u in updates)
    # the plan forming: status lines, which together hold the plan's JSON
    statuses = [e.status_update.status.message for e in events if e.HasField("status_update")]
    notes = [m for m in statuses if MessageToDict(m.metadata).get("event") == "text"]
    assert all(MessageToDict(m.metadata)["subtask"] == "plan" for m in notes)
    assert json.loads("".join(text_of(m.parts) for m in notes)) == json.loads(plan)
