"""FloorGate over the FakeEngine: FIFO queue, bounds, wake-ups, start-up guard, capacity."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.engine.config import SamplingParams
from mesh.engine.interface import PoolLoad, StepSample
from mesh.gate.admission import FloorGate
from mesh.gate.model import StepCost, ThroughputModel
from mesh.gate.queue import Admission, QueueFull, Ticket
from mesh.sim.fake import FakeEngine
from tests.gate.rules import floor_gate

pytestmark = pytest.mark.anyio

# 10 ms + 20 ms per decoding session: a floor of 10 tok/s fits 4 busy workers.
LINEAR = StepCost(a=0.010, b=0.020, c=0.0)


class DutyEngine(FakeEngine):
    """FakeEngine whose snapshots carry a duty cycle per session and given step samples."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.duty: float | None = None
        self.steps: tuple[StepSample, ...] = ()

    def load(self) -> PoolLoad:
        load = super().load()
        sessions = tuple(dataclasses.replace(s, duty_cycle=self.duty) for s in load.sessions)
        return dataclasses.replace(load, sessions=sessions, recent_steps=self.steps)


def make_gate(engine: FakeEngine | None = None, policy: str = "projection",
              **cfg: Any) -> FloorGate:
    """A gate under ``policy`` (default: the comparison policy ``projection``, whose
    queue waits on the projection; slow start off unless asked: a FakeEngine never
    measures, and slow start is tested on its own)."""
    cfg.setdefault("floor_tps", 10.0)
    cfg.setdefault("recheck_s", 0.01)
    return floor_gate(engine or FakeEngine(), policy, ThroughputModel(prior=LINEAR), **cfg)


async def test_admits_at_once_when_there_is_room() -> None:
    gate = make_gate()
    seen: list[int] = []

    async def on_position(pos: int) -> None:
        seen.append(pos)

    ticket = await gate.admit("a", on_position)
    assert ticket.key == "a"
    assert seen == [0]
    assert gate.num_tickets == 1
    await ticket.release()
    await ticket.release()  # idempotent
    assert gate.num_tickets == 0


async def test_waiter_is_admitted_when_a_ticket_is_released() -> None:
    gate = make_gate(policy="static:1")
    first = await gate.admit("first")
    positions: list[int] = []
    got: list[Ticket] = []

    async def on_position(pos: int) -> None:
        positions.append(pos)

    async def wait() -> None:
        got.append(await gate.admit("second", on_position))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await wait_until(lambda: positions == [1])
        assert gate.queue_len == 1 and not got
        await first.release()
    assert positions == [1, 0]
    assert [t.key for t in got] == ["second"]
    assert gate.queue_len == 0


async def test_queue_is_bounded_and_refuses_with_retry_after() -> None:
    gate = make_gate(policy="static:1", max_queue=1)
    first = await gate.admit("first")
    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.admit, "queued")
        await wait_until(lambda: gate.queue_len == 1)
        check = gate.check_queue()
        assert not check.ok and check.queue_len == 1 and check.retry_after_s > 0
        assert "full" in check.reason
        with pytest.raises(QueueFull) as info:
            await gate.admit("refused")
        assert info.value.retry_after_s > 0
        assert gate.num_refused == 1
        await first.release()
    assert gate.num_tickets == 1  # "queued" holds the slot now


async def test_accepted_work_queues_past_the_bound_instead_of_being_dropped() -> None:
    """Work that passed check_queue at the door is never refused by a later admit."""
    gate = make_gate(policy="static:1", max_queue=1)
    first = await gate.admit("first")
    got: list[str] = []

    async def accepted(key: str) -> None:
        got.append((await gate.admit(key, accepted=True)).key)

    async with anyio.create_task_group() as tg:
        tg.start_soon(accepted, "a")
        await wait_until(lambda: gate.queue_len == 1)
        tg.start_soon(accepted, "b")  # the bound is 1: a plain admit would raise QueueFull
        await wait_until(lambda: gate.queue_len == 2)
        assert gate.num_refused == 0
        await first.release()
        await wait_until(lambda: got == ["a"])
        (held,) = gate._tickets
        await held.release()
    assert got == ["a", "b"]


async def test_admission_is_fifo_and_cancellation_only_removes_the_cancelled() -> None:
    gate = make_gate(policy="static:1", max_queue=10)
    holder = await gate.admit("holder")
    order: list[str] = []
    scopes: dict[str, anyio.CancelScope] = {}

    async def wait(key: str) -> None:
        with anyio.CancelScope() as scope:
            scopes[key] = scope
            ticket = await gate.admit(key)
            order.append(key)
            await ticket.release()

    async with anyio.create_task_group() as tg:
        for key in ("a", "b", "c", "d"):
            tg.start_soon(wait, key)
            await wait_until(lambda k=key: k in scopes and gate.queue_len == len(scopes))
        scopes["b"].cancel()
        await wait_until(lambda: gate.queue_len == 3)
        await holder.release()
    assert order == ["a", "c", "d"]
    assert gate.num_tickets == 0 and gate.queue_len == 0


async def test_failed_hand_over_releases_the_ticket() -> None:
    gate = make_gate()

    async def refuse(pos: int) -> None:
        raise RuntimeError("caller went away")

    with pytest.raises(RuntimeError):
        await gate.admit("x", refuse)
    assert gate.num_tickets == 0


