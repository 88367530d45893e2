"""The engine's seams, as protocols: :class:`Engine` and :class:`Session` (what the
worker and the HTTP layers call), :class:`Generation` (a turn's stream), and the two
budgets the gate hands the pool (:class:`PrefillBudget`, :class:`TurnAdmission`).

The seam itself is two protocols, :class:`Engine` and :class:`Session`:

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
* ``Engine.set_prefill_budget`` / ``Engine.set_turn_admission`` take the gate's two budgets.
  Every engine takes both: the local pool asks them on its engine thread each step; an
  engine that runs turns on the event loop (a remote backend, the fake) holds its turns in
  a :class:`TurnLine`, and a backend that schedules its own prefill says so and ignores
  the prefill budget."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol, runtime_checkable

from mesh.engine.config import SamplingParams
from mesh.engine.records import AttachCheck, Piece, PoolInfo, PoolLoad, StepSample, TurnResult

__all__ = ["Engine", "Generation", "PrefillBudget", "Session", "TurnAdmission", "TurnLine"]

logger = logging.getLogger(__name__)


class PrefillBudget(Protocol):
    """How many prefill tokens a step may carry next to ``num_decode`` decoding rows while
    ``cells_used`` cells are in use, so the step stays within what the floor allows.

    Pure and cheap: the engine thread calls it once per step. The pool never asks it when
    nothing is decoding (such a step takes the full ``n_batch``).
    """

    def __call__(self, num_decode: int, cells_used: int) -> int: ...


class TurnAdmission(Protocol):
    """The decode gate: how many more turns may start running in the next step.

    A turn *runs* from the first step that prefills or decodes for it until it ends; a
    turn that was asked for (``generate``) but does not run yet *waits*, first come first
    served, with its session's cells kept. ``num_running`` turns run now, over
    ``cells_used`` cells; ``recent`` are the last measured steps (oldest first). Pure and
    cheap: the engine thread asks it once per step while a turn waits. The pool always
    lets one turn run when none does (progress).
    """

    def turn_room(self, num_running: int, cells_used: int,
                  recent: Sequence[StepSample]) -> int: ...


class TurnLine:
    """The decode gate's line for an engine whose turns run on the event loop.

    Turns ``enter`` first come first served and run once the gate has room for one more;
    ``leave`` when they end. As the pool's planner does: one turn always runs when none
    does, and a gate that raises holds the turns as they are. Room is asked again when a
    turn leaves, when the engine measures a step (``poke``) and every ``recheck_s``. Such
    an engine cannot pause a turn between its steps, so a negative room (shed) only keeps
    the waiting turns waiting. ``cells_used`` and ``recent`` read the engine's own figures.
    """

    def __init__(self, cells_used: Callable[[], int],
                 recent: Callable[[], Sequence[StepSample]], *, recheck_s: float = 0.05) -> None:
        self.gate: TurnAdmission | None = None
        self.running = 0
        self._line: list[object] = []
        self._changed = asyncio.Event()
        self._cells_used = cells_used
        self._recent = recent
        self._recheck_s = recheck_s

    @property
    def waiting(self) -> int:
        return len(self._line)

    def _may_start(self) -> bool:
        if self.gate is None or self.running == 0:
            return True
        try:
            return int(self.gate.turn_room(self.running, self._cells_used(),
                                           self._recent())) > 0
        except Exception:  # a broken gate must not fail the turns
            logger.exception("the decode gate failed; the waiting turns keep waiting")
            return False

    async def enter(self) -> None:
        """Wait for this turn's place, then count it running. Cancelling the wait leaves
        the line (nothing held)."""
        me = object()
        self._line.append(me)
        try:
            while not (self._line[0] is me and self._may_start()):
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self._recheck_s)
        finally:
            self._line.remove(me)
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

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is (no BOS), for budgeting."""

    def set_prefill_budget(self, budget: PrefillBudget | None) -> None:
        """Cap the prefill a step carries beside decoding rows (None: no cap)."""

    def set_turn_admission(self, gate: TurnAdmission | None) -> None:
        """The decode gate: each turn runs once it has room (None: turns run as asked)."""

    async def aclose(self) -> None:
        """Stop the engine thread and free every native handle."""
