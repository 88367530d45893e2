"""Per-step Python work, counted (not timed) on the tiny model: one hand-off to a consumer
loop per step, and the load snapshot captured at a bounded rate, yet fresh at turn ends."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mesh.engine import scheduler as stats
from mesh.engine import session
from mesh.engine import thread as poster
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import SessionState
from mesh.engine.pool import SharedKVPool, held_steps
from mesh.engine.scheduler import SNAPSHOT_INTERVAL_S

PREFIX = "The shared project prefix: tools, files and notes for every agent. " * 4


async def run_lockstep(model: Path, n: int, tokens: int) -> tuple[SharedKVPool, list[int]]:
    pool = SharedKVPool(EngineConfig(model_path=str(model), max_sessions=8,
                                     session_budget=tokens + 32, n_threads=1), PREFIX)
    await pool.start()
    sessions = [await pool.attach() for _ in range(n)]
    gens = []
    async with held_steps(pool):
        for i, s in enumerate(sessions):
            s.append(f"session {i}")
            g = s.generate(SamplingParams(max_tokens=tokens, stop_at_eos=False))
            await g.start()
            gens.append(g)

    async def drain(g: Any) -> int:
        return len([p async for p in g])

    counts = list(await asyncio.gather(*(drain(g) for g in gens)))
    return pool, counts


def test_one_hand_off_per_loop_per_step(tiny_model_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"deliver": 0, "items": 0}
    real = session.deliver

    def counting(items: list[Any]) -> None:
        calls["deliver"] += 1
        calls["items"] += len(items)
        real(items)

    monkeypatch.setattr(poster, "deliver", counting)

    async def body() -> None:
        pool, counts = await run_lockstep(tiny_model_path, 4, 24)
        try:
            steps = pool.stats.num_steps
            assert counts == [24] * 4
            assert calls["items"] == 4 * 24 + 4  # every piece and every turn's result
            # All four turns move in lock-step: one hand-off per step (not per token).
            assert calls["deliver"] <= steps + 1 < calls["items"] / 3
        finally:
            await pool.aclose()

    asyncio.run(body())


def test_snapshot_is_captured_at_a_bounded_rate_and_fresh_at_turn_ends(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    captures = {"n": 0}
    real = stats.StepStats.snapshot

    def counting(self: stats.StepStats, *args: Any, **kw: Any) -> stats.Capture:
        captures["n"] += 1
        return real(self, *args, **kw)

    monkeypatch.setattr(stats.StepStats, "snapshot", counting)

    async def body() -> None:
        pool = SharedKVPool(EngineConfig(model_path=str(tiny_model_path), max_sessions=2,
                                         session_budget=300, n_threads=1), PREFIX)
        await pool.start()
        try:
            s = await pool.attach()
            s.append("a long turn")
            before = captures["n"]
            t0 = asyncio.get_running_loop().time()
            gen = s.generate(SamplingParams(max_tokens=200, stop_at_eos=False))
            got = [p async for p in gen]
            elapsed = asyncio.get_running_loop().time() - t0
            steps = 200
            made = captures["n"] - before
            # Turn start and end force one each; otherwise one per SNAPSHOT_INTERVAL_S.
            assert made <= 3 + elapsed / SNAPSHOT_INTERVAL_S + 1
            assert made < steps / 2
            load = pool.load()  # fresh at the turn's end
            assert len(got) == 200 and load.sessions[0].num_generated == 200
            assert load.sessions[0].state is SessionState.IDLE
        finally:
            await pool.aclose()

    asyncio.run(body())
