"""Every way an attach can end gives its session back (issue 42): a caller cancelled
while its attach waits, one cancelled while the engine thread runs it, and a handle
dropped without a detach (the reaper). Real llama.cpp, the tiny model."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from pathlib import Path

import pytest

from mesh.engine import pool as pool_module
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.pool import SharedKVPool
from mesh.engine.session import SeqState

PREFIX = "The shared project prefix: tools, files and notes for every agent. " * 4


async def make_pool(model: Path) -> SharedKVPool:
    pool = SharedKVPool(EngineConfig(model_path=str(model), max_sessions=4,
                                     session_budget=128, n_threads=1), PREFIX)
    await pool.start()
    return pool


async def settled(pool: SharedKVPool) -> tuple[int, int]:
    """(sessions, cells) once every queued command has run."""
    await pool.call(lambda: None)
    load = pool.load()
    return len(load.sessions), load.cells_used


def test_an_attach_cancelled_while_queued_never_runs(tiny_model_path: Path) -> None:
    async def main() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            baseline = await settled(pool)
            gate = threading.Event()
            blocker = asyncio.ensure_future(pool.call(lambda: gate.wait(10)))
            await asyncio.sleep(0.05)  # the engine thread is inside the blocker
            attach = asyncio.ensure_future(pool.attach())
            await asyncio.sleep(0.05)
            attach.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attach
            gate.set()
            await blocker
            assert await settled(pool) == baseline
            assert pool.load().sessions_attached == 0
        finally:
            await pool.aclose()

    asyncio.run(main())


def test_an_attach_cancelled_while_it_runs_is_released(tiny_model_path: Path) -> None:
    async def main() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            baseline = await settled(pool)
            scheduler = pool.parts.scheduler
            real_attach = scheduler.attach
            running, go = threading.Event(), threading.Event()

            def slow_attach() -> SeqState:
                running.set()
                go.wait(10)
                return real_attach()

            scheduler.attach = slow_attach  # type: ignore[method-assign]
            attach = asyncio.ensure_future(pool.attach())
            assert await asyncio.to_thread(running.wait, 10)
            attach.cancel()  # the engine thread is inside the attach: it cannot stop it
            with pytest.raises(asyncio.CancelledError):
                await attach
            go.set()
            for _ in range(100):  # the undo is queued when the attach returns
                if await settled(pool) == baseline and pool.load().sessions_attached:
                    break
                await asyncio.sleep(0.01)
            assert await settled(pool) == baseline
            assert pool.load().sessions_attached == 1  # it did attach, then was released
            scheduler.attach = real_attach  # type: ignore[method-assign]
            session = await pool.attach()  # the pool still works
            session.append("hello")
            text = "".join([p.text async for p in session.generate(
                SamplingParams(max_tokens=4, stop_at_eos=False))])
            assert isinstance(text, str)
            await session.detach()
            assert await settled(pool) == baseline
        finally:
            await pool.aclose()

    asyncio.run(main())


def test_a_dropped_handle_is_reaped_and_counted(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(pool_module, "REAP_INTERVAL_S", 0.05)
    monkeypatch.setattr(pool_module, "REAP_GRACE_S", 0.1)
    monkeypatch.setattr(pool_module, "GC_INTERVAL_S", 0.1)

    async def main() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            baseline = await settled(pool)
            kept = await pool.attach()
            kept.append("a session someone still holds")
            dropped = await pool.attach()
            dropped.append("a session whose owner forgot to detach it")
            cycle: list[object] = [dropped]
            cycle.append(cycle)  # held only by a reference cycle: freed by a collection
            del dropped, cycle
            for _ in range(200):
                if pool.load().sessions_reaped:
                    break
                await asyncio.sleep(0.02)
            load = pool.load()
            assert load.sessions_reaped == 1
            assert [s.id for s in load.sessions] == [kept.id]  # the held one stays
            await kept.detach()
            assert await settled(pool) == baseline
        finally:
            await pool.aclose()

    with caplog.at_level(logging.WARNING, logger="mesh.engine.pool"):
        asyncio.run(main())
    gc.collect()
    assert any("was reaped" in r.getMessage() for r in caplog.records)
