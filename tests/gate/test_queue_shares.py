"""The gate's queue counted in places: per subtask at the door, and per caller (issue 27,
hole 5): one caller filling its share is refused while every other caller still queues."""

from __future__ import annotations

import anyio
import pytest

from mesh.gate.config import GateConfig
from mesh.gate.queue import QueueFull, QueueShares, Ticket
from tests.gate.test_admission import make_gate, wait_until

pytestmark = pytest.mark.anyio

A, B = "caller-a", "caller-b"


def test_the_share_defaults_to_half_the_queue_and_is_checked() -> None:
    assert GateConfig.create(max_queue=64).queue_share == 32
    assert GateConfig.create(max_queue=1).queue_share == 1
    assert GateConfig.create(max_queue=64, max_queue_per_caller=10).queue_share == 10
    for bad in (0, 65):
        with pytest.raises(ValueError, match="max_queue_per_caller"):
            GateConfig.create(max_queue=64, max_queue_per_caller=bad)


def test_shares_count_places_and_clamp_a_request_to_the_bound() -> None:
    shares = QueueShares(max_queue=8, share=4)
    for _ in range(3):
        shares.add(A)
    assert shares.waiting(A) == 3 and shares.num_callers == 1
    assert shares.over_share(A, 1) == 0 and shares.over_share(A, 2) == 1
    assert "max_queue_per_caller" in shares.refusal(A, 2) and not shares.refusal(B, 4)
    # larger than the share: it goes in once the caller has nothing queued
    assert shares.over_share(B, 30) == 0 and shares.over_share(A, 30) == 3
    assert shares.share_of("") == 8  # auth off: the one caller may use the whole queue
    for _ in range(3):
        shares.remove(A)
    assert shares.waiting(A) == 0 and shares.num_callers == 0


async def test_a_request_is_checked_for_all_its_places() -> None:
    """A task of N subtasks needs N free places, not one (32 subtasks took the queue to
    95 of its 64 places)."""
    gate = make_gate(policy="none", max_workers=1, max_queue=8)
    holder = await gate.admit("holder")
    assert gate.check_queue(places=8).ok
    assert gate.check_queue(places=9).ok  # more than the queue: clamped, goes in when empty
    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(gate.admit, f"w{i}")
        await wait_until(lambda: gate.queue_len == 5)
        assert gate.check_queue(places=3).ok
        check = gate.check_queue(places=4)
        assert not check.ok and check.retry_after_s > 0 and "full" in check.reason
        assert not gate.check_queue(places=32).ok  # a large task waits for an empty queue
        tg.cancel_scope.cancel()
    await holder.release()


async def test_one_caller_filling_its_share_does_not_refuse_the_others() -> None:
    gate = make_gate(policy="none", max_workers=1, max_queue=8)  # share: 4 places per caller
    holder = await gate.admit("holder")
    got: list[Ticket] = []

    async def wait(key: str, caller: str) -> None:
        got.append(await gate.admit(key, caller=caller))

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(wait, f"a{i}", A)
        await wait_until(lambda: gate.queue_len == 4)
        assert gate.queued_by(A) == 4
        # A's share is full: A is refused, at the door and at admit, with a retry time...
        check = gate.check_queue(caller=A)
        assert not check.ok and "max_queue_per_caller" in check.reason
        assert check.retry_after_s > 0
        with pytest.raises(QueueFull, match="max_queue_per_caller"):
            await gate.admit("a-more", caller=A)
        # ... while B (and a task of B's 4 subtasks) still queue, behind at most A's 4.
        assert gate.check_queue(caller=B).ok and gate.check_queue(places=4, caller=B).ok
        tg.start_soon(wait, "b0", B)
        await wait_until(lambda: gate.queue_len == 5)
        assert gate.capacity()["queue_callers"] == 2
        assert gate.capacity()["max_queue_per_caller"] == 4
        # A's places free as its work is admitted: A may queue again.
        await holder.release()
        await wait_until(lambda: len(got) == 1)
        assert gate.queued_by(A) == 3 and gate.check_queue(caller=A).ok
        tg.cancel_scope.cancel()
    assert gate.queue_len == 0 and gate.queued_by(A) == gate.queued_by(B) == 0


async def test_the_anonymous_caller_may_use_the_whole_queue() -> None:
    """With auth off every client is one caller: its share is the whole queue."""
    gate = make_gate(policy="none", max_workers=1, max_queue=6)
    holder = await gate.admit("holder")
    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(gate.admit, f"w{i}")
        await wait_until(lambda: gate.queue_len == 6)
        assert not gate.check_queue().ok and "full" in gate.check_queue().reason
        tg.cancel_scope.cancel()
    await holder.release()


async def test_a_cancelled_waiter_gives_its_place_back_to_its_caller() -> None:
    gate = make_gate(policy="none", max_workers=1, max_queue=4)  # share: 2 places per caller
    holder = await gate.admit("holder")
    scopes = [anyio.CancelScope(), anyio.CancelScope()]

    async def wait(i: int) -> None:
        with scopes[i]:
            await gate.admit(f"a{i}", caller=A)

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(wait, i)
        await wait_until(lambda: gate.queued_by(A) == 2)
        assert not gate.check_queue(caller=A).ok
        scopes[1].cancel()
        await wait_until(lambda: gate.queued_by(A) == 1)
        assert gate.check_queue(caller=A).ok and gate.queue_len == 1
        scopes[0].cancel()
    assert gate.queued_by(A) == 0 and gate.queue_len == 0
    await holder.release()
