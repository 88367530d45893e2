"""The shared KV pool: one model, one context, one immutable prefix, many sessions.

Sequence 0 holds the prefix. ``attach`` copies it to a free sequence id with
``llama_memory_seq_cp``, which with a unified KV cache only adds the new id to the prefix
cells' metadata: every session reads the same prefix cells and owns only its suffix.

One engine thread owns the llama.cpp context; callers talk to it through a command queue.
Each step reads as plan → decode → sample → publish: the pure planner
(:mod:`mesh.engine.planner`) picks one decode row per decoding session and chunks of queued
prefill under the step budget; the step runner (:mod:`mesh.engine.step`) runs one
``llama_decode`` and samples every session that asked for logits right away (the next
decode overwrites them), its text going through its turn output (:mod:`mesh.engine.output`:
stop strings); the snapshot is published (:mod:`mesh.engine.snapshots`), then the pieces
are posted to each consumer's asyncio loop (:mod:`mesh.engine.poster`). Cell promises and
free sequence ids live in the :class:`~mesh.engine.ledger.CellLedger`; sessions are
attached and released by the :class:`~mesh.engine.registry.SessionRegistry`; start-up
wires these parts (:mod:`mesh.engine.parts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from mesh.engine import batching
from mesh.engine.build import Progress, Tokenizer, build, open_tokenizer
from mesh.engine.census import CellCensus
from mesh.engine.commands import Commands
from mesh.engine.ledger import CellLedger
from mesh.engine.llama import LlamaContext
from mesh.engine.native import NativeStepper, resolve
from mesh.engine.parts import Parts, assemble
from mesh.engine.poster import Poster
from mesh.engine.session import PooledSession, SeqState, Turn
from mesh.engine.snapshots import SNAPSHOT_INTERVAL_S, Snapshots
from mesh.engine.stats import StepStats
from mesh.engine.step import DecodeFailed
from mesh.engine.turns import Outbox
from mesh.engine.types import (
    AttachCheck,
    EngineConfig,
    PoolInfo,
    PoolLoad,
    PrefillBudget,
    SamplingParams,
    SessionFailed,
    TurnAdmission,
)

__all__ = ["MAX_SEQUENCES", "SNAPSHOT_INTERVAL_S", "SharedKVPool", "Tokenizer",
           "open_tokenizer"]

T = TypeVar("T")
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: the prefix sequence counts toward it


class SharedKVPool:
    """The real engine. Build with ``SharedKVPool(config, prefix)``, then ``await start()``.

    ``prefix`` is text (tokenized with BOS) or a list of token ids. It is decoded once, or
    restored from the warm-start cache, and never changes: a different prefix is a
    different pool.
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
        self._commands = Commands()
        self._poster: Poster | None = None  # started with the engine thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._held = False
        self._outbox: Outbox = []
        self._sessions: dict[int, SeqState] = {}
        self._prefill_budget: PrefillBudget | None = None
        self._turn_admission: TurnAdmission | None = None
        self._park_checked = 0.0
        self.stats = StepStats()
        self._snapshots = Snapshots(self.stats)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, progress: Progress | None = None) -> PoolInfo:
        """Load the model, build or restore the prefix, start the engine thread."""
        lib = resolve(self.config.native)  # --native on without the library: fail first
        built = await asyncio.to_thread(build, self.config, self._prefix_input, progress)
        self._info = built.info
        self._parts = assemble(built, self.config, lib, self._sessions, self._outbox)
        self._publish()
        self._poster = Poster()
        self._thread = threading.Thread(target=self._run, name="mesh-engine", daemon=True)
        self._thread.start()
        return built.info

    async def aclose(self) -> None:
        """Stop the engine thread, fail turns in flight, free native handles."""
        self._stopping = True
        self.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._poster is not None:
            await asyncio.to_thread(self._poster.close)  # every posted item is delivered
            self._poster = None
        if self._parts is not None:
            self._parts.registry.fail_all("the pool was closed")
            self._parts.close()
            self._parts = None

    @property
    def info(self) -> PoolInfo:
        if self._info is None:
            raise RuntimeError("the pool is not started; await pool.start() first")
        return self._info

    @property
    def is_started(self) -> bool:
        return self._info is not None

    @property
    def uses_native(self) -> bool:
        """Whether steps run through the native step (native/) rather than Python."""
        return self._stepper is not None

    def _p(self) -> Parts:
        assert self._parts is not None, "pool not started"
        return self._parts

    @property
    def _ctx(self) -> LlamaContext | None:  # tests and benches reach for these four
        return self._parts.built.ctx if self._parts else None

    @property
    def _prefix(self) -> list[int]:
        return self._parts.built.prefix if self._parts else []

    @property
    def _ledger(self) -> CellLedger | None:
        return self._parts.ledger if self._parts else None

    @property
    def _stepper(self) -> NativeStepper | None:
        return self._parts.runner.stepper if self._parts else None

    num_steps = property(lambda self: self.stats.num_steps)
    host_s = property(lambda self: self.stats.host_s)
    decode_s = property(lambda self: self.stats.decode_s)

    def set_prefill_budget(self, budget: PrefillBudget | None) -> None:
        """Cap the prefill tokens of a step while sessions decode (None: the whole
        ``n_batch``, today's behaviour). Read by the engine thread once per step."""
        self._prefill_budget = budget

    def set_turn_admission(self, gate: TurnAdmission | None) -> None:
        """The decode gate (None: every turn runs as soon as it is asked for). Read by
        the engine thread once per step while a turn waits."""
        self._turn_admission = gate

    # ------------------------------------------------------------------ commands

    def wake(self) -> None:
        self._commands.wake()

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and await its result."""
        if self._thread is None or self._stopping:
            raise SessionFailed("the pool is not running")
        return await self._commands.call(fn)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Run no step inside this block (commands still run): turns started inside it
        begin in the same step, which makes a multi-session schedule reproducible."""

        def hold(value: bool) -> None:
            self._held = value

        await self._call(lambda: hold(True))
        try:
            yield
        finally:
            await self._call(lambda: hold(False))

    def tokenize(self, text: str) -> list[int]:
        return self._p().built.model.tokenize(text, add_bos=False)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def check_attach(self) -> AttachCheck:
        if self._parts is None:
            return AttachCheck(False, "the pool is not started")
        # Any thread: tuple() copies the dict's values under the GIL; the idle sessions
        # in it could be parked to make room (the attach itself checks again).
        idle = [st for st in tuple(self._sessions.values()) if st.turn is None]
        return self._parts.ledger.check_attach(len(idle), sum(st.reserved for st in idle))

    async def attach(self) -> PooledSession:
        def do() -> PooledSession:
            st = self._p().registry.attach()
            self._publish()
            return PooledSession(self, st)

        return await self._call(do)

    def append_tokens(self, st: SeqState, tokens: list[int]) -> None:
        """Queue tokens for prefill; the ledger checks the budgets first (check, then commit)."""
        self._p().ledger.queue(st, tokens)
        self.wake()

    async def start_turn(self, st: SeqState, params: SamplingParams) -> Turn:
        loop = asyncio.get_running_loop()

        def do() -> Turn:
            p = self._p()
            turn = p.turns.open(st, params, loop)
            if self._turn_admission is None:  # no decode gate: the turn runs at once
                turn.admitted_at = turn.started
            if st.parked:  # resumed before the turn's text; else it waits for room
                p.registry.resume_waiting()
                self._publish()
            return turn

        return await self._call(do)

    async def park(self, session: PooledSession) -> bool:
        """Park an idle session now (its cells leave the cache; it stays attached and is
        re-prefilled before its next turn). False: it is in a turn or already parked."""
        def do() -> bool:
            done = self._p().registry.park(session.state)
            self._publish()
            return done

        return await self._call(do)

    async def detach(self, st: SeqState) -> None:
        if st.detached:
            return

        def do() -> None:
            self._p().registry.release(st, reason=None)
            self._publish()

        with contextlib.suppress(SessionFailed):
            await self._call(do)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._commands.drain(block=not self._has_work())
                self._park_idle()
                if not self._stopping and self._has_work():
                    self._step()
            except Exception as exc:  # the engine thread must survive anything
                self._p().registry.release_turns(reason=f"engine error: {exc!r}")
                self._publish()
            self._flush()
        self._flush()

    def _flush(self) -> None:
        """Post queued items after the snapshot is published, so a consumer that sees a
        turn end also sees the pool after it."""
        assert self._poster is not None, "the engine thread runs only while the poster does"
        self._poster.post_outbox(self._outbox)

    def _has_work(self) -> bool:
        return not self._held and (any(st.turn is not None for st in self._sessions.values())
                                   or self._p().registry.has_waiting())

    def _park_idle(self) -> None:
        """With ``park_idle_s`` set: park sessions idle that long (checked at most once a
        second; the engine thread wakes at least every 0.25 s)."""
        idle_s = self.config.park_idle_s
        now = time.monotonic()
        if idle_s is None or self._parts is None or now - self._park_checked < 1.0:
            return
        self._park_checked = now
        if self._parts.registry.park_idle(now, idle_s):
            self._publish()

    def _step(self) -> None:
        """Plan → decode → sample → publish (``_run`` posts the pieces after)."""
        p = self._p()
        t0 = time.monotonic()
        p.turns.finish_cancelled(p.registry.all_states())  # cancelled turns take no room
        if p.registry.has_waiting():  # parked sessions whose turn was asked for
            p.registry.resume_waiting()
        cells = p.registry.cells_used()
        plan = batching.plan(self._sessions.values(), p.ledger, n_batch=self.config.n_batch,
                             output_rows=p.built.ctx.n_outputs_max, cells_used=cells,
                             prefill_budget=self._prefill_budget,
                             turn_admission=self._turn_admission, recent=self.stats.recent)
        if plan.started:
            p.turns.admit(self._sessions[seq] for seq in plan.started)
        if plan.empty:
            self._publish()  # cancellations above changed states
            if p.registry.has_waiting():  # a parked turn waits for room: do not spin
                time.sleep(0.005)
            return
        done = p.runner.decode(plan, step_started=t0, cells_used=cells)
        if isinstance(done, DecodeFailed):
            for seq in done.seqs:
                p.registry.release(self._sessions[seq], reason=done.reason)
            self._publish()
            return
        p.runner.sample(plan, done)
        now = p.runner.record(plan, done, self.stats)
        if self._snapshots.due(p.turns.changes, now):
            self._publish()

    # ------------------------------------------------------------------ snapshots

    def _publish(self) -> None:
        """Rebuild the load snapshot (every command that changes the pool does; a step
        does when a turn started or ended, else at most every SNAPSHOT_INTERVAL_S)."""
        p = self._p()
        self._snapshots.publish(p.registry, p.built, p.ledger, self.config, p.turns.changes)

    def load(self) -> PoolLoad:
        return self._snapshots.load()

    async def seq_pos_ranges(self) -> dict[int, tuple[int, int]]:
        """llama.cpp's own (min, max) position per live sequence, for cross-checks."""
        return await self._call(lambda: self._p().seq_pos_ranges([*self._sessions]))

    async def cell_census(self) -> CellCensus | None:
        """llama.cpp's own count of occupied cells and sequence references."""
        info = self.info  # never started: RuntimeError here, before the engine thread
        return await self._call(lambda: self._p().cell_census(info))

    def native(self) -> Any:
        """The LlamaContext (for benchmarks that need raw access on the engine thread)."""
        return self._ctx
