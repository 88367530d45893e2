"""The session API on the real engine (tiny model): a client's mistake is a 4xx, never a
500; a cancelled start stops its turn; an append racing a release leaks nothing; the app's
lifespan closes the session API (issue 12, points 2 and 3)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from mesh.engine.config import SamplingParams
from mesh.engine.interface import SessionFailed
from mesh.engine.session import PooledSession
from tests.reliability.fake_stack import fake_stack
from tests.reliability.real_stack import RealStack, real_stack

pytestmark = pytest.mark.anyio


async def create(stack: RealStack) -> tuple[str, PooledSession]:
    r = await stack.client.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    session = stack.sessions._entries[sid].session
    assert isinstance(session, PooledSession)
    return sid, session


async def test_empty_input_is_400(tiny_model_path: Path, tmp_path: Path) -> None:
    async with real_stack(tiny_model_path, tmp_path) as stack:
        sid, _ = await create(stack)
        for stream in (False, True):
            r = await stack.client.post(
                f"/v1/sessions/{sid}/turns", json={"text": "", "stream": stream}
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "empty_input"
        # the session is still usable
        r = await stack.client.post(
            f"/v1/sessions/{sid}/turns", json={"text": "hello", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text


async def test_a_turn_while_an_orphan_runs_is_409(tiny_model_path: Path, tmp_path: Path) -> None:
    async with real_stack(tiny_model_path, tmp_path) as stack:
        sid, session = await create(stack)
        session.append("an orphaned turn")
        orphan = session.generate(SamplingParams(max_tokens=400, stop_at_eos=False))
        await orphan.start()  # registered with the engine, nobody iterating it
        r = await stack.client.post(f"/v1/sessions/{sid}/turns", json={"text": "next"})
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "session_busy"
        await orphan.aclose()


async def test_a_cancelled_start_stops_the_turn(tiny_model_path: Path, tmp_path: Path) -> None:
    async with real_stack(tiny_model_path, tmp_path, session_budget=512) as stack:
        _, session = await create(stack)
        session.append("a client that goes away while the turn starts")
        generation = session.generate(SamplingParams(max_tokens=480, stop_at_eos=False))
        starting = asyncio.ensure_future(generation.start())
        await asyncio.sleep(0)  # the command is queued for the engine thread
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        deadline = time.monotonic() + 20
        while session.state.turn is not None or session.state.turns_started == 0:
            assert time.monotonic() < deadline, "the orphaned turn never ended"
            await asyncio.sleep(0.02)
        assert session.state.num_generated < 480, "the orphan ran to max_tokens"


async def test_append_racing_a_release_leaks_nothing(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """An append that passed the ``detached`` check just before a release must not leave a
    reservation behind: the release is held open at its critical point while an append
    starts in another thread."""
    async with real_stack(tiny_model_path, tmp_path) as stack:
        _, session = await create(stack)
        pool = stack.pool
        outcome: list[BaseException | None] = []

        def racing_append() -> None:
            try:
                session.append_tokens([1, 2, 3])
                outcome.append(None)
            except BaseException as exc:  # the thread reports what happened
                outcome.append(exc)

        class Hook(list[int]):
            def append(self, seq: int) -> None:
                super().append(seq)
                threading.Thread(target=racing_append).start()
                time.sleep(0.1)  # the append passes its first check and waits on the lock

        ledger = pool.parts.scheduler.ledger
        assert ledger is not None
        ledger._free_seqs = Hook(ledger._free_seqs)
        await session.detach()
        deadline = time.monotonic() + 5
        while not outcome:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert isinstance(outcome[0], SessionFailed), outcome
        assert session.state.reserved == 0 and not session.state.pending
        resident = pool.parts.scheduler.registry.resident()
        assert ledger._reserved == sum(s.reserved for s in resident.values())


async def test_the_lifespan_closes_the_session_api(tmp_path: Path) -> None:
    async with fake_stack(tmp_path) as stack:
        r = await stack.client.post("/v1/sessions", json={})
        assert r.status_code == 201
        assert stack.gate.num_tickets == 1
    assert stack.gate.num_tickets == 0 and stack.engine.sessions == {}
