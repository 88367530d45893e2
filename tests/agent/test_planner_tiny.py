"""The coordinator as an agent on the real tiny model (random weights: its turns are noise).

Under the plan grammar that noise is still a plan every time; the tests drive planning,
synthesis, partial failure, INPUT_REQUIRED and continuation through the real pool, the
real gate and the real worker loop, over JSON-RPC.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.a2a.app import build_app
from mesh.a2a.config import CoordinatorConfig
from mesh.agent.plans import parse_plan
from mesh.agent.task import Agent, AgentConfig
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.template.loader import load_template
from mesh.template.prefix import build_prefix
from mesh.worker.loop import AgentWorker
from mesh.worker.tools import ProjectTools
from mesh.worker.types import Emit, Subtask, WorkerResult
from tests.reliability.serve_proc import small_project

pytestmark = pytest.mark.anyio

H = {"A2A-Version": "1.0"}
TOOLS = ("list_files", "read_file")


class _Sink:
    def __init__(self) -> None:
        self.text = ""

    async def add(self, text: str) -> None:
        self.text += text

    async def flush(self, now: float | None = None, *, last: bool = False) -> None:
        return None


@dataclass
class Stack:
    client: httpx.AsyncClient
    pool: SharedKVPool
    agent: Agent
    prompts: list[str] = field(default_factory=list)

    async def send(self, text: str, **ids: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "ROLE_USER", "messageId": uuid.uuid4().hex,
                               "parts": [{"text": text}], **ids}
        body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": msg}}
        r = await self.client.post("/", json=body, headers=H)
        assert r.status_code == 200, r.text
        doc = r.json()
        assert "result" in doc, doc
        task: dict[str, Any] = doc["result"]["task"]
        return task


class _FailFirst:
    """The real agent worker, except that subtask p1 fails (a worker that raised)."""

    def __init__(self, worker: AgentWorker) -> None:
        self.worker = worker

    async def run(self, subtask: Subtask, emit: Emit) -> WorkerResult:
        if subtask.id.endswith("/p1"):
            raise RuntimeError("p1 was told to fail")
        return await self.worker.run(subtask, emit)


@asynccontextmanager
async def tiny_stack(
    model: Path, tmp: Path, *, fail_first: bool = False, **agent_cfg: Any
) -> AsyncIterator[Stack]:
    template = load_template("light")
    project = small_project(tmp / "project")
    prefix = build_prefix(template, project, lambda text: len(text) // 3, target_tokens=128)
    pool = SharedKVPool(EngineConfig(model_path=str(model), max_sessions=6,
                                     session_budget=1024, n_threads=1), prefix.text)
    info = await pool.start()
    prompts: list[str] = []

    def render(prompt: str) -> str:
        prompts.append(prompt)
        return prompt

    agent_cfg.setdefault("max_subtasks", 3)
    agent = Agent(pool, AgentConfig(text_max=32, synthesis_max_tokens=32, tools=TOOLS,
                                    **agent_cfg), render=render)
    tools = ProjectTools(project).as_tools()

    def worker() -> Any:
        w = AgentWorker(pool, template, tools)
        return _FailFirst(w) if fail_first else w

    try:
        gate = FloorGate(pool, GateConfig.create(policy="none", max_queue=16))
        app = build_app(CoordinatorConfig(data_dir=str(tmp / "data")), worker_factory=worker,
                        admission=gate, pool_info=info, agent=agent)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://mesh",
                                         timeout=120) as client:
                yield Stack(client, pool, agent, prompts)
    finally:
        await pool.aclose()


def _artifact(task: dict[str, Any], artifact_id: str) -> dict[str, Any]:
    found = [a for a in task.get("artifacts", []) if a["artifactId"] == artifact_id]
    assert found, [a["artifactId"] for a in task.get("artifacts", [])]
    first: dict[str, Any] = found[0]
    return first


def _text(parts: list[dict[str, Any]]) -> str:
    return "".join(p.get("text", "") for p in parts)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_noise_under_the_plan_grammar_is_always_a_plan(
    tiny_model_path: Path, tmp_path: Path, temperature: float
) -> None:
    async with tiny_stack(tiny_model_path, tmp_path, temperature=temperature) as stack:
        agent = stack.agent
        plans = []
        for seed in range(6):
            p = agent.plan_params()
            params = SamplingParams(max_tokens=p.max_tokens, temperature=temperature,
                                    seed=seed, grammar=p.grammar)
            turn = await agent.turn(f"Request {seed}. Plan:\n", params, _Sink())
            assert turn.finish_reason == "stop", turn
            plans.append(parse_plan(turn.text, agent.config.max_subtasks))
        assert stack.pool.load().sessions == ()
    assert all(1 <= len(p.subtasks) <= 3 for p in plans if p.action == "delegate")
    assert all(len(s.instructions) <= 32 for p in plans for s in p.subtasks)  # text_max


async def test_noise_under_the_plan_grammar_writes_no_junk_instructions(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Random weights love ", " and " 1." as instructions; the grammar rules them out."""
    instructions: list[str] = []
    async with tiny_stack(tiny_model_path, tmp_path, actions=("delegate",),
                          temperature=1.0) as stack:
        agent = stack.agent
        p = agent.plan_params()
        for seed in range(24):
            params = SamplingParams(max_tokens=p.max_tokens, temperature=1.0, seed=100 + seed,
                                    grammar=p.grammar)
            turn = await agent.turn(f"Request {seed}. Plan:\n", params, _Sink())
            plan = parse_plan(turn.text, agent.config.max_subtasks)
            instructions += [s.instructions for s in plan.subtasks]
    assert len(instructions) >= 24
    for text in instructions:
        assert text[0].isascii() and text[0].isalpha(), text
        # INSTRUCTIONS_MIN, after strip() (the upper bound counts code points; a broken
        # UTF-8 sequence in the noise decodes to several U+FFFD here)
        assert len(text) >= 12, text


