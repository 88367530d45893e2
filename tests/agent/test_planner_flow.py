"""The coordinator as an agent on the scripted fake engine: plan, delegate, synthesize, talk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict

from mesh.agent.task import AgentConfig
from mesh.sim.scenario import PackagePlan
from tests.support.agent_helpers import (
    Scripted,
    ScriptedEngine,
    plan_json,
    reply,
    serve_agent,
)
from tests.support.coord_helpers import artifact, request, sdk, send_all, text_of

pytestmark = pytest.mark.anyio

S = pb.TaskState


async def _send(url: str, req: pb.SendMessageRequest) -> pb.Task:
    async with sdk(url, streaming=False) as client:
        (response,) = await send_all(client, req)
    return response.task


async def test_plan_delegates_to_workers_and_synthesizes_one_answer(tmp_path: Path) -> None:
    script = Scripted([plan_json("find the weight check", "say what 40 kg does")])
    engine = ScriptedEngine(script)
    with serve_agent(tmp_path, engine) as served:
        async with sdk(served.url) as client:
            events = await send_all(client, request("where is the weight checked, and 40 kg?"))
            task = await client.get_task(pb.GetTaskRequest(id=events[0].task.id))
    task_id = task.id
    statuses = [e.status_update.status for e in events if e.HasField("status_update")]
    plan_events = [s for s in statuses
                   if MessageToDict(s.message.metadata).get("event") == "plan"]
    assert len(plan_events) == 1
    plan = MessageToDict(plan_events[0].message.metadata)["plan"]
    assert [p["id"] for p in plan["subtasks"]] == ["p1", "p2"]
    assert statuses[-1].state == S.TASK_STATE_COMPLETED
    assert served.admission.admitted == [
        f"{task_id}/plan", f"{task_id}/p1", f"{task_id}/p2", f"{task_id}/synthesis"]
    assert sorted(served.admission.released) == sorted(served.admission.admitted)
    # The planning turn ran under the plan grammar; the synthesis turn read every report.
    (prompt, plan_params), (synth_prompt, _) = engine.turns
    assert prompt.rstrip().endswith("Plan:") and "where is the weight checked" in prompt
    assert plan_params.grammar is not None and "root ::=" in plan_params.grammar
    assert "echo: find the weight check" in synth_prompt
    assert "echo: say what 40 kg does" in synth_prompt
    assert not engine.sessions  # every coordinator session was detached
    answer = artifact(task, "answer")
    assert text_of(answer.parts) == "One synthesized answer."
    data = MessageToDict(answer.parts[1].data)
    assert [s["id"] for s in data["subtasks"]] == ["p1", "p2"]
    assert set(data["subtasks"][0]) == {
        "id", "instructions", "answer", "turns", "tokens", "toolCalls", "finishReason"}
    assert data["subtasks"][0]["instructions"] == "find the weight check"
    assert MessageToDict(task.metadata)["plan"]["action"] == "delegate"  # never an artifact
    assert [a.artifact_id for a in task.artifacts] == [
        "stream-p1", "stream-p2", "stream-synthesis", "answer"]
    assert text_of(artifact(task, "stream-p1").parts) == "hello world"
    # Each worker gets its part first, then the request it belongs to.
    assert served.probe.instructions[f"{task_id}/p2"] == (
        "say what 40 kg does\nFiles to look at: routes.py\nTools to use: read_file\n"
        "This is part of the user's request: "
        "where is the weight checked, and 40 kg?")
    # the plan forming streamed as status lines, not as an artifact
    notes = [s.message for s in statuses
             if MessageToDict(s.message.metadata).get("event") == "text"]
    assert notes and all(MessageToDict(n.metadata)["subtask"] == "plan" for n in notes)
    assert "delegate" in "".join(text_of(n.parts) for n in notes)


async def test_a_failed_worker_leaves_its_siblings_and_the_answer_says_what_is_missing(
    tmp_path: Path,
) -> None:
    engine = ScriptedEngine(Scripted([plan_json("fail at the weight check", "read 40 kg")]))
    with serve_agent(tmp_path, engine) as served:
        task = await _send(served.url, request("two parts"))
    assert task.status.state == S.TASK_STATE_COMPLETED
    assert served.probe.cancelled == []
    text = text_of(artifact(task, "answer").parts)
    assert text.startswith("One synthesized answer.")
    assert "Missing" in text and "[p1]" in text and "tool exploded" in text
    rows = MessageToDict(artifact(task, "answer").parts[1].data)["subtasks"]
    assert rows[0]["finishReason"] == "failed" and "tool exploded" in rows[0]["error"]
    assert rows[1]["answer"].startswith("echo: read 40 kg\nFiles to look at: routes.py")
    assert "FAILED: subtask p1 failed: tool exploded" in engine.turns[-1][0]


async def test_every_worker_failing_fails_the_task_with_reasons(tmp_path: Path) -> None:
    engine = ScriptedEngine(Scripted([plan_json("fail one", "fail two")]))
    with serve_agent(tmp_path, engine) as served:
        task = await _send(served.url, request("two parts"))
    assert task.status.state == S.TASK_STATE_FAILED
    reason = text_of(task.status.message.parts)
    assert "all 2 subtask(s) failed" in reason and "[p1]" in reason and "[p2]" in reason
    assert len(engine.turns) == 1  # no synthesis turn for nothing


async def test_a_direct_answer_needs_no_worker(tmp_path: Path) -> None:
    direct = json.dumps({"action": "answer", "answer": "Forty kilograms is too heavy."})
    engine = ScriptedEngine(Scripted([direct]))
    with serve_agent(tmp_path, engine) as served:
        task = await _send(served.url, request("is 40 kg too heavy?"))
    assert task.status.state == S.TASK_STATE_COMPLETED
    assert text_of(artifact(task, "answer").parts) == "Forty kilograms is too heavy."
    assert served.probe.started == [] and len(engine.turns) == 1


async def test_ask_goes_to_input_required_and_the_reply_resumes_the_task(
    tmp_path: Path,
) -> None:
    ask = json.dumps({"action": "ask", "question": "Which parcel service?"})
    engine = ScriptedEngine(Scripted([ask, plan_json("check the express service")]))
    with serve_agent(tmp_path, engine) as served:
        first = await _send(served.url, request("how heavy may a parcel be?"))
        assert first.status.state == S.TASK_STATE_INPUT_REQUIRED
        assert text_of(first.status.message.parts) == "Which parcel service?"
        resumed = await _send(served.url, reply("express", context_id=first.context_id,
                                                task_id=first.id))
    assert resumed.id == first.id
    assert resumed.status.state == S.TASK_STATE_COMPLETED
    second_plan = engine.turns[1][0]
    assert "User: how heavy may a parcel be?" in second_plan
    assert "Coordinator asked: Which parcel service?" in second_plan
    assert second_plan.index("User request:\nexpress") > second_plan.index("Coordinator asked")


async def test_a_follow_up_in_the_context_sees_the_earlier_answer(tmp_path: Path) -> None:
    # Two subtasks: one would be answered by its worker, without a synthesis turn.
    script = Scripted([plan_json("check 40 kg", "check the limit")],
                      synthesis="A 40 kg parcel is refused.")
    engine = ScriptedEngine(script)
    with serve_agent(tmp_path, engine) as served:
        first = await _send(served.url, request("what happens to 40 kg?"))
        second = await _send(served.url, reply("And for 25 kg?", context_id=first.context_id))
        other = await _send(served.url, request("unrelated"))
    assert second.id != first.id and second.context_id == first.context_id
    assert second.status.state == S.TASK_STATE_COMPLETED
    plans = [p for p, params in engine.turns if params.grammar]
    assert "Coordinator answered: A 40 kg parcel is refused." in plans[1]
    assert "User: what happens to 40 kg?" in plans[1]
    assert "Earlier in this conversation" not in plans[2]  # a new context starts empty
    assert other.context_id != first.context_id


async def test_history_over_budget_drops_the_oldest_and_says_so(tmp_path: Path) -> None:
    long_answer = " ".join(f"ok{i}" for i in range(30))  # "ok " * 30 is a loop: cut
    engine = ScriptedEngine(Scripted([json.dumps({"action": "answer", "answer": long_answer})]))
    cfg = AgentConfig(history_tokens=40, tools=("read_file",))
    with serve_agent(tmp_path, engine, agent_config=cfg) as served:
        first = await _send(served.url, request("first question " * 5))
        async with sdk(served.url) as client:
            events = await send_all(client, reply("second", context_id=first.context_id))
    texts = [text_of(e.status_update.status.message.parts)
             for e in events if e.HasField("status_update")]
    assert any("1 earlier message(s)" in t and "1 older dropped" in t for t in texts), texts
    assert "first question" not in engine.turns[-1][0]


async def test_explicit_subtasks_and_plan_never_skip_planning(tmp_path: Path) -> None:
    engine = ScriptedEngine(Scripted([plan_json("unused")]))
    with serve_agent(tmp_path, engine) as served:
        task = await _send(served.url, request(subtasks=[{"instructions": "a"}]))
    assert task.status.state == S.TASK_STATE_COMPLETED and engine.turns == []
    with serve_agent(tmp_path / "never", engine, plan="never") as served:
        task = await _send(served.url, request("plain text"))
    assert task.status.state == S.TASK_STATE_COMPLETED and engine.turns == []
    assert text_of(artifact(task, "answer").parts) == "echo: plain text"


@pytest.mark.parametrize("mode", ["auto", "always"])
async def test_an_unparseable_plan_falls_back_in_auto_and_fails_in_always(
    tmp_path: Path, mode: str
) -> None:
    engine = ScriptedEngine(Scripted(["not a plan"]))
    with serve_agent(tmp_path, engine, plan=mode) as served:
        task = await _send(served.url, request("plain text"))
    if mode == "auto":
        assert task.status.state == S.TASK_STATE_COMPLETED
        assert text_of(artifact(task, "answer").parts) == "echo: plain text"
        plan = MessageToDict(task.metadata)["plan"]
        assert plan["source"] == "fallback"
        assert len(engine.turns) == 1  # a fallback is answered as the dispatcher did
    else:
        assert task.status.state == S.TASK_STATE_FAILED
        assert "planning failed: the plan is not JSON" in text_of(task.status.message.parts)


async def test_a_simulation_package_bypasses_planning(tmp_path: Path) -> None:
    from a2a.helpers.proto_helpers import new_data_message  # as the sim driver does

    package = PackagePlan(index=0, seed=1, params={"scenario": "light", "steps": 1}, steps=())
    engine = ScriptedEngine(Scripted([plan_json("unused")]))
    with serve_agent(tmp_path, engine, simulation=True) as served:
        message = new_data_message(package.message_data(), role=pb.Role.ROLE_USER)
        task = await _send(served.url, pb.SendMessageRequest(message=message))
    assert task.status.state == S.TASK_STATE_COMPLETED
    assert engine.turns == [] and served.admission.admitted == [f"{task.id}/p0"]
