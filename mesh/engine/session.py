"""A session's state: its turn's output text, its per-session records and handles, and the
cell ledger that promises every KV cell it may use. Read top to bottom:

**Turn output.** Bytes of generated tokens in, released text out, stop strings exact; used
by the real pool and by :class:`~mesh.sim.fake.FakeEngine`, so both cut stop strings the
same way. Token bytes are decoded incrementally (a UTF-8 character split over tokens is
released once complete). Text that could start a stop string is held back, and released in
order once the following text shows it is not one. A stop string cuts the text at the
earliest match (the smallest start; of stops starting there, the shortest); no part of it
is released, :attr:`TurnOutput.matched` names it, and nothing is accepted after it.

**Sessions.** Per-session state and the async handles callers hold. Who may touch what:

| field                         | written by                   | read by                        |
|-------------------------------|------------------------------|--------------------------------|
| ``SeqState.pending``/``carry``| the ledger, under its lock   | the ledger / engine thread     |
|                               | (append; the thread's takes) |                                |
| ``SeqState.reserved``         | the ledger, under its lock   | the ledger, under its lock     |
| ``SeqState.private``, ``pos`` | engine thread only           | snapshots (published copies)   |
| ``Turn`` fields               | engine thread only           | -                              |

**The cell ledger.** Every KV cell promise and every free sequence id, behind one lock.
Callers (``append`` on any thread) and the engine thread both go through it, so a budget is
checked and committed in one critical section. ``SeqState.reserved`` counts every cell a
session holds or is promised (decoded suffix cells, queued ``pending`` tokens, the
sampled-but-undecoded ``carry``), and budgets are checked against it, so a step can never
need a cell that was not promised: llama.cpp never sees a batch it has no room for.
Parking goes through it too: :meth:`CellLedger.park` gives a session's decoded cells and
its sequence id back (its queued text stays promised), :meth:`CellLedger.unpark` takes an
id and promises the cells its saved suffix re-prefills. Attached sessions (resident or
parked) are bounded by ``max_attached``.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    AttachCheck,
    ContextOverflow,
    Piece,
    PoolFull,
    SessionFailed,
    SessionState,
    TurnResult,
)

if TYPE_CHECKING:
    from mesh.engine.sampling import TokenSampler

__all__ = ["CellLedger", "PooledSession", "SeqState", "Turn", "TurnOutput", "deliver", "duty_cycle"]


# -------------------- turn output ---------------------------------------------

class TurnOutput:
    """Incremental detokenizer with exact stop strings; see the module docstring."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        self.text = ""  # everything released so far
        self.matched: str | None = None
        self._held = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def held(self) -> str:
        """Text decoded but not yet released (a possible start of a stop string)."""
        return self._held

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text this releases (often ``""``)."""
        if self.matched is not None:
            return ""
        return self._take(self._decoder.decode(data))

    def feed_text(self, text: str) -> str:
        """Add already-decoded text (the fake engine's words)."""
        if self.matched is not None:
            return ""
        return self._take(text)

    def finish(self) -> str:
        """End of the turn: release whatever is held (unless a stop matched)."""
        if self.matched is not None:
            return ""
        out = self._take(self._decoder.decode(b"", final=True))
        if self.matched is None:
            out += self._held
            self.text += self._held
            self._held = ""
        return out

    def _take(self, new: str) -> str:
        held = self._held + new
        if not self.stops:
            self._held = ""
            self.text += held
            return held
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            at = held.find(s)
            if at >= 0 and (best is None or (at, len(s)) < best[:2]):
                best = (at, len(s), s)
        if best is not None:
            out = held[: best[0]]
            self.matched = best[2]
            self._held = ""
            self.text += out
            return out
        keep = self._prefix_tail(held)
        out = held[: len(held) - keep]
        self._held = held[len(held) - keep :]
        self.text += out
        return out

    def _prefix_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[len(text) - k :]):
                    longest = k
                    break
        return longest

# -------------------- sessions ------------------------------------------------

_EWMA_ALPHA = 0.2


