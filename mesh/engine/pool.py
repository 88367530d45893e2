"""The shared KV pool: one model, one context, one immutable prefix, many sessions.

Sequence 0 holds the prefix. ``attach`` copies it to a free sequence id with
``llama_memory_seq_cp``, which with a unified KV cache only adds the new id to the prefix
cells' metadata: every session reads the same prefix cells and owns only its suffix.

This facade's commands run on the engine thread (:mod:`mesh.engine.thread`), whose
:meth:`~mesh.engine.thread.Parts.step` is one step: the **scheduler**
(:mod:`mesh.engine.scheduler`: sessions, cell ledger, turns, load snapshots) plans it, the
**runner** (:mod:`mesh.engine.step`) fills the batch, runs one ``llama_decode`` and samples
every session that asked for logits before the next decode overwrites them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from mesh.engine.build import Progress, build
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import (
    AttachCheck,
    PoolInfo,
    PoolLoad,
    PrefillBudget,
    SessionFailed,
    SessionState,
    TurnAdmission,
)
from mesh.engine.native import resolve
from mesh.engine.scheduler import Snapshots, StepLimits, StepStats
from mesh.engine.session import PooledSession, SeqState, Turn
from mesh.engine.thread import EngineThread, Parts, assemble

__all__ = ["MAX_SEQUENCES", "SharedKVPool"]

T = TypeVar("T")
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: the prefix sequence counts toward it

logger = logging.getLogger(__name__)

# The orphan reaper (the safety net under every detach): every REAP_INTERVAL_S it releases
# the sessions attached at least REAP_GRACE_S ago that no caller holds a handle on
# (a PooledSession is made the moment an attach returns, so a live session always has one).
# A handle kept alive only by a reference cycle (a cancelled task's traceback) is freed by
# a full collection, run at most every GC_INTERVAL_S while sessions sit idle. An orphan is
# therefore released within REAP_GRACE_S + GC_INTERVAL_S + REAP_INTERVAL_S of its owner's
# end.
REAP_INTERVAL_S = 5.0
REAP_GRACE_S = 10.0
GC_INTERVAL_S = 60.0


class SharedKVPool:
    """The real engine. Build with ``SharedKVPool(config, prefix)``, then ``await start()``.

    ``prefix`` is text (tokenized with BOS) or a list of token ids. It is decoded once, or
    restored from the warm-start cache, and never changes: a different prefix is a
    different pool. Step counters are in ``pool.stats`` (``num_steps``, ``host_s``,
    ``decode_s``).
    """

    def __init__(self, config: EngineConfig, prefix: str | list[int]) -> None:
        config.validate()
        if config.max_sessions + 1 > MAX_SEQUENCES:
            raise ValueError(
                f"max_sessions {config.max_sessions} is above llama.cpp's limit of "
                f"{MAX_SEQUENCES - 1} sessions (one sequence holds the prefix)"
            )
        self.config = config
        self._prefix_input = prefix
        self._parts: Parts | None = None  # from start() to aclose()
        self._info: PoolInfo | None = None  # kept after aclose()
        self._engine = EngineThread()
        self._limits = StepLimits()
        self.stats = StepStats()
        self._snapshots = Snapshots(self.stats)  # kept after aclose(): load() still reads
        self._reaper = OrphanReaper(self)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, progress: Progress | None = None) -> PoolInfo:
        """Load the model, build or restore the prefix, start the engine thread."""
        lib = resolve(self.config.native)  # --native on without the library: fail first
        built = await asyncio.to_thread(build, self.config, self._prefix_input, progress)
        self._info = built.info
        self._parts = assemble(built, self.config, lib, self._limits, self._snapshots,
                               self.stats)
        self._parts.scheduler.publish()
        self._engine.start(self._parts)
        return built.info

    async def aclose(self) -> None:
        """Stop the engine thread, fail turns in flight, free native handles."""
        await self._reaper.stop()
        await self._engine.stop()
        if self._parts is not None:
            self._parts.scheduler.registry.fail_all("the pool was closed")
            self._parts.close()
            self._parts = None

    @property
    def info(self) -> PoolInfo:
        if self._info is None:
            raise RuntimeError("the pool is not started; await pool.start() first")
        return self._info

    @property
    def parts(self) -> Parts:
        """The engine-thread parts (scheduler, runner, built handles) while started, for
        tests and benchmarks; touch them on the engine thread (:meth:`call`)."""
        if self._parts is None:
            raise RuntimeError("the pool is not started; await pool.start() first")
        return self._parts

    def set_prefill_budget(self, budget: PrefillBudget | None) -> None:
        self._limits.prefill_budget = budget

    def set_turn_admission(self, gate: TurnAdmission | None) -> None:
        self._limits.turn_admission = gate

    # ------------------------------------------------------------------ commands

    def wake(self) -> None:
        self._engine.wake()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and await its result (SessionFailed when the
        pool is not running)."""
        return await self._engine.call(fn)

    def tokenize(self, text: str) -> list[int]:
        return self.parts.built.model.tokenize(text, add_bos=False)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def check_attach(self) -> AttachCheck:
        if self._parts is None:
            return AttachCheck(False, "the pool is not started")
        return self._parts.scheduler.check_attach()

    async def attach(self) -> PooledSession:
        """A new session. Cancelled while the engine thread attaches it, the session is
        released there (nobody would ever detach it); a handle dropped without a detach is
        released by the reaper (see REAP_INTERVAL_S)."""
        scheduler = self.parts.scheduler
        st = await self._engine.call(scheduler.attach, undo=scheduler.release)
        return self._reaper.track(PooledSession(self, st))

    def append_tokens(self, st: SeqState, tokens: list[int]) -> None:
        """Queue tokens for prefill; the ledger checks the budgets first (check, then commit)."""
        self.parts.scheduler.ledger.queue(st, tokens)
        self.wake()

    async def start_turn(self, st: SeqState, params: SamplingParams) -> Turn:
        loop = asyncio.get_running_loop()
        return await self.call(lambda: self.parts.scheduler.open_turn(st, params, loop))

    async def park(self, session: PooledSession, *, rewrite: list[int] | None = None) -> bool:
        """Park an idle session now (it stays attached; False: it is in a turn or already
        parked), or with ``rewrite`` compact it (:meth:`PooledSession.compact`)."""
        return await self.call(lambda: self.parts.scheduler.park(session.state, rewrite))

    async def detach(self, st: SeqState) -> None:
        if st.detached:
            return
        with contextlib.suppress(SessionFailed):
            await self.call(lambda: self.parts.scheduler.release(st))

    def load(self) -> PoolLoad:
        return self._snapshots.load()

    def turn_place(self, session_id: str) -> int | None:
        return self._snapshots.turn_place(session_id)

    def backend_metrics(self) -> None:
        return None  # the pool is this process: /capacity has its figures already


