"""What the engine offers the layers above it: its errors (all :class:`EngineError`), the
records it hands back (a turn's pieces and result, an attach answer, the pool's facts, the
load snapshot the gate and ``/capacity`` read), and the seams every engine implements, the
local pool, the OpenAI backend and the fake alike. Nothing here touches llama.cpp, so the
gate, the worker and the HTTP layers import these names without loading a model.

The seam is two protocols, :class:`Engine` and :class:`Session`:

* ``Engine.check_attach()`` answers whether a session can be attached *now* without
  mutating anything; ``Engine.attach()`` commits (check, then commit).
* ``Session.append(text)`` queues suffix text for prefill; it never blocks on the model.
* ``Session.generate(params)`` prefills whatever was appended, then streams the generated
  pieces. The returned :class:`Generation` is an async iterator of :class:`Piece`; when it
  is exhausted, ``Generation.result`` holds the :class:`TurnResult`. Generated tokens stay
  in the session's context, so the next ``append`` continues the conversation.
* ``Session.detach()`` frees the session's private KV cells; the shared prefix stays.
  Detaching twice is a no-op. A session whose decode failed is detached by the engine and
  its generation raises :class:`SessionFailed`.
* ``Engine.set_prefill_budget`` / ``Engine.set_turn_admission`` take the gate's two budgets
  (:class:`PrefillBudget`, :class:`TurnAdmission`). The local pool asks them on its engine
  thread each step; an engine that runs turns on the event loop (a remote backend, the
  fake) holds its turns in a :class:`TurnLine`, and a backend that schedules its own
  prefill ignores the prefill budget.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import enum
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from mesh.engine.config import SamplingParams

__all__ = [
    "AttachCheck", "ContextOverflow", "Engine", "EngineError", "Generation", "ModelError", "Piece",
    "PoolFull", "PoolInfo", "PoolLoad", "PrefillBudget", "Session", "SessionFailed", "SessionLoad",
    "SessionState", "StepSample", "TurnAdmission", "TurnLine", "TurnResult"
]


# -------------------- errors --------------------------------------------------

class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelError(EngineError):
    """The model file is missing, unreadable or not a GGUF llama.cpp can load."""


class PoolFull(EngineError):
    """No sequence id or not enough free KV cells for another session."""


class ContextOverflow(EngineError):
    """A session would grow past its context budget."""


class SessionFailed(EngineError):
    """The session cannot go on (a decode failed, it was detached, or the pool closed)."""

# -------------------- records -------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """One generated token and the text it released.

    ``text`` may be empty (mid-UTF-8 character, or held back as a possible start of a stop
    string). Held text released when a turn ends without a token of its own (``eos``,
    ``context_full``, ``cancelled``) comes as a last piece with ``token == -1``. The pieces'
    texts always join to ``TurnResult.text``. A turn the decode gate paused (shed, to keep
    the floor) gets, when it runs again, a piece with ``token == -1``, no text and
    ``paused_s``: how long it waited, so a client can tell a pause from slow decoding.
    """

    token: int
    text: str
    paused_s: float = 0.0


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended.

    ``finish_reason`` is one of ``stop`` (a stop string matched: ``stop`` names it, and no
    part of it is in ``text``), ``eos`` (the model ended its turn), ``length``
    (``max_tokens`` reached), ``context_full`` (the session's budget or the KV buffer has no
    room for another token) or ``cancelled`` (the consumer stopped early). Only ``stop`` and
    ``eos`` are turns the model finished; the others were cut.
    """

    text: str
    num_prompt_tokens: int
    num_generated: int
    finish_reason: str
    decode_s: float
    stop: str | None = None
    # Seconds the turn waited for the decode gate before its first step (turn-start
    # latency; 0.0 where no gate runs or the turn was admitted at once).
    wait_s: float = 0.0