@dataclass(eq=False)
class Turn:
    """One ``generate`` call in flight (engine-thread state)."""

    params: SamplingParams
    sampler: TokenSampler
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Piece | TurnResult | BaseException]
    num_prompt: int
    started: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None  # when it last started running (None: it waits)
    priority: float = 0.0  # completion order: lower runs first, is paused last
    waited_s: float = 0.0  # time spent waiting before its last admission (pauses included)
    num_pauses: int = 0  # times the decode gate paused it (shed) to keep the floor
    paused_at: float | None = None  # when it was last paused
    first_token_at: float | None = None
    num_generated: int = 0
    cancelled: bool = False
    output: TurnOutput = field(default_factory=TurnOutput)  # detokenizer + stop strings

    def post(self, item: Piece | TurnResult | BaseException) -> None:
        """Hand an item to the awaiting consumer (thread-safe; a closed loop drops it)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def duty_cycle(now: float, created: float, busy_s: float,
               busy_since: float | None) -> float | None:
    """Share of the time since ``created`` spent busy (None in the first half second)."""
    age = now - created
    if age <= 0.5:
        return None
    busy = busy_s + (now - busy_since if busy_since is not None else 0.0)
    return min(1.0, busy / age)


def deliver(items: list[tuple[Turn, Piece | TurnResult | BaseException]]) -> None:
    """On the consumers' loop: queue each item for its turn. The engine thread hands a
    step's items to each loop in one ``call_soon_threadsafe`` (one wake-up per loop per
    step, not one per token)."""
    for turn, item in items:
        turn.queue.put_nowait(item)


@dataclass(eq=False)
class SeqState:
    """Everything the pool knows about one attached session."""

    id: str
    seq: int
    prefix_len: int
    budget: int
    created: float = field(default_factory=time.monotonic)
    pending: deque[int] = field(default_factory=deque)
    carry: int | None = None  # sampled, not yet decoded (the next decode row)
    private: int = 0  # suffix cells decoded into this sequence
    reserved: int = 0  # private + len(pending) + (carry is not None)
    # Of ``reserved``, queued cells not yet taken from the pool (an idle session's text that
    # found the pool short; taken when its turn opens, see SessionRegistry.settle).
    owed: int = 0
    turn: Turn | None = None
    turns_started: int = 0
    num_generated: int = 0
    step_ewma_s: float | None = None  # EWMA of the steps this session decoded in
    busy_s: float = 0.0
    _busy_since: float | None = None
    failed: str | None = None
    detached: bool = False
    # The token ids decoded into its private cells, in order (``fill_batch`` writes them;
    # ``len(suffix) == private`` between steps while resident); a resume re-prefills them.
    suffix: list[int] = field(default_factory=list)
    parked: bool = False  # its private cells left the cache; ``seq`` is -1 meanwhile
    swapped: bytes | None = None  # parked by swap: its suffix cells' llama.cpp state
    idle_since: float = field(default_factory=time.monotonic)  # last busy -> idle edge

    def check_live(self) -> None:
        """Raise SessionFailed (its failure, or that it is detached) once it is detached."""
        if self.detached:
            raise SessionFailed(self.failed or f"session {self.id} is detached")

    @property
    def context_len(self) -> int:
        """Prefix + the private tokens it holds (parked ones included)."""
        return self.prefix_len + (len(self.suffix) if self.parked else self.private)

    @property
    def pos(self) -> int:
        """Position of the next token this sequence decodes."""
        return self.prefix_len + self.private

    @property
    def state(self) -> SessionState:
        if self.parked:  # a parked session's turn waits for its resume
            return SessionState.IDLE if self.turn is None else SessionState.WAITING
        if self.turn is None:
            return SessionState.IDLE  # queued text waits for the next turn
        if self.turn.admitted_at is None:
            return SessionState.WAITING  # the decode gate holds the turn
        if self.carry is not None and not self.pending:
            return SessionState.DECODING
        return SessionState.PREFILLING

    def mark_busy(self, now: float) -> None:
        """Account busy time for the duty cycle (called by the engine thread per step)."""
        busy = self.state not in (SessionState.IDLE, SessionState.WAITING)
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None
            self.idle_since = now

    def duty_cycle(self, now: float) -> float | None:
        return duty_cycle(now, self.created, self.busy_s, self._busy_since)

    def observe_decode(self, step_s: float) -> None:
        # Average the step *times*, not the rates: a worker's tokens/s is tokens over wall
        # time, and a mean of 1/step overstates it when fast and slow (prefill) steps mix.
        if self.step_ewma_s is None:
            self.step_ewma_s = step_s
        else:
            self.step_ewma_s += _EWMA_ALPHA * (step_s - self.step_ewma_s)

    @property
    def decode_tps(self) -> float | None:
        """Tokens/s while decoding (EWMA of step time, inverted); None until measured."""
        if self.step_ewma_s is None or self.step_ewma_s <= 0:
            return None
        return 1.0 / self.step_ewma_s


class PoolOps(Protocol):
    """What a session handle needs from its pool (so this module imports no pool)."""

    def tokenize(self, text: str) -> list[int]: ...

    def append_tokens(self, st: SeqState, tokens: list[int]) -> None: ...

    async def start_turn(self, st: SeqState, params: SamplingParams) -> Turn: ...

    async def detach(self, st: SeqState) -> None: ...

    async def park(self, session: PooledSession, *, rewrite: list[int] | None = None) -> bool: ...

    def wake(self) -> None: ...


class PoolGeneration:
    """Async iterator over a turn's pieces; see :class:`mesh.engine.interface.Generation`."""

    def __init__(self, session: PooledSession, params: SamplingParams) -> None:
        self._session = session
        self._params = params
        self._turn: Turn | None = None
        self._done = False
        self._iterated = False
        self.result: TurnResult | None = None

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._run()

    async def start(self) -> None:
        """Register the turn with the engine now (iteration does it otherwise). A caller
        cancelled meanwhile stops the turn as soon as it exists (not left running unowned)."""
        if self._turn is None:
            pool = self._session.pool
            pending = asyncio.ensure_future(pool.start_turn(self._session.state, self._params))
            try:
                self._turn = await asyncio.shield(pending)
            except asyncio.CancelledError:
                def stop(fut: asyncio.Future[Turn]) -> None:
                    if not fut.cancelled() and fut.exception() is None:
                        fut.result().cancelled = True
                        pool.wake()

                pending.add_done_callback(stop)
                raise

    async def _run(self) -> AsyncIterator[Piece]:
        if self._iterated:
            raise RuntimeError("a generation can be iterated once")
        self._iterated = True
        await self.start()
        turn = self._turn
        assert turn is not None
        try:
            while True:
                item = await turn.queue.get()
                if isinstance(item, Piece):
                    yield item
                elif isinstance(item, TurnResult):
                    self.result = item
                    return
                else:
                    raise item
        finally:
            self._done = True
            if self.result is None:
                # The consumer stopped early (break, cancellation): end the turn.
                turn.cancelled = True
                self._session.pool.wake()

    async def aclose(self) -> None:
        if self._turn is not None and not self._done:
            self._turn.cancelled = True
            self._session.pool.wake()


