"""Parking on the real pool (tiny model): an idle session's private cells leave the cache,
it stays attached, and it is re-prefilled before its next turn (issue 28)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import ContextOverflow, PoolFull, SessionState
from mesh.engine.pool import SharedKVPool, held_steps
from mesh.engine.session import PooledSession
from tests.engine.test_pool import GREEDY, make_pool, run, tokens_of


def ledger_of(pool: SharedKVPool) -> tuple[int, int]:
    ledger = pool.parts.scheduler.ledger
    assert ledger is not None
    return ledger.free_seq_ids, ledger.free_cells()


def suffix_matches(s: PooledSession) -> bool:
    st = s.state
    return st.parked or len(st.suffix) == st.private


def test_park_frees_cells_and_id_and_resume_continues_like_an_unparked_twin(
        tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=4)
        try:
            a, twin = await pool.attach(), await pool.attach()
            first_a = await tokens_of(a, "the first question")
            first_t = await tokens_of(twin, "the first question")
            assert first_a == first_t
            assert suffix_matches(a) and len(a.state.suffix) == a.state.private > 0
            ctx_len, sid, census = a.context_len, a.id, await pool.call(pool.parts.cell_census)
            free_ids, free_cells = ledger_of(pool)
            private = a.state.private
            assert await pool.park(a)
            assert a.parked and a.id == sid and a.seq_id == -1
            assert a.context_len == ctx_len  # the same history, off the cache
            assert ledger_of(pool) == (free_ids + 1, free_cells + private + 1)  # + carry
            after = await pool.call(pool.parts.cell_census)
            if census is not None and after is not None:
                assert after.cells == census.cells - private  # llama.cpp's own count
            load = pool.load()
            assert load.num_parked == 1 and load.num_resident == 1
            assert load.parked_tokens == private and load.parks == 1
            row = next(r for r in load.sessions if r.id == sid)
            assert row.parked and row.state is SessionState.IDLE
            assert row.context_len == ctx_len and row.private_cells == 0
            assert not await pool.park(a)  # already parked
            for text in ("and the second", "a third one"):
                got_a, got_t = await tokens_of(a, text), await tokens_of(twin, text)
                assert got_a == got_t
                assert not a.parked and suffix_matches(a)
                assert a.state.private == twin.state.private
                await pool.park(a)
            load = pool.load()
            assert load.resumes == 2 and load.resume_tokens > 2 * private
            ranges = await pool.call(pool.parts.seq_pos_ranges)
            assert ranges[twin.seq_id][1] == twin.context_len - 1
        finally:
            await pool.aclose()

    run(body())


def test_attach_past_max_sessions_parks_the_least_recently_busy_idle_session(
        tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=2)  # max_attached: 8
        try:
            a, b = await pool.attach(), await pool.attach()
            await tokens_of(b, "b goes first")
            await tokens_of(a, "a is the latest")  # b is now the least recently busy
            assert pool.check_attach().ok
            c = await pool.attach()
            assert b.parked and not a.parked and not c.parked
            assert pool.load().num_resident == 2 and len(pool.load().sessions) == 3
            got = await tokens_of(b, "b again")  # resumes b, parking a (c never ran)
            assert len(got) == GREEDY.max_tokens and not b.parked
            assert c.parked or a.parked
        finally:
            await pool.aclose()

    run(body())


def test_max_attached_bounds_attached_sessions_and_names_the_flag(
        tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=1, max_attached=3)
        try:
            s = [await pool.attach() for _ in range(3)]
            assert [x.parked for x in s] == [True, True, False]
            check = pool.check_attach()
            assert not check.ok and "--max-attached" in check.reason
            with pytest.raises(PoolFull, match="max_attached is 3"):
                await pool.attach()
            await s[0].detach()
            await pool.attach()  # the detached parked one's place
        finally:
            await pool.aclose()

    run(body())


def test_a_parked_turn_waits_while_every_resident_session_is_in_a_turn(
        tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=1, max_attached=3)
        try:
            a = await pool.attach()
            await tokens_of(a, "a first")
            b = await pool.attach()  # parks a
            assert a.parked
            a.append("a second")
            b.append("b first")
            long = SamplingParams(max_tokens=30, stop_at_eos=False)
            gen_b, gen_a = b.generate(long), a.generate(GREEDY)
            async with held_steps(pool):
                await gen_b.start()
                await gen_a.start()  # b holds the one id and is in a turn: a waits
                check = pool.check_attach()
                assert not check.ok and "in a turn" in check.reason
            rows = {r.id: r for r in pool.load().sessions}
            assert rows[a.id].state is SessionState.WAITING and rows[a.id].parked
            got_b = [p async for p in gen_b]
            got_a = [p async for p in gen_a]
            assert gen_b.result is not None and gen_b.result.num_generated == 30
            assert gen_a.result is not None and gen_a.result.num_generated == GREEDY.max_tokens
            assert len(got_b) >= 30 and got_a
            assert not a.parked and b.parked  # b was parked, idle, to resume a
        finally:
            await pool.aclose()

    run(body())


def test_detach_of_a_parked_session_frees_nothing_twice(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=2)
        try:
            a = await pool.attach()
            base = ledger_of(pool)
            await tokens_of(a, "some words to hold cells")
            await pool.park(a)
            assert len(a.state.pending) == 1  # the last sampled token, for the next turn
            assert ledger_of(pool) == (base[0] + 1, base[1])  # cells, promises and id back
            a.append("queued while parked")  # promised when it resumes
            assert ledger_of(pool) == (base[0] + 1, base[1])
            await a.detach()
            await a.detach()
            assert ledger_of(pool) == (base[0] + 1, base[1])  # all back, once
            assert pool.parts.scheduler.ledger.num_attached == 0
            assert pool.load().sessions == () and pool.load().parked_tokens == 0
            x, y = await pool.attach(), await pool.attach()
            assert {x.seq_id, y.seq_id} == {1, 2}
        finally:
            await pool.aclose()

    run(body())


def test_a_parked_session_keeps_its_budget(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=2, session_budget=40)
        try:
            a = await pool.attach()
            await tokens_of(a, "word " * 10)
            held = a.state.reserved
            await pool.park(a)
            with pytest.raises(ContextOverflow, match=f"holds {held} of its 40"):
                a.append_tokens([5] * (41 - held))
        finally:
            await pool.aclose()

    run(body())


def test_idle_threshold_parks_without_demand(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=2, park_idle_s=0.0)
        try:
            a = await pool.attach()
            await tokens_of(a, "hello")
            deadline = time.monotonic() + 10.0
            while not a.parked and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert a.parked
            assert len(await tokens_of(a, "again")) == GREEDY.max_tokens
        finally:
            await pool.aclose()

    run(body())


def test_naive_mode_parks_and_re_prefills_its_private_prefix(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=2, share_prefix=False)
        twin_pool = await make_pool(tiny_model_path, max_sessions=2, share_prefix=False)
        try:
            a, t = await pool.attach(), await twin_pool.attach()
            assert await tokens_of(a, "hello") == await tokens_of(t, "hello")
            await pool.park(a)
            assert await tokens_of(a, "more") == await tokens_of(t, "more")
        finally:
            await pool.aclose()
            await twin_pool.aclose()

    run(body())


def test_config_rejects_max_attached_below_max_sessions() -> None:
    with pytest.raises(ValueError, match="--max-attached"):
        EngineConfig(model_path="m", max_sessions=4, max_attached=2).validate()
    assert EngineConfig(model_path="m", max_sessions=4).attached_limit == 16


def test_gate_hard_room_follows_max_attached_not_free_sequence_ids() -> None:
    from mesh.engine.interface import PoolLoad, SessionLoad
    from mesh.gate.config import GateConfig
    from mesh.gate.decide import GateInput, project
    from mesh.gate.model import StepCost, ThroughputModel

    idle = tuple(SessionLoad(id=f"s{i}", state=SessionState.IDLE, private_cells=10,
                             context_len=110, decode_tps=None, duty_cycle=0.01, age_s=60.0,
                             num_generated=0) for i in range(4))

    def load(max_attached: int) -> PoolLoad:
        return PoolLoad(taken_at=0.0, sessions=idle, step_ms=None, agg_tps=0.0,
                        cells_used=140, cells_total=10_000, prefix_cells=100, naive_cells=440,
                        free_seq_ids=0, max_sessions=4, session_budget=512,
                        max_attached=max_attached)

    config = GateConfig.create(policy="projection", floor_tps=1.0, new_worker_cells=10)
    model = ThroughputModel(prior=StepCost(a=0.001, b=0.001, c=0.0, d=0.0))
    no_parking = project(GateInput(load=load(0), num_tickets=4), config, model)
    parking = project(GateInput(load=load(16), num_tickets=4), config, model)
    assert no_parking.hard_room == 0  # every sequence id is taken
    assert parking.hard_room == 12 and load(16).attach_room == 12


def test_swap_parks_the_suffix_alone_and_restores_it_shared_without_re_prefill(
        tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=4, park_memory=1 << 22)
        try:
            a, twin = await pool.attach(), await pool.attach()
            assert await tokens_of(a, "the first question") == await tokens_of(
                twin, "the first question")
            before = await pool.call(pool.parts.cell_census)
            private = a.state.private
            assert await pool.park(a)
            load = pool.load()
            assert load.swaps == 1 and 0 < load.parked_bytes <= load.park_memory == 1 << 22
            parked = await pool.call(pool.parts.cell_census)
            got, want = await tokens_of(a, "and the second"), await tokens_of(
                twin, "and the second")
            assert got == want
            load = pool.load()
            assert load.resumes == 1 and load.resume_tokens == 0  # nothing re-prefilled
            assert load.parked_bytes == 0
            if before is not None and parked is not None:
                assert parked.cells == before.cells - private
                await pool.park(a)
                await pool.park(twin)
                again = await pool.call(pool.parts.cell_census)
                assert again is not None and again.seq_refs == again.cells  # prefix alone
                got, want = await tokens_of(a, "x"), await tokens_of(twin, "x")
                assert got == want
                after = await pool.call(pool.parts.cell_census)
                # restored as the suffix only, the prefix shared again (no private copy)
                assert after is not None
                prefix = len(pool.parts.built.prefix)
                assert after.cells == prefix + a.state.private + twin.state.private
                assert after.seq_refs == 3 * prefix + a.state.private + twin.state.private
            ranges = await pool.call(pool.parts.seq_pos_ranges)
            assert ranges[a.seq_id] == (0, a.context_len - 1)
        finally:
            await pool.aclose()

    run(body())


def test_swap_past_park_memory_falls_back_to_recompute(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=4, park_memory=1)
        try:
            a = await pool.attach()
            await tokens_of(a, "some words")
            await pool.park(a)
            assert pool.load().swaps == 0 and pool.load().parked_bytes == 0
            await tokens_of(a, "more")
            assert pool.load().resume_tokens > 0
        finally:
            await pool.aclose()

    run(body())


def test_detach_of_a_swapped_session_gives_its_host_bytes_back(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=4, park_memory=1 << 22)
        try:
            a = await pool.attach()
            await tokens_of(a, "some words")
            await pool.park(a)
            assert pool.load().parked_bytes > 0
            await a.detach()
            assert pool.load().parked_bytes == 0 and pool.load().sessions == ()
        finally:
            await pool.aclose()

    run(body())


def test_text_for_a_parked_session_is_promised_on_resume_not_on_append(
        tiny_model_path: Path) -> None:
    """An agent's tool result arrives while it is parked and the cache is full of idle
    sessions' cells: the append succeeds, and the resume parks an idle one for room."""
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=1, session_budget=2048,
                               n_ctx=1024)
        try:
            a = await pool.attach()
            await tokens_of(a, "one two three")
            b = await pool.attach()  # parks a
            assert a.parked
            free = ledger_of(pool)[1]
            b.append_tokens([7] * (free - 4))  # the buffer is nearly full, b idle
            a.append_tokens([9] * 20)  # more than is free: promised on resume
            got = await asyncio.wait_for(tokens_of(a, "go"), 30)
            assert len(got) == GREEDY.max_tokens and b.parked
        finally:
            await pool.aclose()

    run(body())