async def test_startup_guard_counts_unattached_admissions() -> None:
    gate = make_gate()  # floor 10 with the linear cost: 4 busy workers fit
    tickets = [await gate.admit(f"w{i}") for i in range(4)]  # none attached yet
    assert gate.check_queue().ok
    assert not gate.decide_now().admitted
    assert gate.capacity()["in_flight"] == 4
    for t in tickets:
        await t.release()


async def test_head_rechecks_as_workers_go_idle() -> None:
    engine = DutyEngine()
    gate = make_gate(engine)
    held = []
    for i in range(4):
        held.append(await gate.admit(f"w{i}"))
        await engine.attach()
    got: list[Ticket] = []

    async def wait() -> None:
        got.append(await gate.admit("fifth"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await wait_until(lambda: gate.queue_len == 1)
        assert not got
        engine.duty = 0.3  # every worker now waits on tools most of the time
        await wait_until(lambda: bool(got), limit=2000, pause=0.005)  # the head polls
    cap = gate.capacity()
    assert cap["projected_idle_estimate"] is True
    assert gate.num_tickets == 5


async def test_capacity_document() -> None:
    engine = DutyEngine(prefix_tokens=100)
    engine.steps = (StepSample(2, 0, 400, 0.05), StepSample(2, 0, 400, 0.05))
    gate = make_gate(engine, policy="floor")
    ticket = await gate.admit("a")
    session = await engine.attach()
    session.append("hello there")
    cap = gate.capacity()
    json.dumps(cap, allow_nan=False)
    assert cap["floor_tps"] == 10.0 and cap["policy"] == "floor"
    assert cap["sessions"] == {"total": 1, "prefilling": 1, "decoding": 0, "idle": 0,
                               "waiting": 0}
    assert cap["measured_tps"] == {"count": 0, "min": None, "p50": None}
    assert cap["kv_cells"]["prefix"] == 100
    assert cap["kv_cells"]["naive_equivalent"] == 100
    assert cap["queue_len"] == 0 and cap["retry_after_s"] == 0.0
    assert cap["headroom"] >= 1 and cap["projected_tps_next"] > 0
    assert cap["model"]["num_samples"] == 2  # the gate learned the engine's steps
    gate.capacity()
    assert gate.model.num_samples == 2  # ...once
    await ticket.release()


def test_floor_gate_is_an_admission() -> None:
    gate: Admission = make_gate()
    assert callable(gate.capacity)


@settings(max_examples=30, deadline=None)
@given(
    slots=st.integers(1, 3),
    holds=st.lists(st.integers(0, 5), min_size=1, max_size=10),
    cancel=st.dictionaries(st.integers(0, 9), st.integers(0, 6), max_size=4),
)
def test_the_queue_never_drops_a_task(slots: int, holds: list[int], cancel: dict[int, int]) -> None:
    """Every request not cancelled is admitted exactly once, in arrival order; cancelled
    ones leave nothing behind."""

    async def scenario() -> None:
        gate = make_gate(policy=f"static:{slots}", max_queue=len(holds))
        admitted: list[int] = []
        active = 0
        peak = 0

        async def request(i: int, hold: int, scope: anyio.CancelScope) -> None:
            nonlocal active, peak
            with scope:
                ticket = await gate.admit(f"r{i}")
                admitted.append(i)
                active += 1
                peak = max(peak, active)
                try:
                    for _ in range(hold):
                        await anyio.sleep(0)
                finally:
                    active -= 1
                    await ticket.release()

        async def cancel_later(scope: anyio.CancelScope, after: int) -> None:
            for _ in range(after):
                await anyio.sleep(0)
            scope.cancel()

        with anyio.fail_after(30):  # a deadlock fails the test instead of hanging it
            async with anyio.create_task_group() as tg:
                for i, hold in enumerate(holds):
                    scope = anyio.CancelScope()
                    if i in cancel:
                        if cancel[i] == 0:
                            scope.cancel()  # cancelled before it even asks
                        else:
                            tg.start_soon(cancel_later, scope, cancel[i])
                    tg.start_soon(request, i, hold, scope)
        not_cancelled = [i for i in range(len(holds)) if i not in cancel]
        assert set(not_cancelled) <= set(admitted)
        assert admitted == sorted(set(admitted))  # once each, first come first served
        assert not any(cancel.get(i) == 0 for i in admitted)
        assert peak <= slots
        assert gate.queue_len == 0 and gate.num_tickets == 0

    anyio.run(scenario)


async def wait_until(cond: Any, limit: int = 10_000, pause: float = 0.0) -> None:
    """Yield to other tasks until ``cond()`` holds (a bounded number of times)."""
    for _ in range(limit):
        if cond():
            return
        await anyio.sleep(pause)
    raise AssertionError("condition never became true")


async def test_slow_start_admits_in_waves_of_measured_workers() -> None:
    """A burst is let in 1, then as many as are measured, never all at once."""
    engine = DutyEngine()
    gate = make_gate(engine, slow_start=True, slow_start_s=0.0, floor_tps=1.0)
    first = await gate.admit("w0")
    s0 = await engine.attach()
    assert not gate.decide_now().admitted, "w0 is not measured yet"
    assert any("slow start" in r for r in gate.decide_now().reasons)
    s0.append("go")
    _ = [p async for p in s0.generate(SamplingParams(max_tokens=2))]  # w0 is measured
    assert gate.decide_now().admitted
    await first.release()
