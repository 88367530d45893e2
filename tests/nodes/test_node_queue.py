"""NodePool's queue is the gate's one FIFO of waiters (mesh.gate.queue): positions,
cancellation, and room handed back when a chosen node is not taken."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from mesh.fleet.node_cards import Node
from mesh.fleet.nodes import NodePool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.gate.queue import WaiterQueue
from mesh.sim.fake import FakeEngine

pytestmark = pytest.mark.anyio


class StillPool(NodePool):
    """A pool whose nodes' capacities only the test changes (``poll`` keeps them)."""

    def __init__(self, n: int = 1, **kw: Any) -> None:
        super().__init__([Node(url=f"http://n{i}") for i in range(n)], poll_s=0.02, **kw)
        for node in self.nodes:
            node.capacity = {"verdict": "wait", "headroom": 0}

    async def poll(self, node: Node) -> None:
        node.given_since_poll = 0

    def open(self, node: Node, room: int) -> None:
        node.capacity = {"verdict": "admit", "headroom": room}


def test_gate_and_node_pool_share_one_fifo() -> None:
    gate = FloorGate(FakeEngine(), GateConfig.create(policy="none", max_workers=1))
    pool = StillPool()
    assert type(gate._waiters) is WaiterQueue and type(pool._waiters) is WaiterQueue


async def test_positions_and_cancellation_in_the_node_queue() -> None:
    pool = StillPool(max_queue=4)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    got: list[str] = []

    async def one(key: str, scope: anyio.CancelScope) -> None:
        async def on_position(pos: int) -> None:
            seen[key].append(pos)

        with scope:
            ticket = await pool.admit(key, on_position)
            got.append(ticket.node.url)
            await ticket.release()

    first, second = anyio.CancelScope(), anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "a", first)
        await anyio.sleep(0.05)
        tg.start_soon(one, "b", second)
        await anyio.sleep(0.05)
        assert pool.capacity()["queue_len"] == 2
        first.cancel()
        await anyio.sleep(0.05)
        assert pool.capacity()["queue_len"] == 1
        pool.open(pool.nodes[0], 1)
    assert seen == {"a": [1], "b": [2, 1, 0]}
    assert got == ["http://n0"] and pool.nodes[0].in_flight == 0
    await pool.aclose()


async def test_a_node_chosen_for_a_cancelled_waiter_gets_its_room_back() -> None:
    pool = StillPool(max_queue=4)
    node = pool.nodes[0]
    scope = anyio.CancelScope()
    reporting = anyio.Event()

    async def on_position(pos: int) -> None:
        reporting.set()
        await anyio.sleep_forever()  # the client is slow to hear its position

    async def waiter() -> None:
        with scope:
            await pool.admit("a", on_position)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await reporting.wait()
        await pool.aclose()  # stop the poller: no poll resets the reservation
        pool.open(node, 1)
        pool._waiters.pump()  # the node is chosen for "a" (its room reserved) ...
        assert node.given_since_poll == 1 and len(pool._waiters) == 0
        scope.cancel()  # ... and "a" is cancelled before it takes it
    assert node.given_since_poll == 0 and node.in_flight == 0 and node.routed == 0
    await pool.aclose()
