"""mesh.gate.queue: admit, attach and release in one place, whatever the exit."""

from __future__ import annotations

import anyio
import pytest

from mesh.engine.interface import PoolFull
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.gate.queue import Hold, NotAdmitted, QueueFull, admitted
from mesh.sim.fake import FakeEngine

pytestmark = pytest.mark.anyio


def one_slot(engine: FakeEngine, max_queue: int = 4) -> FloorGate:
    return FloorGate(engine, GateConfig.create(policy="none", max_workers=1, max_queue=max_queue,
                                               recheck_s=0.01))


async def test_block_attaches_then_detaches_and_releases() -> None:
    engine = FakeEngine()
    gate = one_slot(engine)
    async with admitted(gate, "a") as hold:
        session = await hold.attach(engine)
        assert gate.num_tickets == 1 and session.id in engine.sessions
    assert hold.closed and gate.num_tickets == 0 and not engine.sessions


async def test_block_releases_on_error_and_on_cancel() -> None:
    engine = FakeEngine()
    gate = one_slot(engine)
    with pytest.raises(RuntimeError, match="boom"):
        async with admitted(gate, "a") as hold:
            await hold.attach(engine)
            raise RuntimeError("boom")
    assert gate.num_tickets == 0 and not engine.sessions
    with anyio.move_on_after(0.05):
        async with admitted(gate, "b") as hold:
            await hold.attach(engine)
            await anyio.sleep(10)
    assert gate.num_tickets == 0 and not engine.sessions


async def test_a_failed_attach_still_releases_the_ticket() -> None:
    engine = FakeEngine(max_sessions=1)
    gate = one_slot(engine)
    with pytest.raises(PoolFull):
        async with admitted(gate, "a") as hold:
            blocker = await engine.attach()  # someone else took the slot meanwhile
            await hold.attach(engine)
    assert gate.num_tickets == 0
    await blocker.detach()


async def test_kept_hold_outlives_the_block_and_is_a_ticket() -> None:
    engine = FakeEngine()
    gate = one_slot(engine)
    async with admitted(gate, "a") as hold:
        await hold.attach(engine)
        hold.keep()
    assert gate.num_tickets == 1 and len(engine.sessions) == 1
    await hold.release()  # the Ticket face
    await hold.aclose()  # idempotent
    assert gate.num_tickets == 0 and not engine.sessions


async def test_within_s_leaves_the_queue_and_says_so() -> None:
    engine = FakeEngine()
    gate = one_slot(engine)
    first = await Hold.acquire(gate, "first")
    with pytest.raises(NotAdmitted, match=r"not admitted within 0\.05 s") as info:
        await Hold.acquire(gate, "second", within_s=0.05)
    assert info.value.retry_after_s >= 0
    assert gate.queue_len == 0  # the timed-out wait left the queue
    await first.aclose()
    assert gate.num_tickets == 0


async def test_queue_refusal_propagates() -> None:
    engine = FakeEngine()
    gate = one_slot(engine, max_queue=0)
    first = await Hold.acquire(gate, "first")
    with pytest.raises(QueueFull):
        await Hold.acquire(gate, "second")
    await first.aclose()


async def test_on_position_and_accepted_pass_through() -> None:
    engine = FakeEngine()
    gate = one_slot(engine, max_queue=0)
    first = await Hold.acquire(gate, "first")
    seen: list[int] = []

    async def on_position(pos: int) -> None:
        seen.append(pos)

    async with anyio.create_task_group() as tg:
        async def second() -> None:
            async with admitted(gate, "second", on_position=on_position, accepted=True):
                pass

        tg.start_soon(second)
        await anyio.sleep(0.05)
        assert seen == [1]  # queued past max_queue: it was accepted at the door
        await first.aclose()
    assert seen == [1, 0] and gate.num_tickets == 0
