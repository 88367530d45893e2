"""The decode gate on engines whose turns run on the event loop (the fake, a remote OpenAI
backend): a turn waits in a :class:`TurnLine` until the gate has room, in the pool's
completion order (priority, then first come first served), with its place in line in the
engine's load; one always runs, and every way a turn ends gives its place back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest

from mesh.backends.openai import BackendConfig, OpenAIEngine
from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, Session, SessionState, StepSample, TurnLine
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.sim.fake import FakeEngine

pytestmark = pytest.mark.anyio


class Room:
    """A decode gate that allows ``limit`` running turns and records what it was asked."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.asked: list[int] = []
        self.fail = False

    def turn_room(self, num_running: int, cells_used: int,
                  recent: Sequence[StepSample]) -> int:
        self.asked.append(num_running)
        if self.fail:
            raise RuntimeError("broken gate")
        return self.limit - num_running


async def drain(session: Session, max_tokens: int = 3) -> str:
    gen = session.generate(SamplingParams(max_tokens=max_tokens))
    return "".join([p.text async for p in gen])


async def two_turns(engine: Engine) -> tuple[Session, Session]:
    a, b = await engine.attach(), await engine.attach()
    a.append("alpha beta gamma")
    b.append("delta epsilon zeta")
    return a, b


def state_of(engine: Engine, session: Session) -> SessionState:
    return next(s.state for s in engine.load().sessions if s.id == session.id)


async def test_a_turn_waits_for_room_and_one_always_runs() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    room = Room(limit=1)
    engine.set_turn_admission(room)
    a, b = await two_turns(engine)
    first = asyncio.create_task(drain(a, 5))
    await asyncio.sleep(0.03)  # a runs (the line lets one run when none does)
    second = asyncio.create_task(drain(b, 5))
    await asyncio.sleep(0.03)
    assert state_of(engine, b) is SessionState.WAITING
    assert engine.turn_line.running == 1 and engine.turn_line.waiting == 1
    assert await first == "alpha beta gamma alpha beta"
    assert await second == "delta epsilon zeta delta epsilon"
    assert engine.turn_line.running == 0 and engine.turn_line.waiting == 0
    assert room.asked and max(room.asked) == 1  # never asked past the limit


async def test_room_for_two_runs_two_and_none_set_runs_all() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    engine.set_turn_admission(Room(limit=2))
    a, b = await two_turns(engine)
    tasks = [asyncio.create_task(drain(s, 4)) for s in (a, b)]
    await asyncio.sleep(0.03)
    assert engine.turn_line.running == 2
    await asyncio.gather(*tasks)
    engine.set_turn_admission(None)
    c = await engine.attach()
    for s in (a, b, c):
        s.append("more words")
    await asyncio.gather(*(drain(s) for s in (a, b, c)))
    assert engine.turn_line.running == 0


async def test_a_cancelled_waiting_turn_leaves_the_line_and_holds_nothing() -> None:
    engine = FakeEngine(step_delay_s=0.05)
    engine.set_turn_admission(Room(limit=1))
    a, b = await two_turns(engine)
    first = asyncio.create_task(drain(a, 4))
    await asyncio.sleep(0.02)
    second = asyncio.create_task(drain(b, 4))
    await asyncio.sleep(0.02)
    assert engine.turn_line.waiting == 1
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert engine.turn_line.waiting == 0
    assert state_of(engine, b) is not SessionState.WAITING
    await first
    assert engine.turn_line.running == 0
    b.append("again")  # the session still works
    assert await drain(b, 2)


async def test_a_broken_gate_holds_waiting_turns_without_failing_the_running_one() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    room = Room(limit=1)
    room.fail = True
    engine.set_turn_admission(room)
    a, b = await two_turns(engine)
    first = asyncio.create_task(drain(a, 3))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(drain(b, 3))
    assert await first  # the lone turn ran (never asked: none was running)
    assert await second  # then b ran alone: one always runs when none does


