"""Compaction (``Session.compact``): a session's suffix is replaced by a summary, its cells
freed, the shared prefix's cells untouched; on the real pool (tiny model), and with the same
semantics on the fake engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.engine.config import SamplingParams
from mesh.engine.interface import ContextOverflow, SessionFailed
from mesh.engine.pool import SharedKVPool
from mesh.sim.fake import FakeEngine
from tests.engine.test_pool import GREEDY, check_cells, make_pool, run, tokens_of


def test_compact_frees_the_suffix_and_the_summary_is_what_follows(
        tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, session_budget=256)
        try:
            a, b = await pool.attach(), await pool.attach()
            await tokens_of(a, "first question about the project files " * 3)
            await tokens_of(b, "another agent's turn")
            prefix_ranges = (await pool.call(pool.parts.seq_pos_ranges))[0]
            before = pool.load()
            held = a.state.private
            assert held > 30
            assert await a.compact("summary: the task, its evidence, the open question")
            load = pool.load()
            assert load.cells_used == before.cells_used - held, "its suffix cells are freed"
            assert load.compactions == 1 and load.compacted_cells == held
            assert (await pool.call(pool.parts.seq_pos_ranges))[0] == prefix_ranges
            summary = pool.tokenize("summary: the task, its evidence, the open question")
            assert a.context_len == pool.info.prefix_tokens  # nothing decoded after it yet
            # The next turn prefills the summary, then the new text, after the prefix:
            # exactly what a fresh session given the summary first would see.
            got = await tokens_of(a, " next step")
            fresh = await pool.attach()
            fresh.append_tokens(summary)
            assert await tokens_of(fresh, " next step") == got
            assert a.state.private == len(summary) + len(pool.tokenize(" next step")) + len(got)
            await check_cells(pool)
            assert await tokens_of(b, " and on")  # the other session never noticed
        finally:
            await pool.aclose()

    run(body())


def test_compact_refuses_mid_turn_and_past_the_budget_and_after_detach(
        tiny_model_path: Path) -> None:
    async def body() -> None:
        pool: SharedKVPool = await make_pool(tiny_model_path, session_budget=64)
        try:
            s = await pool.attach()
            s.append("some words to decode")
            gen = s.generate(SamplingParams(max_tokens=30, stop_at_eos=False))
            pieces = gen.__aiter__()
            first = await pieces.__anext__()
            assert first.text is not None
            assert not await s.compact("summary"), "a turn is running"
            await gen.aclose()
            async for _ in pieces:
                pass
            with pytest.raises(ContextOverflow, match="budget"):
                await s.compact("far too long a summary " * 40)
            assert await tokens_of(s, " again", GREEDY)  # the old suffix is still there
            await s.detach()
            with pytest.raises(SessionFailed):
                await s.compact("summary")
            assert pool.load().cells_used == pool.info.prefix_tokens
        finally:
            await pool.aclose()

    run(body())


def test_the_fake_engine_compacts_as_the_pool_does() -> None:
    async def body() -> None:
        engine = FakeEngine()
        s = await engine.attach()
        s.append("one two three four")
        _ = [p async for p in s.generate(SamplingParams(max_tokens=4))]
        assert s.private_cells == 8
        assert await s.compact("summary words")
        assert engine.load().compactions == 1 and engine.load().compacted_cells == 8
        s.append("next")
        out = "".join([p.text async for p in s.generate(SamplingParams(max_tokens=3))])
        assert out == "summary words next"  # the echo of what follows the prefix now
        with pytest.raises(ContextOverflow):
            await s.compact("x " * 5000)

    run(body())