@pytest.mark.parametrize("park_memory", [0, 1 << 22])
def test_sliding_window_model_parks_and_resumes_like_its_twin(
        tiny_gemma3_path: Path, park_memory: int) -> None:
    """The iSWA cache (base and sliding-window parts) parks and comes back, by recompute
    and by swap, continuing as its unparked twin does."""
    async def body() -> None:
        pool = await make_pool(tiny_gemma3_path, max_sessions=4, park_memory=park_memory)
        try:
            a, twin = await pool.attach(), await pool.attach()
            for text in ("first " * 20, "second " * 5, "third"):
                assert await tokens_of(a, text) == await tokens_of(twin, text)
                assert await pool.park(a)
            assert pool.load().swaps == (3 if park_memory else 0)
        finally:
            await pool.aclose()

    run(body())


def test_an_older_tasks_parked_turn_parks_a_newer_tasks_held_turn(
        tiny_model_path: Path) -> None:
    """Completion order across parking: every resident slot is in a turn — one running,
    one held by the decode gate — when an older task's parked session asks for its next
    turn. It parks the newer task's held turn (not the running one), comes back, takes
    the running row by completion order, and finishes first; every turn ends whole."""
    from tests.engine.test_turn_admission import OneAtATime

    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=2, max_attached=4)
        pool.set_turn_admission(OneAtATime())  # room 0 while anything runs
        try:
            a = await pool.attach()
            await tokens_of(a, "a first")
            b, c = await pool.attach(), await pool.attach()  # c's attach parks idle a
            assert a.parked
            b.append("b first")
            gen_b = b.generate(SamplingParams(max_tokens=40, stop_at_eos=False, priority=5.0))
            it_b = gen_b.__aiter__()
            await it_b.__anext__()  # b runs
            c.append("c first")
            gen_c = c.generate(SamplingParams(max_tokens=4, stop_at_eos=False, priority=6.0))
            await gen_c.start()
            while {s.id: s.state for s in pool.load().sessions}[c.id] is not SessionState.WAITING:
                await asyncio.sleep(0.001)  # c's turn is held: no room
            a.append("a second")
            gen_a = a.generate(SamplingParams(max_tokens=4, stop_at_eos=False, priority=1.0))
            got_a, c_parked_while_a_ran = [], []
            async for piece in gen_a:  # a's turn is resident until its 4th token
                got_a.append(piece)
                if len(got_a) == 1:
                    rows = {s.id: s for s in pool.load().sessions}
                    c_parked_while_a_ran.append(rows[c.id].parked)
            assert gen_a.result is not None and gen_a.result.num_generated == 4 and got_a
            assert c_parked_while_a_ran == [True]  # c's held turn made the room
            load = pool.load()  # (c may be back already: a went idle and parks for it)
            rows = {s.id: s for s in load.sessions}
            assert rows[b.id].num_generated < 40  # a did not wait for b's 40 tokens
            parks = load.parks
            await asyncio.gather(*(asyncio.ensure_future(_drain(g)) for g in (it_b, gen_c)))
            assert gen_b.result is not None and gen_b.result.num_generated == 40
            assert gen_c.result is not None and gen_c.result.num_generated == 4
            assert parks >= 2  # a for c's attach, then c (held) for a's resume
        finally:
            await pool.aclose()

    run(body())


async def _drain(gen: object) -> None:
    async for _ in gen:  # type: ignore[attr-defined]
        pass