@dataclass(frozen=True)
class AttachCheck:
    """Answer of :meth:`Engine.check_attach`: ``ok`` or the reason it would be refused."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class PoolInfo:
    """Facts learned when the pool was built; immutable for the pool's life."""

    model_path: str
    model_name: str
    n_ctx: int
    n_seq_max: int
    max_sessions: int
    session_budget: int
    n_vocab: int
    prefix_tokens: int
    prefix_hash: str  # sha256 of the prefix token ids
    warm_started: bool
    build_s: float
    engine: str = "llama.cpp"  # or "openai:URL" (mesh.backends.openai)
    n_params: int = 0  # the model's parameter count; 0 where the engine cannot tell
    # The attention path a llama.cpp pool resolved ("" elsewhere): flash attention handed
    # to llama.cpp (on | off | auto: llama.cpp's choice), shared-prefix attention (shared | off).
    flash_attn: str = ""
    prefix_attention: str = ""
    weights: str = ""  # what was loaded, in words (models.cpu_weights): "q8_0 from Q4_1"
    cell_bytes: float = 0.0  # K and V of every layer at the cache's type; 0: unknown


# --------------------------------------------------------------------------- load


class SessionState(enum.StrEnum):
    PREFILLING = "prefilling"  # has appended text not yet decoded
    DECODING = "decoding"  # generating tokens
    IDLE = "idle"  # waiting for input (a tool call, the next turn)
    WAITING = "waiting"  # a turn was asked for; the decode gate has not let it run yet


@dataclass(frozen=True)
class SessionLoad:
    """One session in a :class:`PoolLoad` snapshot."""

    id: str
    state: SessionState
    private_cells: int  # suffix cells this session owns (appended + generated)
    context_len: int  # prefix + private cells: what attention reads per token
    decode_tps: float | None  # EWMA of this session's decode tokens/s; None until measured
    duty_cycle: float | None  # observed share of wall time spent prefilling or decoding
    age_s: float
    num_generated: int
    parked: bool = False  # its private cells are off the cache (re-prefilled on resume)
    # A turn the decode gate holds: its place in the line (1: the next to start, in
    # completion order); None while no turn of it waits.
    turn_place: int | None = None


@dataclass(frozen=True)
class StepSample:
    """Timing of one engine step, for the gate's online throughput model."""

    num_decode: int  # sessions that decoded a token in the step
    num_prefill_tokens: int
    sum_context: int  # Σ context_len of the decoding sessions
    step_s: float  # wall time of the whole step (host work + llama_decode)
    # Cells in use in the whole cache (idle sessions' included): with one unified cache
    # every decoding row attends over all of them (masked).
    cells_used: int = 0


@dataclass(frozen=True)
class PoolLoad:
    """A consistent snapshot of the pool, taken between steps. Pure data."""

    taken_at: float  # time.monotonic() of the snapshot
    sessions: tuple[SessionLoad, ...]
    step_ms: float | None  # EWMA of step wall time
    agg_tps: float  # decode tokens/s over the recent window, all sessions
    cells_used: int  # prefix + Σ private cells
    cells_total: int  # n_ctx
    prefix_cells: int
    naive_cells: int  # what the same sessions would hold with a private prefix copy each
    free_seq_ids: int
    max_sessions: int
    session_budget: int
    recent_steps: tuple[StepSample, ...] = field(default_factory=tuple)
    # Totals since start (0 where an engine does not count them): sessions attached, suffix
    # tokens prefilled (with a private prefix per session, its copies too), and sessions
    # released because no handle held them any more (the safety net's count).
    sessions_attached: int = 0
    prefill_tokens: int = 0
    sessions_reaped: int = 0
    # Parking (0 where an engine does not park): attached sessions allowed at once, the
    # suffix tokens parked sessions hold off the cache, and since start: parks, resumes and
    # the suffix tokens resumes re-prefilled (a swapped resume re-prefills none).
    max_attached: int = 0
    parked_tokens: int = 0
    parks: int = 0
    resumes: int = 0
    resume_tokens: int = 0
    parked_bytes: int = 0  # host RAM held by swapped suffixes (at most park_memory)
    swaps: int = 0  # parks that swapped (the rest recompute on resume)
    park_memory: int = 0  # the host RAM swapped suffixes may hold (--park-memory, bytes)
    compactions: int = 0  # Session.compact since start, and the suffix cells it freed
    compacted_cells: int = 0
    cell_bytes: float = 0.0  # bytes of one KV cell (0: unknown); cells x this = KV bytes

    @property
    def num_parked(self) -> int:
        return sum(1 for s in self.sessions if s.parked)

    @property
    def num_resident(self) -> int:
        """Attached sessions whose cells are in the cache (they hold a sequence id)."""
        return len(self.sessions) - self.num_parked

    @property
    def attach_room(self) -> int:
        """Sessions that may still attach: free sequence ids, or with parking on, the
        attached limit left (cells aside)."""
        if self.max_attached > self.max_sessions:
            return max(0, self.max_attached - len(self.sessions))
        return self.free_seq_ids

    @property
    def reduction(self) -> float:
        """naive / pooled cell count (1.0 with no sessions)."""
        if not self.sessions or not self.cells_used:
            return 1.0
        return self.naive_cells / self.cells_used

    @property
    def cells_free(self) -> int:
        return self.cells_total - self.cells_used

    def count(self, state: SessionState) -> int:
        return sum(1 for s in self.sessions if s.state is state)

