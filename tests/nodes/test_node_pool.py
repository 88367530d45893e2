"""NodePool's routing and queueing rules, with scripted node capacities (no HTTP).

The real three-process runs are in test_nodes.py; here each node's ``/capacity`` answer is
a dict the test sets, so the rules can be pinned exactly.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from mesh.fleet.node_cards import Node
from mesh.fleet.nodes import NodePool
from mesh.gate.queue import QueueFull

pytestmark = pytest.mark.anyio


class ScriptedPool(NodePool):
    """``poll`` reads ``self.script[url]`` (None: the node is unreachable); as a real node's
    gate, the headroom it reports is the scripted one less the subtasks it runs."""

    def __init__(self, script: dict[str, dict[str, Any] | None], **kw: Any) -> None:
        super().__init__([Node(url=u) for u in script], poll_s=0.05, **kw)
        self.script = script
        self.polls = 0

    async def poll(self, node: Node) -> None:
        self.polls += 1
        doc = self.script[node.url]
        if doc is None:
            node.capacity, node.up = None, False
        else:
            room = max(0, doc["headroom"] - node.in_flight)
            verdict = doc["verdict"] if room or doc["verdict"] != "admit" else "wait"
            node.capacity, node.up = {**doc, "headroom": room, "verdict": verdict}, True
        node.given_since_poll = 0


def cap(verdict: str, headroom: int) -> dict[str, Any]:
    return {"verdict": verdict, "headroom": headroom, "sessions": {"total": 0}}


async def test_never_a_waiting_node_while_another_admits() -> None:
    pool = ScriptedPool({"http://a": cap("wait", 9), "http://b": cap("admit", 1)})
    t = await pool.admit("t/s1")
    assert t.node.url == "http://b"
    await t.release()
    await pool.aclose()


async def test_most_headroom_wins_and_a_burst_is_spread() -> None:
    pool = ScriptedPool({"http://a": cap("admit", 3), "http://b": cap("admit", 2)})
    await pool.poll_all()
    pool.poll_s = 60  # no re-poll during the burst: given_since_poll must spread it
    tickets = [await pool.admit(f"t/s{i}") for i in range(5)]
    # most room first; a tie goes to the node running fewer
    assert [t.node.url[-1] for t in tickets] == ["a", "b", "a", "b", "a"]
    assert pool.pick() is None  # 3 + 2 given: neither admits until polled again
    assert pool.check_queue().ok
    for t in tickets:
        await t.release()
    await pool.aclose()


async def test_over_capacity_queues_fifo_then_429() -> None:
    pool = ScriptedPool({"http://a": cap("wait", 0), "http://b": cap("refuse", 0)},
                        max_queue=2)
    order: list[str] = []

    async def one(key: str) -> None:
        t = await pool.admit(key, accepted=True)
        order.append(key)
        await anyio.sleep(0.05)
        await t.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "t/s1")
        await anyio.sleep(0.05)
        tg.start_soon(one, "t/s2")
        await anyio.sleep(0.05)
        assert pool.capacity()["queue_len"] == 2
        assert not pool.check_queue().ok
        with pytest.raises(QueueFull, match="queued"):
            await pool.admit("t/s3")
        assert pool.num_refused == 1
        pool.script["http://a"] = cap("admit", 1)  # room for one at a time
        await anyio.sleep(0.3)
    assert order == ["t/s1", "t/s2"]
    await pool.aclose()


async def test_a_failed_node_is_skipped_and_the_retry_goes_elsewhere() -> None:
    pool = ScriptedPool({"http://a": cap("admit", 5), "http://b": cap("admit", 1)})
    t = await pool.admit("t/s1")
    assert t.node.url == "http://a"
    pool.node_failed(t.node, "ConnectError")
    new = await pool.reassign(t)
    assert new.url == "http://b"
    assert pool.nodes[0].in_flight == 0 and pool.nodes[1].in_flight == 1
    assert pool.num_retried == 1
    doc = pool.capacity()
    assert [n["up"] for n in doc["nodes"]] == [False, True]
    assert doc["nodes"][0]["error"] == "ConnectError"
    await t.release()
    assert pool.nodes[1].in_flight == 0
    await pool.aclose()


async def test_a_retry_waits_ahead_of_the_queue() -> None:
    pool = ScriptedPool({"http://a": cap("admit", 1), "http://b": cap("wait", 0)})
    first = await pool.admit("t/s1")
    got: list[str] = []

    async def later() -> None:
        t = await pool.admit("t/s2", accepted=True)
        got.append("queued:" + t.node.url)
        await t.release()

    async def retry() -> None:
        node = await pool.reassign(first)
        got.append("retry:" + node.url)

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        await anyio.sleep(0.1)
        pool.script["http://a"] = None  # a vanished
        tg.start_soon(retry)
        await anyio.sleep(0.1)
        pool.script["http://b"] = cap("admit", 1)
        await anyio.sleep(0.1)
        await first.release()
    assert got[0] == "retry:http://b"
    await pool.aclose()


async def test_capacity_lists_nodes_and_totals() -> None:
    pool = ScriptedPool({"http://a": cap("admit", 4), "http://b": None})
    await pool.poll_all()
    doc = pool.capacity()
    assert doc["engine"]["name"] == "nodes:2"
    assert doc["total"] == {"nodes": 2, "up": 1, "admitting": 1, "headroom": 4,
                            "sessions": 0, "in_flight": 0, "routed": 0}
    assert [n["url"] for n in doc["nodes"]] == ["http://a", "http://b"]
    assert doc["verdict"] == "admit"
    await pool.aclose()
