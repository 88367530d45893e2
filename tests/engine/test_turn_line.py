"""The decode gate on engines whose turns run on the event loop (the fake, a remote OpenAI
backend): a turn waits in a :class:`TurnLine` until the gate has room, first come first
served, one always runs, and every way a turn ends gives its place back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from mesh.backends.openai import BackendConfig, OpenAIEngine
from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, Session, SessionState, StepSample
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
        backend.go.set()
        assert await asyncio.gather(*tasks) == ["ok", "ok"]
        assert backend.started == 2 and engine.turn_line.running == 0
        gate.install()  # the floor gate's own decode gate goes in the same way
        assert engine.turn_line.gate is gate.decode_gate()
    finally:
        await engine.aclose()
        await http.aclose()
