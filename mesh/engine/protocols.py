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
  its generation raises :class:`SessionFailed`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from mesh.engine.config import SamplingParams
from mesh.engine.records import AttachCheck, Piece, PoolInfo, PoolLoad, StepSample, TurnResult

__all__ = ["Engine", "Generation", "PrefillBudget", "Session", "TurnAdmission"]


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

    async def aclose(self) -> None:
        """Stop the engine thread and free every native handle."""
