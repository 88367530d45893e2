"""KV memory sized to need (issue 44 item 3): one pool of suffix cells (``kv_cells``) that
sessions take from as they grow, each up to its ``session_budget``; a short pool parks
idle sessions for the one that grows, and every way a session ends gives its cells back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mesh.engine.config import TYPICAL_SUFFIX, EngineConfig, KVShape, SamplingParams
from mesh.engine.interface import ContextOverflow
from mesh.engine.pool import SharedKVPool
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from tests.engine.test_pool import make_pool, run

BUDGET = 256


def test_kv_cells_default_is_sized_to_need_and_never_below_one_budget() -> None:
    cfg = EngineConfig(model_path="m", max_sessions=32, session_budget=2048)
    assert cfg.suffix_cells == 32 * TYPICAL_SUFFIX < 32 * 2048
    assert EngineConfig(model_path="m", session_budget=128).suffix_cells == 16 * 128
    assert EngineConfig(model_path="m", max_sessions=1).suffix_cells == 2048  # one budget
    assert EngineConfig(model_path="m", kv_cells=5000).suffix_cells == 5000
    with pytest.raises(ValueError, match="--kv-cells"):
        EngineConfig(model_path="m", session_budget=1024, kv_cells=512).validate()


async def ledger_consistent(pool: SharedKVPool) -> int:
    """The ledger's free cells equal the context less the prefix and the resident
    sessions' promises (text owed to an idle session is not taken yet); returns them."""
    def read() -> tuple[int, int]:
        sched = pool.parts.scheduler
        held = sum(st.reserved - st.owed for st in sched.registry.resident().values())
        return sched.ledger.free_cells(), pool.info.n_ctx - pool.info.prefix_tokens - held

    free, expected = await pool.call(read)
    assert free == expected >= 0
    return free


async def check_cells(pool: SharedKVPool) -> None:
    """llama.cpp's own count of cells in use equals the pool's (parked sessions hold
    none), and every resident sequence ends where its private cells say."""
    load = pool.load()
    census = await pool.call(pool.parts.cell_census)
    assert census is not None and census.cells == load.cells_used
    ranges = await pool.call(pool.parts.seq_pos_ranges)
    states = await pool.call(lambda: list(pool.parts.scheduler.registry.resident().values()))
    for st in states:
        assert ranges[st.seq][1] == st.prefix_len + st.private - 1


async def small_pool(model: Path) -> SharedKVPool:
    return await make_pool(model, max_sessions=4, session_budget=BUDGET, kv_cells=BUDGET)


