"""One pool in a Ray actor: the process that owns a :class:`~mesh.engine.pool.SharedKVPool`
(its model, prefix, sessions, engine thread and decode gate) on whichever node Ray placed
it. :class:`PoolActor` is a plain class (:mod:`mesh.cluster.pools` makes it a Ray actor),
so this module imports no Ray and the contract can be tested without a cluster.

Contract (every method runs on the actor's one event loop):

* ``start()`` builds the pool and returns its :class:`~mesh.engine.interface.PoolInfo`;
  nothing else is called before it returns.
* ``attach()`` returns a session id (``PoolFull`` when there is no room);
  ``generate(sid, text, params)`` appends ``text`` (``ContextOverflow`` past the budget)
  and streams one turn as :class:`Chunk` objects, at most one per :data:`STREAM_GAP_S`,
  the last with the turn's :class:`TurnEnd`; ``stop(sid)`` ends a running turn early;
  ``compact(sid, text)`` replaces the session's suffix (False mid-turn); ``detach(sid)``
  frees the session (idempotent, unknown ids ignored).
* ``report()`` is the pool's load without its step window, the attach check, and the
  steps not sent before (each step is sent once, by a report or a :class:`TurnEnd`, so
  the gate's model counts each once).
* ``set_budgets((prefill, turns))`` installs the gate's prefill budget and decode gate as
  one pickled pair (the floor policy's :class:`~mesh.gate.decode_gate.DecodeGate` is both,
  and stays one object here). Each pool's copy decides on its own pool's steps.
* A session is held here until ``detach``: the pool's orphan reaper never sees one drop;
  the coordinator detaches the sessions whose handles it lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    AttachCheck,
    Engine,
    Generation,
    Piece,
    PoolInfo,
    PoolLoad,
    PrefillBudget,
    Session,
    SessionFailed,
    StepSample,
    TurnAdmission,
    TurnResult,
)

__all__ = ["STREAM_GAP_S", "Budgets", "Chunk", "HostedPool", "PoolActor", "PoolReport",
           "TurnEnd"]

# A turn's pieces leave the actor at most this often: every piece that arrived meanwhile
# goes in one Ray object. Each object costs CPU on both sides (measured ~1 ms a hop on 2
# shared cores); a pool whose steps take longer than this sends one object per step.
STREAM_GAP_S = 0.01

Budgets = tuple[PrefillBudget | None, TurnAdmission | None]


class HostedPool(Engine, Protocol):
    """What the actor hosts: an engine that starts (the local pool; the fake in tests)."""

    async def start(self, progress: Callable[[int, int], None] | None = None) -> PoolInfo: ...


@dataclass(frozen=True)
class Chunk:
    """One item of a ``generate`` stream; only the last carries ``end``."""

    pieces: tuple[Piece, ...]
    end: TurnEnd | None = None


@dataclass(frozen=True)
class TurnEnd:
    """How a ``generate`` stream's turn ended, and the pool's report as it ended."""

    result: TurnResult
    turn_s: float  # from the call's arrival here: the coordinator's wall time less this is the hop
    report: PoolReport


@dataclass(frozen=True)
class PoolReport:
    """The pool's load as the coordinator reads it (see the module docstring)."""

    load: PoolLoad  # its ``recent_steps`` empty: the new ones are in ``new_steps``
    check: AttachCheck
    new_steps: tuple[StepSample, ...]


class PoolActor:
    """A pool hosted in a Ray actor (see the module docstring). ``make`` builds the pool
    in the actor's process (a picklable callable: ``functools.partial(SharedKVPool,
    config, prefix)``)."""

    def __init__(self, make: Callable[[], HostedPool]) -> None:
        self._make = make
        self._pool: HostedPool | None = None
        self._sessions: dict[str, Session] = {}
        self._turns: dict[str, Generation] = {}
        self._last_sent: StepSample | None = None  # the last step a report carried

    @property
    def pool(self) -> HostedPool:
        if self._pool is None:
            raise SessionFailed("the pool actor is not started; call start() first")
        return self._pool

    async def start(self) -> PoolInfo:
        pool = self._make()
        info = await pool.start(None)
        self._pool = pool
        return info

    def pid(self) -> int:
        """The actor's process id (what a test kills to kill the pool)."""
        return os.getpid()

    def set_budgets(self, budgets: Budgets) -> None:
        prefill, turns = budgets
        self.pool.set_prefill_budget(prefill)
        self.pool.set_turn_admission(turns)

    async def attach(self) -> str:
        session = await self.pool.attach()
        self._sessions[session.id] = session
        return session.id

    def _session(self, sid: str) -> Session:
        session = self._sessions.get(sid)
        if session is None:
            raise SessionFailed(f"session {sid} is not attached to this pool (detached, or "
                                "its pool was restarted)")
        return session

    async def generate(self, sid: str, text: str, params: SamplingParams) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        session = self._session(sid)
        if text:
            session.append(text)
        gen = session.generate(params)
        self._turns[sid] = gen
        arrived: list[Piece] = []
        moved = asyncio.Event()  # a piece arrived, or the turn ended
        ended = asyncio.Event()

        async def pump() -> None:
            try:
                async for piece in gen:
                    arrived.append(piece)
                    moved.set()
            finally:
                ended.set()
                moved.set()

        task = asyncio.get_running_loop().create_task(pump())
        try:
            last = 0.0
            while not ended.is_set():
                await moved.wait()
                wait = last + STREAM_GAP_S - time.perf_counter()
                if wait > 0:  # gather what arrives meanwhile (one object), unless it ends
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ended.wait(), wait)
                if ended.is_set():
                    break  # the last pieces go with the turn's end
                moved.clear()
                last = time.perf_counter()
                pieces, arrived[:] = list(arrived), []
                yield Chunk(tuple(pieces))
            await task  # the turn's error, if it failed
            result = gen.result
            if result is None:
                raise SessionFailed(f"session {sid}'s turn ended without a result")
            turn_s = time.perf_counter() - started
            yield Chunk(tuple(arrived), TurnEnd(result, turn_s, self.report()))
        finally:
            self._turns.pop(sid, None)
            if not task.done():  # the caller went away: end the turn, nobody reads it
                await gen.aclose()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def compact(self, sid: str, text: str) -> bool:
        return await self._session(sid).compact(text)

    async def stop(self, sid: str) -> None:
        gen = self._turns.get(sid)
        if gen is not None:
            await gen.aclose()

    async def detach(self, sid: str) -> None:
        session = self._sessions.pop(sid, None)
        if session is not None:
            await session.detach()

    def report(self) -> PoolReport:
        load = self.pool.load()
        steps = load.recent_steps
        # After the last step sent; one no longer in the window: the whole window is new.
        start = next((i + 1 for i in reversed(range(len(steps)))
                      if steps[i] is self._last_sent), 0)
        if steps:
            self._last_sent = steps[-1]
        return PoolReport(replace(load, recent_steps=()), self.pool.check_attach(),
                          tuple(steps[start:]))

    async def close(self) -> None:
        for sid in list(self._sessions):
            with contextlib.suppress(Exception):
                await self.detach(sid)
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None
