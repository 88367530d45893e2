"""Per-session state and the async handles callers hold.

Ownership table (who may touch what):

| field                         | written by                   | read by                        |
|-------------------------------|------------------------------|--------------------------------|
| ``SeqState.pending``/``carry``| the ledger, under its lock   | the ledger / engine thread     |
|                               | (append; the thread's takes) |                                |
| ``SeqState.reserved``         | the ledger, under its lock   | the ledger, under its lock     |
| ``SeqState.private``, ``pos`` | engine thread only           | snapshots (published copies)   |
| ``Turn`` fields               | engine thread only           | -                              |

``reserved`` counts every cell the session holds or is promised: decoded suffix cells
(``private``), queued tokens (``pending``) and the sampled-but-not-yet-decoded ``carry``.
It is what budgets are checked against, so a step can never need a cell that was not
promised: llama.cpp never sees a batch it has no room for. See
:class:`mesh.engine.ledger.CellLedger`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mesh.engine.output import TurnOutput
from mesh.engine.types import (
    Piece,
    SamplingParams,
    SessionFailed,
    SessionState,
    TurnResult,
)

if TYPE_CHECKING:
    from mesh.engine.sampling import TokenSampler

__all__ = ["PooledSession", "SeqState", "Turn", "deliver", "duty_cycle"]

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
    turn: Turn | None = None
    turns_started: int = 0
    num_generated: int = 0
    step_ewma_s: float | None = None  # EWMA of the steps this session decoded in
    busy_s: float = 0.0
    _busy_since: float | None = None
    failed: str | None = None
    detached: bool = False
    # The token ids decoded into this sequence's private cells, in order (written by
    # ``batching.fill_batch`` as they go into a batch; ``len(suffix) == private`` between
    # steps while resident). A parked session keeps them here to re-prefill on resume.
    suffix: list[int] = field(default_factory=list)
    parked: bool = False  # its private cells left the cache; ``seq`` is -1 meanwhile
    swapped: bytes | None = None  # parked by swap: its suffix cells' llama.cpp state
    idle_since: float = field(default_factory=time.monotonic)  # last busy -> idle edge

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
    """What a session handle needs from its pool (the pool implements it; no import of
    :mod:`mesh.engine.pool` here, so the two modules form no cycle)."""

    def tokenize(self, text: str) -> list[int]: ...

    def append_tokens(self, st: SeqState, tokens: list[int]) -> None: ...

    async def start_turn(self, st: SeqState, params: SamplingParams) -> Turn: ...

    async def detach(self, st: SeqState) -> None: ...

    def wake(self) -> None: ...


class PoolGeneration:
    """Async iterator over a turn's pieces; see :class:`mesh.engine.types.Generation`."""

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
        """Register the turn with the engine now (iteration does it otherwise).

        If the caller is cancelled while the engine registers the turn, the turn is
        stopped as soon as it exists (it would otherwise run to ``max_tokens`` unowned)."""
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
    """A caller's handle on one pooled session; see :class:`mesh.engine.types.Session`."""

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
        if self.state.detached:
            raise SessionFailed(self.state.failed or f"session {self.id} is detached")
        self.pool.append_tokens(self.state, self.pool.tokenize(text))

    def append_tokens(self, tokens: list[int]) -> None:
        if self.state.detached:
            raise SessionFailed(self.state.failed or f"session {self.id} is detached")
        self.pool.append_tokens(self.state, tokens)

    def generate(self, params: SamplingParams) -> PoolGeneration:
        params.validate()
        return PoolGeneration(self, params)

    async def detach(self) -> None:
        await self.pool.detach(self.state)
