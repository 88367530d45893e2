"""DispatchWorker: scenario subtasks run the scripted scenario, others the agent loop."""

from __future__ import annotations

import pytest

from mesh.sim.fake import FakeEngine
from mesh.template.loader import load_template
from mesh.worker.dispatch import DispatchWorker
from mesh.worker.types import EventKind, Subtask, WorkerEvent

pytestmark = pytest.mark.anyio


async def run(
    params: dict[str, object], *, simulation: bool = True
) -> tuple[list[WorkerEvent], object, FakeEngine]:
    engine = FakeEngine()
    events: list[WorkerEvent] = []

    async def emit(event: WorkerEvent) -> None:
        events.append(event)

    worker = DispatchWorker(engine, load_template("light"), tools={}, simulation=simulation)
    result = await worker.run(Subtask(id="t1", instructions="deliver it", params=params), emit)
    return events, result, engine


async def test_scenario_params_run_the_scripted_scenario() -> None:
    events, result, engine = await run({
        "scenario": True, "steps": 2, "tokens_per_step": 3, "seed": 1,
        "tool_latency_s": {"dist": "fixed", "value": 0.0},
        "tool_output_tokens": {"dist": "fixed", "value": 5},
    })
    calls = [e for e in events if e.kind is EventKind.TOOL_CALL]
    assert len(calls) == 2, "one scripted tool call per step"
    assert getattr(result, "num_generated", 0) == 6
    assert engine.sessions == {}, "the session is detached"


async def test_plain_subtasks_run_the_agent_loop() -> None:
    events, result, engine = await run({})
    assert any(e.kind is EventKind.TURN_STARTED for e in events)
    assert not [e for e in events if e.kind is EventKind.TOOL_CALL]
    assert getattr(result, "finish_reason", "") in {"answer", "max_turns", "max_tokens"}
    assert engine.sessions == {}
