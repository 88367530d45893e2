"""A worker's turn that the decode gate holds says its place in line (a status event, which
the A2A executor writes as the task's working status message): when the place is known
and changed, at most about once a second, and nothing more once the turn runs. On the
fake engine, whose line keeps the pool's completion order."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from functools import partial

import pytest

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Session, SessionState, StepSample
from mesh.sim.fake import FakeEngine
from mesh.worker import loop
from mesh.worker.loop import AgentWorker, place_text, stream_turn
from mesh.worker.types import EventKind, Subtask
from tests.worker.test_worker_loop import LIGHT, Recorder

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class OneRow:
    """A decode gate with room for one running turn."""

    def turn_room(self, num_running: int, cells_used: int,
                  recent: Sequence[StepSample]) -> int:
        return 1 - num_running


def places(rec: Recorder) -> list[int]:
    return [int(e.data["turn_place"]) for e in rec.events
            if e.kind is EventKind.STATUS and "turn_place" in e.data]


def said_before_running(rec: Recorder) -> bool:
    """Every place was said before the turn's first text (none once it runs)."""
    kinds = [("place" if "turn_place" in e.data else "text") for e in rec.events
             if e.kind is EventKind.TEXT or "turn_place" in e.data]
    return "place" not in kinds[kinds.index("text"):] if "text" in kinds else True


async def turn(engine: FakeEngine, session: Session, rec: Recorder, tokens: int,
               priority: float) -> None:
    session.append("one two three four five")
    await stream_turn(session, SamplingParams(max_tokens=tokens, priority=priority), rec, 1,
                      place=partial(engine.turn_place, session.id))


async def test_a_held_turn_says_its_place_and_nothing_once_it_runs() -> None:
    engine = FakeEngine(step_delay_s=0.05)
    engine.set_turn_admission(OneRow())
    first, newer, older = [await engine.attach() for _ in range(3)]
    recs = {name: Recorder() for name in ("first", "newer", "older")}
    running = asyncio.create_task(turn(engine, first, recs["first"], 24, 1.0))  # ~1.2 s
    while engine.turn_line.running == 0:
        await asyncio.sleep(0.01)
    # A newer task's turn, then an older task's (asked later, first in line).
    late = asyncio.create_task(turn(engine, newer, recs["newer"], 2, 30.0))
    while engine.turn_line.waiting < 1:
        await asyncio.sleep(0.01)
    early = asyncio.create_task(turn(engine, older, recs["older"], 30, 10.0))  # ~1.5 s
    await asyncio.wait_for(asyncio.gather(running, late, early), 20)

    assert places(recs["first"]) == []  # let in at once: nothing said
    assert places(recs["older"]) == [1]  # first in line from its start, said once
    # The newer task's turn: #2 behind the older one (maybe #1 for a moment before it
    # came), then #1 once the older one ran; never the same place twice in a row.
    said = places(recs["newer"])
    assert 2 in said and said[-1] == 1, said
    assert all(a != b for a, b in itertools.pairwise(said)), said
    for rec in recs.values():
        assert said_before_running(rec)
    status = [e for e in recs["older"].events if "turn_place" in e.data]
    assert status[0].text == place_text(1) == "waiting for a decode turn (#1 in line)"
    assert engine.turn_line.waiting == 0 and engine.turn_line.places() == {}


async def test_a_place_that_changes_every_look_is_said_at_most_once_a_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "PLACE_POLL_S", 0.01)
    monkeypatch.setattr(loop, "PLACE_EVERY_S", 0.2)
    looks = iter(range(1000, 0, -1))  # a new place at every look
    rec = Recorder()
    stop = asyncio.Event()
    watch = asyncio.create_task(loop._say_places(lambda: next(looks), rec, 1, stop))
    await asyncio.sleep(0.7)
    stop.set()
    await asyncio.wait_for(watch, 2)
    said = places(rec)
    assert 2 <= len(said) <= 5, said  # 0.7 s at one every 0.2 s, not one per look (~70)
    assert said == sorted(said, reverse=True)


async def test_an_unchanged_place_is_said_once_and_again_after_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "PLACE_POLL_S", 0.01)
    monkeypatch.setattr(loop, "PLACE_EVERY_S", 0.02)
    seq = [3] * 8 + [None] * 3 + [3] * 8  # waits at #3, runs (paused then), waits at #3
    looked: list[int | None] = []

    def look() -> int | None:
        looked.append(seq[len(looked)] if len(looked) < len(seq) else None)
        return looked[-1]

    rec = Recorder()
    stop = asyncio.Event()
    watch = asyncio.create_task(loop._say_places(look, rec, 1, stop))
    while len(looked) < len(seq) + 1:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(watch, 2)
    assert places(rec) == [3, 3]


async def test_a_failing_place_read_ends_the_watch_not_the_turn() -> None:
    engine = FakeEngine()
    session = await engine.attach()
    session.append("alpha beta")
    rec = Recorder()

    def broken() -> int | None:
        raise RuntimeError("no place")

    result = await stream_turn(session, SamplingParams(max_tokens=2), rec, 1, place=broken)
    assert result.text == "alpha beta" and places(rec) == []


async def test_an_agent_worker_held_behind_a_running_turn_says_its_place() -> None:
    """The worker's own wiring: its turn, held by the gate behind another session's turn,
    says '#1 in line' as a status event, and nothing once it runs."""
    engine = FakeEngine(step_delay_s=0.05)
    engine.set_turn_admission(OneRow())
    other = await engine.attach()
    running = asyncio.create_task(turn(engine, other, Recorder(), 30, 1.0))  # ~1.5 s
    while engine.turn_line.running == 0:
        await asyncio.sleep(0.01)
    rec = Recorder()
    result = await asyncio.wait_for(
        AgentWorker(engine, LIGHT, {}).run(Subtask("t1", "<answer>forty-two</answer>"), rec),
        20)
    await running
    assert result.answer == "forty-two"
    assert places(rec) == [1] and said_before_running(rec)
    assert all(s.state is not SessionState.WAITING for s in engine.load().sessions)
