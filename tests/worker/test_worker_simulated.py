"""Scenario mode: seeded schedules, real (fake-engine) generation, scripted tool calls."""

from __future__ import annotations

import threading

import anyio
import pytest

from mesh.sim.fake import FakeEngine
from mesh.template.loader import load_template
from mesh.worker.loop import WorkerFailed
from mesh.worker.simulated import ScenarioParams, ScenarioWorker, plan_schedule, simulated_output
from mesh.worker.types import EventKind, Subtask, WorkerEvent, WorkerResult

HEAVY = load_template("heavy")


def count(text: str) -> int:
    return len(text.split())


def params(**overrides: object) -> ScenarioParams:
    return ScenarioParams.from_subtask(overrides, HEAVY)


def test_same_seed_same_schedule() -> None:
    a = plan_schedule(params(seed=7, steps=5))
    b = plan_schedule(params(seed=7, steps=5))
    c = plan_schedule(params(seed=8, steps=5))
    assert a == b
    assert a != c
    assert [simulated_output(s, count) for s in a] == [simulated_output(s, count) for s in b]


def test_schedule_follows_the_template_and_the_params() -> None:
    spec = HEAVY.manifest.scenario
    default = plan_schedule(params())
    assert len(default) == spec.steps
    assert all(s.tokens == spec.tokens_per_step for s in default)
    for step in default:
        assert spec.tool_latency_s.dist == "lognormal"
        assert 0.05 <= step.latency_s <= 6.0
        assert 60 <= step.output_tokens <= 1200
    fixed = plan_schedule(
        params(
            steps=3,
            tokens_per_step=5,
            tool_latency_s={"dist": "fixed", "value": 0.25},
            tool_output_tokens={"dist": "fixed", "value": 40},
        )
    )
    assert [(s.tokens, s.latency_s, s.output_tokens) for s in fixed] == [(5, 0.25, 40)] * 3


def test_output_has_about_the_scheduled_size() -> None:
    for step in plan_schedule(params(seed=3, steps=4)):
        n = count(simulated_output(step, count))
        assert step.output_tokens <= n <= step.output_tokens + 30


def test_bad_params_are_clear() -> None:
    with pytest.raises(ValueError, match="steps"):
        params(steps=0)
    with pytest.raises(ValueError, match="tool_latency_s"):
        params(tool_latency_s={"dist": "uniform", "min": 2, "max": 1})


def _run(
    engine: FakeEngine, subtask_params: dict[str, object]
) -> tuple[WorkerResult, list[float], list[WorkerEvent]]:
    slept: list[float] = []
    events: list[WorkerEvent] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def emit(event: WorkerEvent) -> None:
        events.append(event)

    async def main() -> WorkerResult:
        worker = ScenarioWorker(engine, HEAVY, sleep=sleep)
        return await worker.run(Subtask("pkg-1", "deliver the package", subtask_params), emit)

    return anyio.run(main), slept, events


def test_scenario_worker_runs_the_schedule() -> None:
    p = {"steps": 3, "tokens_per_step": 6, "seed": 11, "harness_only": "ignored"}
    engine = FakeEngine()
    result, slept, events = _run(engine, p)
    schedule = plan_schedule(params(**p))
    assert result.finish_reason == "answer"
    assert result.num_turns == result.num_tool_calls == 3
    assert result.num_generated == 3 * 6
    assert slept == [s.latency_s for s in schedule]
    calls = [e for e in events if e.kind is EventKind.TOOL_CALL]
    assert [e.text.split("(")[0] for e in calls] == [s.tool for s in schedule]
    assert engine.sessions == {}
    _, slept_again, events_again = _run(FakeEngine(), p)
    assert slept_again == slept
    assert [e.text for e in events_again] == [e.text for e in events]


def test_scenario_failure_detaches() -> None:
    engine = FakeEngine()
    engine.fail_next = "decode failed"
    with pytest.raises(WorkerFailed, match="decode failed"):
        _run(engine, {"steps": 2, "tokens_per_step": 3})
    assert engine.sessions == {}


def test_scenario_context_overflow_ends_with_max_tokens() -> None:
    engine = FakeEngine(session_budget=200)
    result, _, _ = _run(engine, {"steps": 20, "tokens_per_step": 10})
    assert result.finish_reason == "max_tokens"
    assert result.num_turns < 20
    assert engine.sessions == {}


def test_scenario_cancellation_detaches() -> None:
    engine = FakeEngine()

    async def main() -> bool:
        with anyio.CancelScope() as scope:

            async def sleep(seconds: float) -> None:
                scope.cancel()
                await anyio.sleep(0)

            async def emit(event: WorkerEvent) -> None:
                return None

            worker = ScenarioWorker(engine, HEAVY, sleep=sleep)
            await worker.run(Subtask("pkg", "x", {"steps": 2, "tokens_per_step": 2}), emit)
        return scope.cancelled_caught

    assert anyio.run(main) is True
    assert engine.sessions == {}


def test_scenario_output_is_built_off_the_event_loop() -> None:
    """A large simulated output must not stall the loop: it is built in a worker thread."""
    threads: set[int] = set()

    class Recording(FakeEngine):
        def count_tokens(self, text: str) -> int:
            threads.add(threading.get_ident())
            return super().count_tokens(text)

    async def main() -> int:
        async def emit(event: WorkerEvent) -> None:
            return None

        async def sleep(seconds: float) -> None:
            await anyio.sleep(0)

        worker = ScenarioWorker(Recording(), HEAVY, sleep=sleep)
        p = {"steps": 2, "tokens_per_step": 2, "tool_output_tokens": {"dist": "fixed", "value": 50}}
        await worker.run(Subtask("pkg", "x", p), emit)
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert threads, "the worker never counted output tokens"
    assert loop_thread not in threads