class PooledSession:
    """A caller's handle on one pooled session; see :class:`mesh.engine.interface.Session`."""

    def __init__(self, pool: PoolOps, state: SeqState) -> None:
        self.pool = pool
        self.state = state
        self.id = state.id

    @property
    def context_len(self) -> int:
        return self.state.context_len

    @property
    def seq_id(self) -> int:
        """The sequence id it holds now (-1 while parked; a resume may give another)."""
        return self.state.seq

    @property
    def parked(self) -> bool:
        """Whether its private cells are off the cache (restored before its next turn)."""
        return self.state.parked

    def append(self, text: str) -> None:
        # A fast refusal; append_tokens checks ``detached`` again under the pool lock, which
        # is what closes the race with a concurrent release.
        self.state.check_live()
        self.pool.append_tokens(self.state, self.pool.tokenize(text))

    def append_tokens(self, tokens: list[int]) -> None:
        self.state.check_live()
        self.pool.append_tokens(self.state, tokens)

    def generate(self, params: SamplingParams) -> PoolGeneration:
        params.validate()
        return PoolGeneration(self, params)

    async def compact(self, text: str) -> bool:
        """Replace everything after the shared prefix with ``text`` (see
        :meth:`mesh.engine.interface.Session.compact`)."""
        self.state.check_live()
        return await self.pool.park(self, rewrite=self.pool.tokenize(text))

    async def detach(self) -> None:
        await self.pool.detach(self.state)

# -------------------- the cell ledger -----------------------------------------

