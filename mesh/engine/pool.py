"""The shared KV pool: one model, one context, one immutable prefix, many sessions.

Sequence 0 holds the prefix. ``attach`` copies it to a free sequence id with
``llama_memory_seq_cp``, which with a unified KV cache only adds the new id to the prefix
cells' metadata: every session reads the same prefix cells and owns only its suffix.

One engine thread owns the llama.cpp context; callers talk to it through a command queue.
Each step reads as plan → decode → sample → publish: the pure planner
(:mod:`mesh.engine.planner`) picks one decode row per decoding session and chunks of queued
prefill under the step budget; one ``llama_decode`` runs; every session that asked for
logits is sampled right away (the next decode overwrites them), its text goes through its
turn output (:mod:`mesh.engine.output`: stop strings); the snapshot is published, then the
pieces are posted to each consumer's asyncio loop. Cell promises and free sequence ids live
in the :class:`~mesh.engine.ledger.CellLedger`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from mesh.engine.batching import candidates, fill_batch
from mesh.engine.build import PREFIX_SEQ, Built, Progress, Tokenizer, build, open_tokenizer
from mesh.engine.census import CellCensus, header_bytes, parse_cell_census
from mesh.engine.commands import Commands
from mesh.engine.ledger import CellLedger
from mesh.engine.llama import LlamaContext
from mesh.engine.native import NativeBatch, NativeStepper, resolve
from mesh.engine.planner import StepPlan, plan_step, step_budget
from mesh.engine.poster import Poster
from mesh.engine.session import PooledSession, SeqState, Turn
from mesh.engine.stats import Capture, StepStats
from mesh.engine.turns import Outbox, Turns
from mesh.engine.types import (
    AttachCheck,
    ContextOverflow,
    EngineConfig,
    PoolFull,
    PoolInfo,
    PoolLoad,
    PrefillBudget,
    SamplingParams,
    SessionFailed,
    StepSample,
)

__all__ = ["MAX_SEQUENCES", "SharedKVPool", "Tokenizer", "open_tokenizer"]

T = TypeVar("T")
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: the prefix sequence counts toward it
# Between turn starts and ends, the load snapshot is rebuilt at most this often (building
# it touches every session; a step at N = 255 can take a few milliseconds).
SNAPSHOT_INTERVAL_S = 0.05


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
        self._built: Built | None = None
        self._info: PoolInfo | None = None  # kept after aclose()
        self._ledger: CellLedger | None = None
        self._commands = Commands()
        self._poster: Poster | None = None  # started with the engine thread
        self._turns: Turns | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._held = False
        self._outbox: Outbox = []
        self._sessions: dict[int, SeqState] = {}
        self._next_id = 0
        self._snapshot: Capture | None = None
        self._busy_changes = -1
        self._published_at = 0.0
        self._published_changes = -1
        self._stepper: NativeStepper | None = None
        self._native_batch: NativeBatch | None = None
        self._prefill_budget: PrefillBudget | None = None
        self.stats = StepStats()

    # ------------------------------------------------------------------ lifecycle

    async def start(self, progress: Progress | None = None) -> PoolInfo:
        """Load the model, build or restore the prefix, start the engine thread."""
        lib = resolve(self.config.native)  # --native on without the library: fail first
        built = await asyncio.to_thread(build, self.config, self._prefix_input, progress)
        self._built, self._info = built, built.info
        self._ledger = CellLedger(
            n_ctx=built.info.n_ctx, shared=built.shared_cells,
            max_sessions=self.config.max_sessions,
            attach_need=1 if self.config.share_prefix else len(built.prefix) + 1,
        )
        self._turns = Turns(built.model, self._ledger, self._outbox, self.config.seed)
        if lib is not None:
            self._stepper = NativeStepper(lib, self.config.n_batch,
                                          threads=self.config.n_threads or os.cpu_count() or 1)
            self._native_batch = NativeBatch(self.config.n_batch)
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
        for st in list(self._sessions.values()):
            if st.turn is not None:
                st.turn.post(SessionFailed("the pool was closed"))  # thread has stopped
                st.turn.sampler.close()
            st.detached, st.failed = True, "the pool was closed"
        self._sessions.clear()
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None
        if self._built is not None:
            for handle in (self._built.batch, self._built.ctx, self._built.model):
                handle.close()  # context before model
            self._built = None

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

    @property
    def _ctx(self) -> LlamaContext | None:  # tests and benches reach for it
        return self._built.ctx if self._built else None

    @property
    def _prefix(self) -> list[int]:
        return self._built.prefix if self._built else []

    num_steps = property(lambda self: self.stats.num_steps)
    host_s = property(lambda self: self.stats.host_s)
    decode_s = property(lambda self: self.stats.decode_s)

    def set_prefill_budget(self, budget: PrefillBudget | None) -> None:
        """Cap the prefill tokens of a step while sessions decode (None: the whole
        ``n_batch``, today's behaviour). Read by the engine thread once per step."""
        self._prefill_budget = budget

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
        assert self._built is not None, "pool not started"
        return self._built.model.tokenize(text, add_bos=False)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def check_attach(self) -> AttachCheck:
        if self._ledger is None:
            return AttachCheck(False, "the pool is not started")
        return self._ledger.check_attach()

    async def attach(self) -> PooledSession:
        def do() -> PooledSession:
            assert self._built is not None and self._ledger is not None
            seq = self._ledger.take_seq()
            self._next_id += 1
            sid, cfg, prefix = f"s{self._next_id}", self.config, self._built.prefix
            if cfg.share_prefix:
                self._built.ctx.seq_copy(PREFIX_SEQ, seq)  # metadata only: shares the cells
                st = SeqState(id=sid, seq=seq, prefix_len=len(prefix), budget=cfg.session_budget)
            else:  # naive baseline: the session prefills a private copy of the prefix
                st = SeqState(id=sid, seq=seq, prefix_len=0,
                              budget=cfg.session_budget + len(prefix))
            self._sessions[seq] = st
            if not cfg.share_prefix:
                try:
                    self.append_tokens(st, list(prefix))
                except ContextOverflow as exc:
                    self._release(st, reason=str(exc))
                    raise PoolFull(str(exc)) from exc
            self._publish()
            return PooledSession(self, st)

        return await self._call(do)

    def append_tokens(self, st: SeqState, tokens: list[int]) -> None:
        """Queue tokens for prefill; the ledger checks the budgets first (check, then commit)."""
        assert self._ledger is not None, "pool not started"
        self._ledger.queue(st, tokens)
        self.wake()

    async def start_turn(self, st: SeqState, params: SamplingParams) -> Turn:
        loop = asyncio.get_running_loop()

        def do() -> Turn:
            assert self._turns is not None
            return self._turns.open(st, params, loop)

        return await self._call(do)

    async def detach(self, st: SeqState) -> None:
        if st.detached:
            return

        def do() -> None:
            self._release(st, reason=None)
            self._publish()

        with contextlib.suppress(SessionFailed):
            await self._call(do)

    def _release(self, st: SeqState, reason: str | None) -> None:
        """Engine thread: drop the session's private cells and its sequence id."""
        if st.detached:
            return
        assert self._built is not None and self._ledger is not None
        self._built.ctx.seq_remove(st.seq)  # shared prefix cells stay: sequence 0 holds them
        if st.turn is not None:
            self._outbox.append((st.turn, SessionFailed(reason or f"session {st.id} was "
                                                        "detached")))
            st.turn.sampler.close()
            st.turn = None
        self._ledger.release(st, reason)
        self._sessions.pop(st.seq, None)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._commands.drain(block=not self._has_work())
                if not self._stopping and self._has_work():
                    self._step()
            except Exception as exc:  # the engine thread must survive anything
                for st in list(self._sessions.values()):
                    if st.turn is not None:
                        self._release(st, reason=f"engine error: {exc!r}")
                self._publish()
            self._flush()
        self._flush()

    def _flush(self) -> None:
        """Post queued items after the snapshot is published, so a consumer that sees a
        turn end also sees the pool after it."""
        if not self._outbox:
            return
        out = self._outbox[:]
        self._outbox.clear()  # the same list: Turns appends to it
        by_loop: dict[asyncio.AbstractEventLoop, Outbox] = {}
        for turn, item in out:
            by_loop.setdefault(turn.loop, []).append((turn, item))
        assert self._poster is not None, "the engine thread runs only while the poster does"
        self._poster.post(by_loop)

    def _has_work(self) -> bool:
        return not self._held and any(st.turn is not None for st in self._sessions.values())

    def _plan(self) -> StepPlan:
        assert self._built is not None and self._ledger is not None
        cands = candidates(self._sessions.values(), self._ledger)
        budget = step_budget(n_batch=self.config.n_batch,
                             output_rows=self._built.ctx.n_outputs_max,
                             num_decode=sum(c.decoding for c in cands),
                             cells_used=self._cells_used(), prefill_budget=self._prefill_budget)
        return plan_step(cands, budget)

    def _cells_used(self) -> int:
        assert self._built is not None
        return self._built.shared_cells + sum(st.private for st in self._sessions.values())

    def _step(self) -> None:
        assert self._built is not None and self._ledger is not None and self._turns is not None
        t0 = time.monotonic()
        for st in list(self._sessions.values()):  # cancelled turns take no room
            if st.turn is not None and st.turn.cancelled:
                self._turns.finish(st, "cancelled")
        plan = self._plan()
        if plan.empty:
            self._publish()  # cancellations above changed states
            return
        ctx = self._built.ctx
        stepper, nbatch = self._stepper, self._native_batch
        batch = nbatch if nbatch is not None else self._built.batch
        rows, counts = fill_batch(plan, self._sessions, self._ledger, batch)
        sum_ctx = sum(self._sessions[s].pos + 1 for s in plan.decode)
        cells_used = self._cells_used()
        sampled: list[int] | None = None
        if stepper is not None and nbatch is not None:
            samplers = [st.turn.sampler.handle if st.turn is not None else None
                        for st, _ in rows]
            t1 = time.monotonic()
            rc, sampled, decode_s = stepper.step(ctx, nbatch, [i for _, i in rows], samplers)
            t2 = t1 + decode_s
        else:
            t1 = time.monotonic()
            rc = ctx.decode(self._built.batch)
            t2 = time.monotonic()
        if rc != 0:
            reason = (f"llama_decode returned {rc} (no KV slot for the batch)" if rc == 1
                      else f"llama_decode failed with status {rc}")
            for seq in counts:
                self._release(self._sessions[seq], reason=reason)
            self._publish()
            return
        decoded = set(plan.decode)
        for seq, n in counts.items():
            st = self._sessions[seq]
            st.private += n
            if seq in decoded:
                st.carry = None  # the carried token is now in the cache
        for i, (st, idx) in enumerate(rows):
            if i < len(plan.decode):
                st.observe_decode(t2 - t0)
            if sampled is not None:
                turn = st.turn  # the native step drew from the chain; a grammar checks it
                tok = turn.sampler.constrain(ctx, idx, sampled[i]) if turn else sampled[i]
                self._turns.accept(st, tok)
            else:
                self._turns.sample(st, ctx, idx)
        now = time.monotonic()
        if self._turns.changes != self._busy_changes:  # busy <-> idle only at turn edges
            self._busy_changes = self._turns.changes
            for st in self._sessions.values():
                st.mark_busy(now)
        self.stats.record(StepSample(num_decode=len(plan.decode),
                                     num_prefill_tokens=plan.num_prefill, sum_context=sum_ctx,
                                     step_s=now - t0, cells_used=cells_used),
                          decode_s=t2 - t1, now=now)
        if (self._turns.changes != self._published_changes
                or now - self._published_at >= SNAPSHOT_INTERVAL_S):
            self._publish()

    # ------------------------------------------------------------------ snapshots

    def _publish(self) -> None:
        """Rebuild the load snapshot (every command that changes the pool does; a step
        does when a turn started or ended, else at most every SNAPSHOT_INTERVAL_S)."""
        assert self._built is not None and self._ledger is not None
        self._published_at = time.monotonic()
        if self._turns is not None:
            self._published_changes = self._turns.changes
        self._snapshot = self.stats.snapshot(
            self._sessions.values(), prefix_cells=self._built.shared_cells,
            prefix_len=len(self._built.prefix), n_ctx=self._built.info.n_ctx,
            free_seq_ids=self._ledger.free_seq_ids, max_sessions=self.config.max_sessions,
            session_budget=self.config.session_budget, sessions_attached=self._next_id)

    def load(self) -> PoolLoad:
        if self._snapshot is None:
            raise RuntimeError("the pool is not started")
        return self._snapshot.load()

    async def seq_pos_ranges(self) -> dict[int, tuple[int, int]]:
        """llama.cpp's own (min, max) position per live sequence, for cross-checks."""

        def do() -> dict[int, tuple[int, int]]:
            assert self._built is not None
            return {s: self._built.ctx.seq_pos_range(s) for s in [PREFIX_SEQ, *self._sessions]}

        return await self._call(do)

    async def cell_census(self) -> CellCensus | None:
        """llama.cpp's own count of occupied cells and sequence references."""
        info = self.info

        def do() -> CellCensus | None:
            assert self._built is not None
            head = self._built.ctx.state_head(-1, header_bytes(info.n_ctx, info.n_seq_max))
            return parse_cell_census(head, info.n_ctx, info.n_seq_max)

        return await self._call(do)

    def native(self) -> Any:
        """The LlamaContext (for benchmarks that need raw access on the engine thread)."""
        return self._ctx