class SlowBackend:
    """An OpenAI-compatible backend whose every stream waits for ``go`` before it ends."""

    def __init__(self) -> None:
        self.started = 0
        self.go = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "m", "object": "model", "owned_by": "llamacpp"}]})
        body: dict[str, Any] = json.loads(request.content)
        if not body.get("stream"):  # the warm-up
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        self.started += 1
        await self.go.wait()
        chunks = [{"choices": [{"index": 0, "text": "ok", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}]
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        return httpx.Response(200, content=data + b"data: [DONE]\n\n")


async def test_a_remote_backend_sends_a_turn_only_once_the_gate_has_room() -> None:
    backend = SlowBackend()
    http = httpx.AsyncClient(transport=httpx.MockTransport(backend))
    engine = OpenAIEngine(BackendConfig(url="http://backend", poll_metrics=False), "PREFIX",
                          http=http)
    await engine.start()
    try:
        gate = FloorGate(engine, GateConfig.create(policy="floor"))
        engine.set_turn_admission(Room(limit=1))  # what gate.install() hands over, made strict
        a, b = await two_turns(engine)
        tasks = [asyncio.create_task(drain(s)) for s in (a, b)]
        await asyncio.sleep(0.05)
        assert backend.started == 1, "the second request waits on mesh's side"
        assert state_of(engine, b) is SessionState.WAITING
        # Its place in line, as the pool and the fake report it.
        assert {s.id: s.turn_place for s in engine.load().sessions} == {a.id: None, b.id: 1}
        assert engine.turn_place(b.id) == 1 and engine.turn_place(a.id) is None
        backend.go.set()
        assert await asyncio.gather(*tasks) == ["ok", "ok"]
        assert backend.started == 2 and engine.turn_line.running == 0
        gate.install()  # the floor gate's own decode gate goes in the same way
        assert engine.turn_line.gate is gate.decode_gate()
    finally:
        await engine.aclose()
        await http.aclose()


# -------------------- completion order and places, as on the pool --------------------

async def until(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Wait (a few loop turns at a time) until ``check()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def cancelled(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and see it end cancelled (a lost cancel fails, never hangs)."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(2):
            await task


def strict_line() -> TurnLine:
    line = TurnLine(lambda: 0, tuple, recheck_s=0.01)
    line.gate = Room(limit=1)  # one turn at a time
    return line


async def enter_and_log(line: TurnLine, log: list[str], priority: float, owner: str) -> None:
    await line.enter(priority, owner)
    log.append(owner)


async def test_an_older_tasks_second_turn_goes_before_a_newer_tasks_first() -> None:
    """The pool's completion order (scheduler.order: priority, then the order asked): the
    older task's turn, asked last, is first in line and runs first."""
    line, log = strict_line(), list[str]()
    await line.enter(5.0, "running")  # none runs: it starts at once
    newer = asyncio.create_task(enter_and_log(line, log, 30.0, "newer-task-turn-1"))
    await until(lambda: line.waiting == 1)
    older = asyncio.create_task(enter_and_log(line, log, 10.0, "older-task-turn-2"))
    await until(lambda: line.waiting == 2)
    assert line.places() == {"older-task-turn-2": 1, "newer-task-turn-1": 2}
    assert line.place("older-task-turn-2") == 1 and line.place("newer-task-turn-1") == 2
    assert line.place("running") is None  # a running turn has no place
    await asyncio.sleep(0.05)
    assert log == []  # nothing starts while one runs and the gate has no room
    line.leave()
    await older
    assert log == ["older-task-turn-2"] and line.place("older-task-turn-2") is None
    assert line.places() == {"newer-task-turn-1": 1}
    line.leave()
    await newer
    assert log == ["older-task-turn-2", "newer-task-turn-1"]
    line.leave()
    assert line.waiting == 0 and line.places() == {} and line.running == 0


async def test_equal_priorities_wait_first_come_first_served() -> None:
    line, log = strict_line(), list[str]()
    await line.enter(1.0, "running")
    tasks = []
    for name in ("a", "b", "c"):
        tasks.append(asyncio.create_task(enter_and_log(line, log, 7.0, name)))
        waiting = len(tasks)
        await until(lambda: line.waiting == waiting)  # noqa: B023 (awaited here)
    tasks.append(asyncio.create_task(enter_and_log(line, log, 3.0, "older")))
    await until(lambda: line.waiting == 4)
    assert line.places() == {"older": 1, "a": 2, "b": 3, "c": 4}
    for task in [tasks[3], *tasks[:3]]:
        line.leave()
        await task
    assert log == ["older", "a", "b", "c"]


async def test_a_cancelled_waiting_turn_leaves_and_those_behind_move_up() -> None:
    line, log = strict_line(), list[str]()
    await line.enter(1.0, "running")
    first = asyncio.create_task(enter_and_log(line, log, 2.0, "first"))
    second = asyncio.create_task(enter_and_log(line, log, 3.0, "second"))
    third = asyncio.create_task(enter_and_log(line, log, 4.0, "third"))
    await until(lambda: line.waiting == 3)
    assert line.places() == {"first": 1, "second": 2, "third": 3}
    await cancelled(second)
    assert line.places() == {"first": 1, "third": 2} and line.place("second") is None
    # The head leaves too, just after second's leaving poked it (on Python 3.11 a cancel
    # that lands with the poke was lost by asyncio.wait_for: the turn stayed in line).
    await cancelled(first)
    assert line.places() == {"third": 1} and line.waiting == 1
    line.leave()
    async with asyncio.timeout(2):
        await third
    assert log == ["third"] and line.waiting == 0 and line.places() == {}
    assert line.place("first") is None and line.place("third") is None
    line.leave()
    assert line.running == 0


async def test_the_fakes_load_shows_each_held_turns_place_and_none_once_running() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    engine.set_turn_admission(Room(limit=1))
    runner, newer, older = [await engine.attach() for _ in range(3)]
    for s in (runner, newer, older):
        s.append("one two three")
    first = asyncio.create_task(drain_with(runner, max_tokens=8, priority=1.0))
    await until(lambda: state_of(engine, runner) is SessionState.DECODING)
    late = asyncio.create_task(drain_with(newer, max_tokens=2, priority=30.0))
    await until(lambda: engine.turn_line.waiting == 1)
    early = asyncio.create_task(drain_with(older, max_tokens=2, priority=10.0))
    await until(lambda: engine.turn_line.waiting == 2)
    places = {s.id: s.turn_place for s in engine.load().sessions}
    assert places == {runner.id: None, older.id: 1, newer.id: 2}
    assert [engine.turn_place(s.id) for s in (runner, older, newer)] == [None, 1, 2]
    await first
    await until(lambda: state_of(engine, older) is SessionState.DECODING)
    places = {s.id: s.turn_place for s in engine.load().sessions}
    assert places == {runner.id: None, older.id: None, newer.id: 1}
    await asyncio.gather(early, late)
    assert all(s.turn_place is None for s in engine.load().sessions)
    assert engine.turn_line.waiting == 0 and engine.turn_line.places() == {}


async def test_the_fake_defaults_to_the_sessions_attach_time_as_the_pool_does() -> None:
    """No priority given: the session's attach time (the pool's default), so an older
    session's turn goes before a newer session's turn asked earlier."""
    engine = FakeEngine(step_delay_s=0.02)
    engine.set_turn_admission(Room(limit=1))
    runner, old, new = [await engine.attach() for _ in range(3)]
    for s in (runner, old, new):
        s.append("one two three")
    first = asyncio.create_task(drain(runner, 6))
    await until(lambda: state_of(engine, runner) is SessionState.DECODING)
    tasks = [asyncio.create_task(drain(new, 2))]
    await until(lambda: engine.turn_line.waiting == 1)
    tasks.append(asyncio.create_task(drain(old, 2)))
    await until(lambda: engine.turn_line.waiting == 2)
    assert engine.turn_place(old.id) == 1 and engine.turn_place(new.id) == 2
    await asyncio.gather(first, *tasks)


async def drain_with(session: Session, **params: Any) -> str:
    gen = session.generate(SamplingParams(**params))
    return "".join([p.text async for p in gen])