class CellLedger:
    """Reservations and free sequence ids of one pool (``n_ctx`` cells, ``shared`` held by
    the prefix sequence, sequence ids ``1..max_sessions`` for sessions)."""

    def __init__(self, *, n_ctx: int, shared: int, max_sessions: int, attach_need: int,
                 max_attached: int | None = None) -> None:
        self._lock = threading.Lock()
        self.n_ctx = n_ctx
        self.shared = shared
        self.max_sessions = max_sessions
        # Sessions attached at once, resident or parked (None: max_sessions, no parking).
        self.max_attached = max_sessions if max_attached is None else max_attached
        self.num_attached = 0
        self._attach_need = attach_need  # cells a new session needs at once
        self._free_seqs = list(range(max_sessions, 0, -1))  # pop() hands out 1 first
        self._reserved = 0

    # -- reads -------------------------------------------------------------------------

    def free_cells(self) -> int:
        with self._lock:
            return self._free_locked()

    def _free_locked(self) -> int:
        return self.n_ctx - self.shared - self._reserved

    @property
    def free_seq_ids(self) -> int:
        with self._lock:
            return len(self._free_seqs)

    @property
    def attach_need(self) -> int:
        return self._attach_need

    def check_attach(self, parkable: int = 0, parkable_cells: int = 0) -> AttachCheck:
        """Would an attach succeed now? ``parkable`` idle resident sessions holding
        ``parkable_cells`` private cells could be parked to make room."""
        with self._lock:
            return self._check_locked(parkable, parkable_cells)

    def _check_locked(self, parkable: int = 0, parkable_cells: int = 0) -> AttachCheck:
        if self.num_attached >= self.max_attached:
            if self.max_attached == self.max_sessions:
                return AttachCheck(False, f"all {self.max_sessions} session slots are in "
                                   "use; detach a session or raise --max-sessions")
            return AttachCheck(False, f"{self.num_attached} sessions are attached, "
                               f"max_attached is {self.max_attached}; detach a session or "
                               "raise --max-attached")
        if not self._free_seqs and parkable <= 0:
            return AttachCheck(False, f"all {self.max_sessions} session slots are in a turn "
                               "(none idle to park); wait for a turn to end or raise "
                               "--max-sessions")
        if self._free_locked() + parkable_cells < self._attach_need:
            return AttachCheck(False, f"the KV buffer ({self.n_ctx} cells) is full and no "
                               "idle session can be parked; raise --kv-cells")
        return AttachCheck(True)

    # -- commits -----------------------------------------------------------------------

    def take_seq(self) -> int:
        """Check, then hand out a free sequence id to a new session (counted attached);
        raises PoolFull with the reason."""
        with self._lock:
            check = self._check_locked()
            if not check.ok:
                raise PoolFull(check.reason)
            if not self._free_seqs:
                raise PoolFull(f"all {self.max_sessions} session slots are in use; "
                               "detach a session or raise --max-sessions")
            self.num_attached += 1
            return self._free_seqs.pop()

    def requeue_private(self, st: SeqState, saved: list[int]) -> None:
        """A swap-in failed after ``unpark(swapped=True)``: its cells are queued to
        re-prefill instead (still promised)."""
        with self._lock:
            st.private = 0
            st.pending.extendleft(reversed(saved))

    def park(self, st: SeqState) -> None:
        """The session's decoded cells left the cache: give them, its queued text's
        promises (promised again on resume) and its sequence id back. Engine thread; it
        holds no carry. A parked session's ``reserved`` counts its queued text alone."""
        with self._lock:
            if st.carry is not None:
                raise AssertionError(f"session {st.id} is parked with a carry token")
            self._reserved -= st.reserved - st.owed
            st.reserved -= st.private
            st.private = 0
            st.owed = 0
            self._free_seqs.append(st.seq)
            st.seq = -1
            st.parked = True

    def unpark(self, st: SeqState, saved: list[int], *, swapped: bool = False) -> int | None:
        """Take a free sequence id and promise cells for ``saved`` and the queued text:
        ``saved`` queued in front of it to re-prefill, or (``swapped``) held at once as its
        private cells, written back from host RAM. None: no id or no cells free."""
        with self._lock:
            st.check_live()
            need = len(saved) + len(st.pending)
            if not self._free_seqs or self._free_locked() < need:
                return None
            if swapped:
                st.private = len(saved)
            else:
                st.pending.extendleft(reversed(saved))
            st.reserved += len(saved)
            self._reserved += need
            st.seq = self._free_seqs.pop()
            st.parked = False
            return st.seq

    def rewrite_parked(self, st: SeqState, tokens: list[int]) -> None:
        """Compaction: a parked session's suffix becomes ``tokens``, queued in front of its
        queued text to be prefilled when it resumes (promised then, as :meth:`unpark`
        does); its old suffix is gone. Raises ContextOverflow past its budget."""
        with self._lock:
            if not st.parked or st.detached:
                raise AssertionError(f"session {st.id} is not parked")
            if st.reserved + len(tokens) > st.budget:
                raise ContextOverflow(
                    f"session {st.id}: a compacted suffix of {len(tokens)} tokens with "
                    f"{st.reserved} queued does not fit its budget of {st.budget}")
            st.pending.extendleft(reversed(tokens))
            st.reserved += len(tokens)

    def queue(self, st: SeqState, tokens: list[int]) -> None:
        """Promise cells for ``tokens`` and queue them; raises ContextOverflow if they do
        not fit the session's budget (or the pool, during a turn). An idle session's
        tokens that find the pool short are queued as ``owed``: the pool takes them when
        its turn opens (:meth:`mesh.engine.registry.SessionRegistry.settle`)."""
        n = len(tokens)
        with self._lock:
            st.check_live()  # under the lock: a release cannot slip in between
            held = st.reserved + (len(st.suffix) if st.parked else 0)  # parked: re-prefilled
            if held + n > st.budget:
                raise ContextOverflow(
                    f"session {st.id} holds {held} of its {st.budget} suffix tokens; "
                    f"appending {n} more would overflow it (raise --session-budget or start "
                    "a new session)"
                )
            if st.parked:  # promised when it resumes, with its suffix (see unpark)
                st.pending.extend(tokens)
                st.reserved += n
                return
            free = self._free_locked()
            if st.owed or n > free:
                if st.turn is not None or st.carry is not None:
                    raise ContextOverflow(
                        f"the KV pool has {free} free cells; appending {n} tokens to "
                        f"session {st.id} in a turn does not fit (raise --kv-cells, or "
                        "append between turns: the pool then parks idle sessions for it)")
                # Idle: queued now, taken from the pool when its turn opens (see owed).
                st.pending.extend(tokens)
                st.reserved += n
                st.owed += n
                return
            st.pending.extend(tokens)
            st.reserved += n
            self._reserved += n

    def settle(self, st: SeqState) -> bool:
        """Take the session's owed cells from the pool; False: not enough are free."""
        with self._lock:
            if st.owed > self._free_locked():
                return False
            self._reserved += st.owed
            st.owed = 0
            return True

    def pending(self, st: SeqState) -> int:
        with self._lock:
            return len(st.pending)

    def pending_in_turns(self, states: Iterable[SeqState]) -> list[tuple[SeqState, int]]:
        """(session, queued tokens) of every session in a turn, under one lock."""
        with self._lock:
            return [(st, 0 if st.owed else len(st.pending))
                    for st in states if st.turn is not None]

    def take(self, st: SeqState, n: int) -> list[int]:
        """Pop up to ``n`` queued tokens (oldest first) for the step being built."""
        with self._lock:
            return [st.pending.popleft() for _ in range(min(n, len(st.pending)))]

    def carry(self, st: SeqState, token: int) -> bool:
        """Promise one cell for a sampled token (the next decode row); False: no room."""
        with self._lock:
            if st.reserved + 1 > st.budget or self._free_locked() < 1:
                return False
            st.carry = token
            st.reserved += 1
            self._reserved += 1
            return True

    def requeue_carry(self, st: SeqState) -> None:
        """An undecoded carry goes back to the front of the queue (still promised)."""
        with self._lock:
            if st.carry is not None:
                st.pending.appendleft(st.carry)
                st.carry = None

    def release(self, st: SeqState, reason: str | None = None) -> None:
        """Drop every promise of the session, free its sequence id and mark it detached
        (under the lock, where ``queue`` checks it)."""
        with self._lock:
            st.failed = reason
            st.detached = True
            if not st.parked:  # a parked session's promises went back when it was parked
                self._reserved -= st.reserved - st.owed
            st.reserved = 0
            st.owed = 0
            st.pending.clear()
            st.carry = None
            st.private = 0
            self.num_attached -= 1
            if not st.parked:  # a parked session's id went back when it was parked
                self._free_seqs.append(st.seq)
