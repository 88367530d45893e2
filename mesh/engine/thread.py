"""The pool's engine thread and what it runs: its command queue, the poster that hands
each step's items to the consumers' loops, and the engine-thread parts of a started pool.

**Commands.** Callers hand the thread functions (:meth:`EngineThread.call`); between
commands it runs engine steps while there is work. Cancellation contract: a caller
cancelled while its command waits in the queue takes the command with it (it never runs);
a caller cancelled while its command runs cannot stop it, so a command that creates
something (a session) names its ``undo``, which the engine thread runs on the result nobody
will receive. Without that, an attach that lands just after its task was cancelled would
hold a session (cells, a sequence id) for ever.

**The poster.** ``loop.call_soon_threadsafe`` writes to the loop's wake-up socket, and that
write lets the woken loop take the GIL while the engine thread waits to get it back, so
delivery in the engine thread serialised the consumers' work with the engine's. The engine
thread queues one mapping per step instead (no system call); the poster thread posts it,
one ``call_soon_threadsafe`` per loop per step, once the engine thread lets go of the GIL
in ``llama_decode`` (after the snapshot the consumers should see is published): the
consumers run while the next step decodes.

**The parts.** :func:`assemble` makes the :class:`~mesh.engine.scheduler.Scheduler`
(sessions, ledger, turns, snapshots) and the :class:`~mesh.engine.step.StepRunner` (with the
native step when its library is loaded) over one :class:`~mesh.engine.build.Built`.
:meth:`Parts.step` is one engine step, schedule → decode → sample → record.
:meth:`Parts.close` frees the native handles, runner first, context before model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mesh.engine.build import PREFIX_SEQ, Built
from mesh.engine.config import EngineConfig
from mesh.engine.interface import SessionFailed
from mesh.engine.llama import CellCensus, header_bytes, parse_cell_census
from mesh.engine.native import NativeBatch, NativeStepper
from mesh.engine.scheduler import Scheduler, Snapshots, StepLimits, StepStats
from mesh.engine.session import Turn, deliver
from mesh.engine.step import DecodeFailed, StepRunner

__all__ = ["Commands", "EngineThread", "Parts", "Poster", "assemble"]


# -------------------- commands ------------------------------------------------

T = TypeVar("T")


class Commands:
    """Functions to run on the engine thread, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def wake(self) -> None:
        self._queue.put(lambda: None)

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` with nobody awaiting it (any thread; never blocks)."""
        self._queue.put(fn)

    async def call(self, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
        """Queue ``fn`` and await its result (or its exception). If the caller is
        cancelled after ``fn`` ran (or while it runs), ``undo(result)`` runs on the engine
        thread instead of the result being lost (see the module docstring)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the caller left before it ran: nothing was done, nothing to undo
            try:
                result = fn()
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._queue.put(run)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if undo is not None:
                def orphaned(done: concurrent.futures.Future[T]) -> None:
                    if not done.cancelled() and done.exception() is None:
                        result = done.result()
                        self._queue.put(lambda: undo(result))

                fut.add_done_callback(orphaned)  # runs now if fn already finished
            raise

    def drain(self, block: bool) -> None:
        """Engine thread: run every queued command (waiting up to 0.25 s for one if
        ``block``)."""
        try:
            cmd = self._queue.get(timeout=0.25) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        cmd()
        while True:
            try:
                self._queue.get_nowait()()
            except queue.Empty:
                return

# -------------------- the poster ----------------------------------------------

Items = Mapping[asyncio.AbstractEventLoop, Sequence[tuple[Any, Any]]]


class Poster:
    """Delivers in order: a batch queued before another reaches its loops first."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Items | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mesh-poster", daemon=True)
        self._thread.start()

    def post(self, by_loop: Items) -> None:
        """Queue one step's items, grouped by consumer loop (any thread)."""
        self._queue.put(by_loop)

    def post_outbox(self, outbox: list[tuple[Turn, Any]]) -> None:
        """Engine thread: group the outbox by its turns' loops, queue it, empty it (the
        same list object: the turns keep appending to it)."""
        if not outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Turn, Any]]] = {}
        for turn, item in outbox:
            by_loop.setdefault(turn.loop, []).append((turn, item))
        outbox.clear()
        self.post(by_loop)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            for loop, items in batch.items():
                with contextlib.suppress(RuntimeError):  # a closed loop drops its items
                    loop.call_soon_threadsafe(deliver, list(items))

    def close(self) -> None:
        """Deliver what is queued, then stop the thread (blocks; idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

# -------------------- the parts -----------------------------------------------

@dataclass
class Parts:
    """Everything the engine thread works with for one started pool (tests and benches
    reach the owners through it: ``pool.parts.scheduler.ledger``, ``pool.parts.built.ctx``)."""

    built: Built
    scheduler: Scheduler
    runner: StepRunner
    stats: StepStats

    def step(self) -> None:
        """One engine step: the scheduler plans, the runner decodes and samples, the
        scheduler republishes (the items wait in the scheduler for the engine thread)."""
        t0 = time.monotonic()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return
        plan, cells = scheduled
        done = self.runner.decode(plan, step_started=t0, cells_used=cells)
        if isinstance(done, DecodeFailed):
            self.scheduler.decode_failed(done.seqs, done.reason)
            return
        self.runner.sample(plan, done)
        self.scheduler.stepped(self.runner.record(plan, done, self.stats))

    def seq_pos_ranges(self) -> dict[int, tuple[int, int]]:
        """llama.cpp's own (min, max) position of the prefix sequence and of every resident
        session's sequence (engine thread: ``await pool.call(pool.parts.seq_pos_ranges)``)."""
        ctx = self.built.ctx
        return {s: ctx.seq_pos_range(s)
                for s in [PREFIX_SEQ, *self.scheduler.registry.resident()]}

    def cell_census(self) -> CellCensus | None:
        """llama.cpp's own count of occupied cells and sequence references (engine thread:
        ``await pool.call(pool.parts.cell_census)``)."""
        info = self.built.info
        head = self.built.ctx.seq_get_data(-1, header_bytes(info.n_ctx, info.n_seq_max))
        return parse_cell_census(head, info.n_ctx, info.n_seq_max)

    def close(self) -> None:
        """Free the native step, the batch, the context and the model (in that order)."""
        self.runner.close()
        for handle in (self.built.batch, self.built.ctx, self.built.model):
            handle.close()  # context before model


def assemble(built: Built, config: EngineConfig, lib: ctypes.CDLL | None,
             limits: StepLimits, snapshots: Snapshots, stats: StepStats) -> Parts:
    """Wire the parts; ``lib`` is the loaded native library or None (the Python step)."""
    scheduler = Scheduler(built, config, limits, snapshots, stats)
    stepper, nbatch = None, None
    if lib is not None:
        stepper = NativeStepper(lib, config.n_batch,
                                threads=config.n_threads or os.cpu_count() or 1)
        nbatch = NativeBatch(config.n_batch)
    runner = StepRunner(built, scheduler.ledger, scheduler.turns,
                        scheduler.registry.resident(), stepper, nbatch)
    return Parts(built, scheduler, runner, stats)

# -------------------- the thread ----------------------------------------------

class EngineThread:
    """Runs one pool's commands and steps on a thread of its own, the one thread that owns
    the llama.cpp context."""

    def __init__(self) -> None:
        self._commands = Commands()
        self._poster: Poster | None = None  # started with the thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.held = False  # no step while True (commands still run): see SharedKVPool.held

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, parts: Parts) -> None:
        self._poster = Poster()
        self._thread = threading.Thread(target=self._run, args=(parts,), name="mesh-engine",
                                        daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread, then deliver every item it posted (awaits both)."""
        self._stopping = True
        self.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._poster is not None:
            await asyncio.to_thread(self._poster.close)  # every posted item is delivered
            self._poster = None

    def wake(self) -> None:
        self._commands.wake()

    async def call(self, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
        """Run ``fn`` on the engine thread and await its result; ``undo`` runs there on a
        result whose caller was cancelled (:meth:`Commands.call`)."""
        if self._thread is None or self._stopping:
            raise SessionFailed("the pool is not running")
        return await self._commands.call(fn, undo)

    def _run(self, parts: Parts) -> None:
        sched = parts.scheduler
        while not self._stopping:
            try:
                self._commands.drain(block=not self._has_work(parts))
                sched.park_idle()
                if not self._stopping and self._has_work(parts):
                    parts.step()
            except Exception as exc:  # the engine thread must survive anything
                sched.release_turns(reason=f"engine error: {exc!r}")
            self._flush(parts)
        self._flush(parts)

    def _has_work(self, parts: Parts) -> bool:
        return not self.held and parts.scheduler.has_work()

    def _flush(self, parts: Parts) -> None:
        """Post the step's items after the snapshot is published, so a consumer that sees
        a turn end also sees the pool after it."""
        assert self._poster is not None, "the engine thread runs only while the poster does"
        self._poster.post_outbox(parts.scheduler.take_items())
