"""mesh.gate.queue: the one FIFO of waiters behind the floor gate and the node pool."""

from __future__ import annotations

import anyio
import pytest

from mesh.gate.queue import QueueShares, Waiter, WaiterQueue, report_admitted

pytestmark = pytest.mark.anyio


class Slots:
    """A chooser with ``free`` slots: each grant is the slot's number."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.given = 0
        self.abandoned: list[int] = []
        self.queue: WaiterQueue[int] = WaiterQueue(
            self.choose, self.abandon, QueueShares(8, 4), head_recheck_s=0.01)

    def choose(self, head: Waiter[int]) -> int | None:
        if self.free <= 0:
            return None
        self.free -= 1
        self.given += 1
        return self.given

    def abandon(self, grant: int) -> None:
        self.abandoned.append(grant)
        self.free += 1

    def open(self, n: int = 1) -> None:
        self.free += n
        self.queue.poke()


async def test_fifo_order_and_positions() -> None:
    slots = Slots()
    order: list[str] = []
    positions: dict[str, list[int]] = {}

    async def waiter(key: str) -> None:
        async def on_position(pos: int) -> None:
            positions.setdefault(key, []).append(pos)

        await slots.queue.wait(Waiter(key, caller="c"), on_position)
        order.append(key)

    async with anyio.create_task_group() as tg:
        for key in "abc":
            tg.start_soon(waiter, key)
            await anyio.sleep(0.01)
        assert len(slots.queue) == 3 and slots.queue.shares.waiting("c") == 3
        assert slots.queue.positions_of("c") == [1, 2, 3]
        slots.open(1)
        await anyio.sleep(0.01)
        slots.open(2)
    assert order == ["a", "b", "c"]
    assert positions == {"a": [1], "b": [2, 1], "c": [3, 2]}
    assert len(slots.queue) == 0 and slots.queue.shares.num_callers == 0


async def test_cancelled_waits_leave_no_place_behind() -> None:
    slots = Slots()
    positions: list[int] = []

    async def on_position(pos: int) -> None:
        positions.append(pos)

    async with anyio.create_task_group() as tg:
        tg.start_soon(slots.queue.wait, Waiter("a", caller="x"))
        await anyio.sleep(0.01)
        tg.start_soon(slots.queue.wait, Waiter("b", caller="y"), on_position)
        await anyio.sleep(0.01)
        assert positions == [2]
        tg.cancel_scope.cancel()  # cancels both waits
    assert len(slots.queue) == 0 and slots.queue.shares.num_callers == 0


async def test_head_cancel_moves_the_next_up() -> None:
    slots = Slots()
    positions: list[int] = []
    got: list[int] = []

    async def on_position(pos: int) -> None:
        positions.append(pos)

    async def second() -> None:
        got.append(await slots.queue.wait(Waiter("b"), on_position))

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def first() -> None:
            with scope:
                await slots.queue.wait(Waiter("a"))

        tg.start_soon(first)
        await anyio.sleep(0.01)
        tg.start_soon(second)
        await anyio.sleep(0.01)
        scope.cancel()
        await anyio.sleep(0.01)
        assert positions == [2, 1]  # told it moved up when the head left
        slots.open(1)
    assert got == [1] and slots.abandoned == []


async def test_a_grant_nobody_took_is_abandoned() -> None:
    slots = Slots()
    reporting = anyio.Event()

    async def on_position(pos: int) -> None:
        reporting.set()
        await anyio.sleep_forever()  # the client is slow to hear its position

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def waiter() -> None:
            with scope:
                await slots.queue.wait(Waiter("a"), on_position)

        tg.start_soon(waiter)
        await reporting.wait()
        slots.free = 1
        slots.queue.pump()  # granted ...
        assert len(slots.queue) == 0
        scope.cancel()  # ... and cancelled before the waiter took it
    assert slots.abandoned == [1] and slots.free == 1 and len(slots.queue) == 0


async def test_report_admitted_undoes_when_the_report_fails() -> None:
    undone: list[bool] = []

    async def broken(pos: int) -> None:
        raise RuntimeError("client gone")

    with pytest.raises(RuntimeError):
        await report_admitted(broken, lambda: undone.append(True))
    assert undone == [True]
    await report_admitted(None, lambda: undone.append(False))
    assert undone == [True]