# -------------------- the seams -----------------------------------------------

logger = logging.getLogger(__name__)


class PrefillBudget(Protocol):
    """How many prefill tokens a step may carry next to ``num_decode`` decoding rows while
    ``cells_used`` cells are in use, so the step stays within what the floor allows. Pure
    and cheap: asked once per step, never when nothing decodes (the full ``n_batch``)."""

    def __call__(self, num_decode: int, cells_used: int) -> int: ...


class TurnAdmission(Protocol):
    """The decode gate: how many more turns may start running in the next step.

    A turn *runs* from the first step that prefills or decodes for it until it ends; a
    turn asked for (``generate``) that does not run yet *waits*, in completion order
    (``SamplingParams.priority``, then the order asked), its session's cells kept.
    ``num_running`` turns run now over ``cells_used`` cells; ``recent`` are the last
    measured steps (oldest first). Pure and cheap: asked once per step while a turn waits.
    The pool always lets one turn run when none does (progress).
    """

    def turn_room(self, num_running: int, cells_used: int,
                  recent: Sequence[StepSample]) -> int: ...


class _Held:
    """One turn waiting in a :class:`TurnLine`: its place key and whose turn it is."""

    __slots__ = ("key", "owner")

    def __init__(self, key: tuple[float, int], owner: str | None) -> None:
        self.key = key
        self.owner = owner


def _held_key(held: _Held) -> tuple[float, int]:
    return held.key


