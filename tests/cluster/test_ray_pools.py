"""Pools as Ray actors (mesh.cluster.pools) on a local two-node cluster, tiny model: the
engine interface as a local pool gives it, routing across pools, the gate on top, and a
pool killed mid-turn."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster

from mesh.cluster.pools import RayPools
from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, Session, SessionFailed, TurnResult
from mesh.engine.llama import LlamaModel
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from tests.cluster.conftest import PREFIX, make_pool, tiny_config

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, stop_at_eos=False)


@pytest.fixture
async def pools(ray_cluster: Cluster, tiny_model_path: Path) -> AsyncIterator[RayPools]:
    vocab = LlamaModel(str(tiny_model_path), vocab_only=True)
    engine = RayPools(make_pool(tiny_model_path), num_pools=2,
                      tokenize=lambda text: vocab.tokenize(text, add_bos=False))
    try:
        await engine.start()
        yield engine
    finally:
        await engine.aclose()
        vocab.close()


async def turn(session: Session, text: str, params: SamplingParams = GREEDY) -> TurnResult:
    session.append(text)
    gen = session.generate(params)
    pieces = [p.text async for p in gen]
    assert gen.result is not None
    assert "".join(pieces) == gen.result.text
    return gen.result


async def test_a_turn_is_the_local_pools_turn(pools: RayPools, tiny_model_path: Path) -> None:
    assert isinstance(pools, Engine)
    local = SharedKVPool(tiny_config(tiny_model_path), PREFIX)
    await local.start()
    try:
        want = [await turn(s, t) for s in [await local.attach()] for t in ("hi", " again")]
    finally:
        await local.aclose()
    assert pools.info.engine == "ray:2"
    assert pools.info.max_sessions == 2 * local.info.max_sessions
    assert pools.info.prefix_hash == local.info.prefix_hash
    a, b = await pools.attach(), await pools.attach()
    assert a.id.split("/")[0] != b.id.split("/")[0]  # spread over the two pools
    for session in (a, b):
        got = [await turn(session, t) for t in ("hi", " again")]
        assert [r.text for r in got] == [r.text for r in want]
        assert [r.num_generated for r in got] == [24, 24]
    assert a.context_len == b.context_len > pools.info.prefix_tokens + 48
    await asyncio.sleep(3 * pools.poll_s)
    load = pools.load()
    assert {s.id for s in load.sessions} == {a.id, b.id}
    assert load.recent_steps and load.cells_used > 2 * pools.info.prefix_tokens
    await a.detach()
    await a.detach()  # idempotent
    with pytest.raises(SessionFailed, match="detached"):
        a.append("more")
    overhead = pools.backend_metrics()["turnOverheadMsP50"]
    assert overhead is not None and overhead > 0


async def test_the_floor_gate_runs_on_ray_pools(pools: RayPools) -> None:
    gate = FloorGate(pools, GateConfig(policy="floor", floor_tps=5.0))
    gate.install()  # the decode gate goes to each pool as its own copy
    ticket = await gate.admit("t1")
    session = await pools.attach()
    result = await turn(session, "hello")
    assert result.num_generated == 24
    await session.detach()
    await ticket.release()
    doc = gate.capacity()
    assert doc["engine"]["name"] == "ray:2"
    assert [p["alive"] for p in doc["engine"]["backend"]["pools"]] == [True, True]


async def test_a_killed_pool_moves_its_sessions(pools: RayPools) -> None:
    sessions = [await pools.attach() for _ in range(4)]
    on_p0 = [s for s in sessions if s.pool.name == "p0"]
    assert len(on_p0) == 2
    for s in sessions:
        await turn(s, "first turn")
    pid = await pools.pools[0].actor.pid.remote()
    long = SamplingParams(max_tokens=200, temperature=0.0, stop_at_eos=False)

    async def kill_soon() -> None:
        await asyncio.sleep(0.1)
        os.kill(pid, signal.SIGKILL)

    killer = asyncio.ensure_future(kill_soon())
    results = await asyncio.gather(*(turn(s, " second", long) for s in sessions))
    await killer
    assert [r.num_generated for r in results] == [200] * 4  # every turn finished
    assert {s.pool.name for s in sessions} == {"p1"}
    assert pools.num_moved == 2 and pools.num_lost == 0
    assert [r.num_generated for r in [await turn(s, " third") for s in on_p0]] == [24, 24]
    rows = pools.backend_metrics()["pools"]
    assert rows[0]["alive"] is False and "ActorDiedError" in rows[0]["error"]
    check = pools.check_attach()
    assert check.ok  # p1 still takes sessions


async def test_no_pool_left_fails_the_turn_clearly(pools: RayPools) -> None:
    session = await pools.attach()
    await turn(session, "first")
    for h in pools.pools:
        os.kill(await h.actor.pid.remote(), signal.SIGKILL)
    with pytest.raises(SessionFailed, match=r"pool p\d died .* could not move to another "
                                            r"pool: no pool can take a session"):
        await turn(session, " second")
    check = pools.check_attach()
    assert not check.ok and "p0: its actor died" in check.reason


async def test_a_dropped_session_is_detached_on_its_pool(pools: RayPools) -> None:
    session = await pools.attach()
    await turn(session, "hello")
    del session
    gc.collect()
    for _ in range(100):
        await asyncio.sleep(pools.poll_s)
        if not pools.load().sessions:
            break
    assert pools.load().sessions == ()


async def test_a_turn_left_early_ends_on_its_pool(pools: RayPools) -> None:
    session = await pools.attach()
    session.append("hello")
    long = SamplingParams(max_tokens=400, temperature=0.0, stop_at_eos=False)
    got = 0
    async for _ in session.generate(long):
        got += 1
        if got == 2:
            break  # the consumer leaves: the pool stops the turn, the session goes on
    for _ in range(100):
        await asyncio.sleep(pools.poll_s)
        rows = [s for s in pools.load().sessions if s.id == session.id]
        if rows and rows[0].state.value == "idle":
            break
    assert rows and rows[0].state.value == "idle" and rows[0].num_generated < 400
    result = await turn(session, " again")
    assert result.num_generated == 24


async def test_compaction_on_a_ray_pool_and_after_its_death(pools: RayPools) -> None:
    """Compact, then a turn; and a session compacted after its pool died recomputes the
    summary on the other pool, not the turns it replaced."""
    summary = "Summary: the user said hi twice."
    session = await pools.attach()
    for text in ("hi", " hi", " hi"):
        await turn(session, text)
    assert await session.compact(summary)
    assert session.context_len == pools.info.prefix_tokens + pools.count_tokens(summary)
    assert (await turn(session, " next")).num_generated == 24
    os.kill(await session.pool.actor.pid.remote(), signal.SIGKILL)
    await asyncio.sleep(5 * pools.poll_s)
    assert await session.compact(summary)
    assert (await turn(session, " next")).num_generated == 24
    assert pools.num_moved == 1 and pools.load().compactions >= 1
    await asyncio.sleep(3 * pools.poll_s)
    [row] = [s for s in pools.load().sessions if s.id == session.id]
    held = pools.count_tokens(summary) + pools.count_tokens(" next") + 24
    assert row.private_cells <= held + 1  # the summary and one turn, not the 4 turns before