async def test_a_planned_task_runs_workers_and_synthesizes(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    # Guided: one subtask per part of the request, so the noise plans two and synthesizes
    # (a free plan's count is the noise's: one subtask needs no synthesis turn).
    async with tiny_stack(tiny_model_path, tmp_path, actions=("delegate",),
                          style="guided") as stack:
        task = await stack.send("Which function checks the weight, and what does 40 kg do?")
        assert stack.pool.load().sessions == ()
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]
    plan = task["metadata"]["plan"]
    assert plan["action"] == "delegate" and plan["source"] == "model"
    n = len(plan["subtasks"])
    assert 1 <= n <= 3
    answer = _artifact(task, "answer")
    rows = answer["parts"][1]["data"]["subtasks"]
    assert [r["id"] for r in rows] == [f"p{i + 1}" for i in range(n)]
    assert all(r["finishReason"] in ("answer", "max_turns", "max_tokens") for r in rows)
    for i in range(n):
        _artifact(task, f"stream-p{i + 1}")
    _artifact(task, "stream-synthesis")
    assert stack.prompts[-1].endswith("Answer:\n")  # the synthesis turn read the reports
    assert all(f"[p{i + 1}]" in stack.prompts[-1] for i in range(n))


async def test_noise_under_a_guided_grammar_keeps_every_part_of_the_request(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Guided planning: whatever the noise, one subtask per part, each opening with its
    part, in order, naming only the project's files."""
    message = "Which function checks the weight, and what does a parcel of 40 kg do?"
    parts = ("Which function checks the weight?", "What does a parcel of 40 kg do?")
    files = ("courier/parcels.py", "courier/routes.py")
    async with tiny_stack(tiny_model_path, tmp_path, actions=("delegate",), style="guided",
                          files=files, temperature=1.0) as stack:
        agent = stack.agent
        p = agent.plan_params(message)
        named: set[str] = set()
        for seed in range(12):
            params = SamplingParams(max_tokens=p.max_tokens, temperature=1.0, seed=seed,
                                    grammar=p.grammar)
            turn = await agent.turn(f"{message}\nPlan:\n", params, _Sink())
            assert turn.finish_reason == "stop", turn
            plan = parse_plan(turn.text, agent.config.max_subtasks)
            assert [s.instructions[:len(part)] for s, part in
                    zip(plan.subtasks, parts, strict=True)] == list(parts), plan
            named |= {f for s in plan.subtasks for f in s.files}
        assert named <= set(files)
        # through A2A: the plan's two parts ran as two workers, then one synthesis
        task = await stack.send(message)
        assert stack.pool.load().sessions == ()
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]
    plan_data = task["metadata"]["plan"]
    assert [s["instructions"][:len(part)] for s, part in
            zip(plan_data["subtasks"], parts, strict=True)] == list(parts)
    for stream in ("stream-p1", "stream-p2", "stream-synthesis"):
        assert _artifact(task, stream)["parts"] is not None


async def test_a_failed_worker_gives_a_partial_answer_or_fails_alone(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    partial = 0
    async with tiny_stack(tiny_model_path, tmp_path, fail_first=True, temperature=1.0,
                          actions=("delegate",)) as stack:
        for i in range(6):
            task = await stack.send(f"Part {i}: the weight check, and the 40 kg case.")
            plan = task["metadata"]["plan"]
            if len(plan["subtasks"]) == 1:  # p1 was every worker: nothing to answer with
                assert task["status"]["state"] == "TASK_STATE_FAILED"
                assert "p1 was told to fail" in _text(task["status"]["message"]["parts"])
                continue
            partial += 1
            assert task["status"]["state"] == "TASK_STATE_COMPLETED"
            answer = _artifact(task, "answer")
            assert "Missing from this answer" in _text(answer["parts"])
            rows = answer["parts"][1]["data"]["subtasks"]
            assert rows[0]["finishReason"] == "failed"
            assert all(r["finishReason"] != "failed" for r in rows[1:])
            assert "FAILED: subtask p1 failed: p1 was told to fail" in stack.prompts[-1]
        assert stack.pool.load().sessions == ()
    assert partial >= 1  # the noise planned two or more subtasks at least once


async def test_ask_waits_for_input_and_the_reply_resumes_with_the_history(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    async with tiny_stack(tiny_model_path, tmp_path, actions=("ask",)) as stack:
        first = await stack.send("How heavy may a parcel be?")
        assert first["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
        question = _text(first["status"]["message"]["parts"])
        assert question.strip()
        again = await stack.send("express", taskId=first["id"], contextId=first["contextId"])
        assert stack.pool.load().sessions == ()
    assert again["id"] == first["id"]
    assert again["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
    assert "User: How heavy may a parcel be?" in stack.prompts[1]
    assert f"Coordinator asked: {question}" in stack.prompts[1]


async def test_a_follow_up_in_the_context_continues_the_conversation(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    async with tiny_stack(tiny_model_path, tmp_path, actions=("answer",)) as stack:
        first = await stack.send("What happens to a 40 kg parcel?")
        second = await stack.send("And for 25 kg?", contextId=first["contextId"])
    assert first["status"]["state"] == second["status"]["state"] == "TASK_STATE_COMPLETED"
    answer = _text(_artifact(first, "answer")["parts"])
    assert answer.strip()
    assert second["contextId"] == first["contextId"] and second["id"] != first["id"]
    assert f"Coordinator answered: {answer.strip()[:40]}" in stack.prompts[1]