def test_sessions_grow_past_their_share_and_a_short_pool_parks_idle_ones(
        tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await small_pool(tiny_model_path)
        try:
            prefix = pool.info.prefix_tokens
            assert pool.info.n_ctx < prefix + 4 * BUDGET  # smaller than slots x budget
            assert pool.info.n_ctx == -(-(prefix + BUDGET) // 256) * 256
            share = (pool.info.n_ctx - prefix) // 4
            a, b = await pool.attach(), await pool.attach()
            a.append_tokens([7] * 150)  # past a quarter of the pool
            res = a.generate(SamplingParams(max_tokens=8, stop_at_eos=False))
            assert len([p async for p in res]) == 8
            assert a.state.private > share
            free = await ledger_consistent(pool)
            b.append_tokens([8] * (free + 10))  # the pool is short: owed, not refused
            assert b.state.owed == free + 10
            await ledger_consistent(pool)
            got = [p async for p in b.generate(SamplingParams(max_tokens=4,
                                                              stop_at_eos=False))]
            assert len(got) == 4 and a.parked and not b.parked  # a was parked for b
            assert b.state.owed == 0 and b.state.private > share
            await ledger_consistent(pool)
            await check_cells(pool)
            # a comes back (its suffix re-prefilled), parking b, and continues
            a.append("more")
            out = [p async for p in a.generate(SamplingParams(max_tokens=4,
                                                              stop_at_eos=False))]
            assert len(out) == 4 and b.parked and not a.parked
            await ledger_consistent(pool)
            await check_cells(pool)
            assert pool.load().parks >= 2 and pool.load().resumes >= 1
        finally:
            await pool.aclose()

    run(body())


def test_turns_that_fill_the_pool_end_context_full_and_nothing_deadlocks(
        tiny_model_path: Path) -> None:
    """Two turns grow at once until the pool has no free cell and no idle session to
    park: each ends ``context_full`` (its session lives); the next turn parks the other
    (now idle) session and runs; an append during a turn that does not fit names the fix."""
    async def body() -> None:
        pool = await small_pool(tiny_model_path)
        try:
            a, b = await pool.attach(), await pool.attach()
            params = SamplingParams(max_tokens=BUDGET, stop_at_eos=False)

            async def turn(s: object, text: list[int]) -> str:
                from mesh.engine.session import PooledSession
                assert isinstance(s, PooledSession)
                s.append_tokens(text)
                gen = s.generate(params)
                async for _ in gen:
                    pass
                assert gen.result is not None
                return gen.result.finish_reason

            reasons = await asyncio.wait_for(
                asyncio.gather(turn(a, [7] * 60), turn(b, [8] * 60)), 120)
            assert "context_full" in reasons
            free = await ledger_consistent(pool)
            assert free <= 1
            assert a.state.private + b.state.private <= pool.info.n_ctx - pool.info.prefix_tokens
            assert max(a.state.private, b.state.private) < BUDGET  # the pool, not the budget
            await check_cells(pool)
            # the next turn is not stuck: b (idle, least recently busy or not) is parked
            reason = await asyncio.wait_for(turn(a, [9] * 10), 60)
            assert reason in ("context_full", "length") and b.parked
            await ledger_consistent(pool)
            # appending during a turn when the pool is short: a clear error naming the fix
            await a.detach()
            await b.detach()
            x, y = await pool.attach(), await pool.attach()
            x.append_tokens([7] * 200)
            assert len([p async for p in x.generate(SamplingParams(max_tokens=2))]) <= 2
            y.append_tokens([5] * 4)
            gen = y.generate(SamplingParams(max_tokens=BUDGET, stop_at_eos=False))
            it = gen.__aiter__()
            await it.__anext__()
            free = await ledger_consistent(pool)
            assert 0 < free + 1 <= BUDGET - y.state.reserved  # fits the budget, not the pool
            with pytest.raises(ContextOverflow, match="--kv-cells"):
                y.append_tokens([5] * (free + 1))
            await gen.aclose()
        finally:
            await pool.aclose()

    run(body())


def test_every_way_a_session_ends_gives_its_cells_back(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await small_pool(tiny_model_path)
        try:
            whole = pool.info.n_ctx - pool.info.prefix_tokens
            assert await ledger_consistent(pool) == whole
            params = SamplingParams(max_tokens=6, stop_at_eos=False)
            resident, parked, owing, cancelled = [await pool.attach() for _ in range(4)]
            for s, n in ((parked, 40), (resident, 110), (cancelled, 110)):
                s.append_tokens([7] * n)
                assert len([p async for p in s.generate(params)]) == 6
            assert await pool.park(parked)
            free = await ledger_consistent(pool)
            owing.append_tokens([8] * (free + 5))  # owed: never taken from the pool
            assert owing.state.owed > 0
            gen = cancelled.generate(SamplingParams(max_tokens=BUDGET, stop_at_eos=False))
            it = gen.__aiter__()
            await it.__anext__()
            await gen.aclose()  # the turn is cancelled mid-way
            for s in (resident, parked, owing, cancelled):
                await s.detach()
                await ledger_consistent(pool)
            assert await ledger_consistent(pool) == whole
            load = pool.load()
            assert load.cells_used == pool.info.prefix_tokens and not load.sessions
            census = await pool.call(pool.parts.cell_census)
            if census is not None:
                assert census.cells == pool.info.prefix_tokens
        finally:
            await pool.aclose()

    run(body())


def test_capacity_shows_kv_cells_and_bytes(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await small_pool(tiny_model_path)
        try:
            s = await pool.attach()
            s.append_tokens([7] * 20)
            assert len([p async for p in s.generate(SamplingParams(max_tokens=3))]) <= 3
            model = pool.parts.built.model
            per_cell = KVShape(*model.kv_shape()[:4]).cell_bytes("f16")
            assert pool.info.cell_bytes == per_cell > 0
            cap = FloorGate(pool, GateConfig.create(policy="floor")).capacity()
            load = pool.load()
            assert cap["kv_cells"]["total"] == pool.info.n_ctx
            assert cap["kv_cells"]["used"] == load.cells_used > pool.info.prefix_tokens
            assert cap["kv_bytes"] == {"allocated": int(pool.info.n_ctx * per_cell),
                                       "used": int(load.cells_used * per_cell),
                                       "per_cell": per_cell}
            await s.detach()
        finally:
            await pool.aclose()

    run(body())