class TurnLine:
    """The decode gate's line for an engine whose turns run on the event loop.

    Turns ``enter`` and wait in completion order, as the pool's planner lets them in
    (:func:`mesh.engine.scheduler.order`); the head runs once the gate has room for one
    more; turns ``leave`` when they end. As in the pool, one turn always runs when none
    does, and a gate that raises holds the turns as they are. Room is asked again when a
    turn leaves, when the engine measures a step (``poke``) and every ``recheck_s``.

    Such an engine runs a turn as one coroutine and cannot pause it, so a negative room
    (shed) only keeps the waiting turns waiting, and an older task's waiting turn never
    takes a running turn's row. ``cells_used`` and ``recent`` read the engine's figures.
    """

    def __init__(self, cells_used: Callable[[], int],
                 recent: Callable[[], Sequence[StepSample]], *, recheck_s: float = 0.05) -> None:
        self.gate: TurnAdmission | None = None
        self.running = 0
        self._line: list[_Held] = []  # sorted by key: the next to start first
        self._owners: dict[str, _Held] = {}
        self._asked = itertools.count()  # equal priorities: the order asked (FIFO)
        self._changed = asyncio.Event()
        self._cells_used = cells_used
        self._recent = recent
        self._recheck_s = recheck_s

    @property
    def waiting(self) -> int:
        return len(self._line)

    def place(self, owner: str) -> int | None:
        """The place of ``owner``'s waiting turn in the line (1: the next to start); None
        while none of its turns waits."""
        held = self._owners.get(owner)
        if held is None:
            return None
        return bisect.bisect_left(self._line, held.key, key=_held_key) + 1

    def places(self) -> dict[str, int]:
        """Every waiting turn's place by owner (the turns entered without one left out)."""
        return {h.owner: i + 1 for i, h in enumerate(self._line) if h.owner is not None}

    def _may_start(self) -> bool:
        if self.gate is None or self.running == 0:
            return True
        try:
            return int(self.gate.turn_room(self.running, self._cells_used(),
                                           self._recent())) > 0
        except Exception:  # a broken gate must not fail the turns
            logger.exception("the decode gate failed; the waiting turns keep waiting")
            return False

    async def enter(self, priority: float = 0.0, owner: str | None = None) -> None:
        """Wait for this turn's place, then count it running. ``priority``: its completion
        order (``SamplingParams.priority``, else its session's attach time); ``owner``: its
        session id, for :meth:`place` (one waiting turn per owner). Cancelling the wait
        leaves the line."""
        me = _Held((priority, next(self._asked)), owner)
        bisect.insort(self._line, me, key=_held_key)
        if owner is not None:
            self._owners[owner] = me
        try:
            while not (self._line[0] is me and self._may_start()):
                self._changed.clear()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel
                # that lands as the event is set (a poke), and the cancelled turn would
                # stay in the line.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._recheck_s):
                        await self._changed.wait()
        finally:
            del self._line[bisect.bisect_left(self._line, me.key, key=_held_key)]
            if owner is not None and self._owners.get(owner) is me:
                del self._owners[owner]
            self.poke()  # the next one in line looks again
        self.running += 1

    def leave(self) -> None:
        """A running turn ended (whatever way)."""
        self.running = max(0, self.running - 1)
        self.poke()

    def poke(self) -> None:
        """Something changed (a step measured, a turn left): the head looks again."""
        self._changed.set()


@runtime_checkable
class Generation(Protocol):
    """Async iterator of :class:`Piece`; ``result`` is set once it is exhausted."""

    result: TurnResult | None

    def __aiter__(self) -> AsyncIterator[Piece]: ...

    async def aclose(self) -> None:
        """Stop generating early (the tokens so far stay in the session)."""


@runtime_checkable
class Session(Protocol):
    id: str

    @property
    def context_len(self) -> int: ...

    def append(self, text: str) -> None:
        """Queue suffix text; raises ContextOverflow if it cannot fit the budget."""

    def generate(self, params: SamplingParams) -> Generation:
        """Prefill what was appended, then stream up to ``params.max_tokens`` pieces."""

    async def compact(self, text: str) -> bool:
        """Compaction: replace everything after the shared prefix (the turns so far) with
        ``text``, a summary of them; their cells are freed and ``text`` is prefilled before
        the next turn. The prefix is never re-processed. False: a turn is running. Raises
        ContextOverflow if ``text`` does not fit the session's budget."""

    async def detach(self) -> None:
        """Free this session's private cells. Idempotent."""


@runtime_checkable
class Engine(Protocol):
    @property
    def info(self) -> PoolInfo: ...

    def check_attach(self) -> AttachCheck:
        """Would ``attach`` succeed now? Pure read; mutates nothing."""

    async def attach(self) -> Session:
        """Share the prefix with a new session; raises PoolFull with the reason."""

    def load(self) -> PoolLoad:
        """A snapshot for the gate and ``/capacity``."""

    def turn_place(self, session_id: str) -> int | None:
        """:attr:`SessionLoad.turn_place` of session ``session_id`` (None while no turn of
        it waits), without building a snapshot: a waiting worker may ask it often."""

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is (no BOS), for budgeting."""

    def backend_metrics(self) -> dict[str, Any] | None:
        """What a remote serving engine last exposed of its own load (running and waiting
        requests, inter-token time) for ``/capacity``; None for an engine in this process."""

    def set_prefill_budget(self, budget: PrefillBudget | None) -> None:
        """Cap the prefill a step carries beside decoding rows (None: no cap)."""

    def set_turn_admission(self, gate: TurnAdmission | None) -> None:
        """The decode gate: each turn runs once it has room (None: turns run as asked)."""

    async def aclose(self) -> None:
        """Stop the engine thread and free every native handle."""