@contextlib.asynccontextmanager
async def held_steps(pool: SharedKVPool) -> AsyncIterator[None]:
    """Run no step of ``pool`` inside this block (commands still run): turns started inside
    it begin in the same step, which makes a multi-session schedule reproducible (tests and
    benchmarks; the server never holds steps)."""
    engine = pool._engine

    def hold(value: bool) -> None:
        engine.held = value

    await pool.call(lambda: hold(True))
    try:
        yield
    finally:
        await pool.call(lambda: hold(False))


class OrphanReaper:
    """The safety net under every detach: releases the sessions of ``pool`` that no caller
    holds a handle on any more (see REAP_INTERVAL_S). It runs on the loop that attaches,
    from the first :meth:`track` to :meth:`stop`."""

    def __init__(self, pool: SharedKVPool) -> None:
        self._pool = pool
        # Every live handle by session id (weak: a handle nobody holds leaves by itself).
        self._handles: weakref.WeakValueDictionary[str, PooledSession] = (
            weakref.WeakValueDictionary())
        self._task: asyncio.Task[None] | None = None

    def track(self, session: PooledSession) -> PooledSession:
        self._handles[session.id] = session
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._run(), name="mesh-reaper")
        return session

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._task
            self._task = None

    def _reap_unheld(self, held: frozenset[str]) -> list[str]:
        """Engine thread: release what ``held`` does not name (past the grace)."""
        return self._pool.parts.scheduler.reap(held, time.monotonic(), REAP_GRACE_S)

    async def _run(self) -> None:
        """Release sessions whose handles are gone (the log names each; the load's
        ``sessions_reaped`` counts them)."""
        pool = self._pool
        last_gc = time.monotonic()
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            sessions = pool.load().sessions
            if not sessions:
                continue
            now = time.monotonic()
            if now - last_gc >= GC_INTERVAL_S and any(
                    s.state is SessionState.IDLE for s in sessions):
                # An idle session's handle may be held only by a cycle (a dead task's
                # traceback): a full collection frees it, and the reap below sees it gone.
                gc.collect()
                last_gc = now
            reap = functools.partial(self._reap_unheld, frozenset(self._handles.keys()))
            try:
                reaped = await pool.call(reap)
            except SessionFailed:
                return  # the pool stopped
            for sid in reaped:
                logger.warning("session %s was reaped: attached, but no caller holds it any "
                               "more (its owner ended without detaching); its cells are free",
                               sid)
