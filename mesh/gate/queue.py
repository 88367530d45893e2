"""The admission seam and its one queue: the protocol callers use, each caller's share of
the queue, the FIFO itself and how a caller holds an admission. Read top to bottom:

**The seam.** The admission seam between the gate and the layers that start work.

The pure decision lives in :mod:`mesh.gate.decide`; :class:`Admission` is its async face:
a bounded FIFO queue in front of the pool. Callers that start work (the coordinator's
executor, the session API) use only this protocol:

* ``check_queue(places=1, caller="")`` — pure read: would ``caller``'s new request of
  ``places`` places (one per subtask it will admit) be accepted (admitted now or queued)
  or refused because its places do not all fit the queue's free places or the caller's
  share of the queue? Used to answer HTTP 429 before any task exists.
* ``admit(key, on_position, accepted=False, caller="")`` — wait until the gate admits;
  returns a :class:`Ticket`. Raises :class:`QueueFull` at once if the queue (or
  ``caller``'s share of it) is full, unless ``accepted``: work that already passed
  ``check_queue`` at the door, for all its places, always queues, so a race between the
  check and the admit never drops it; the bound is then exceeded by at most the places of
  the requests in flight at the door. ``on_position`` is awaited with the 1-based queue
  position whenever it changes (0 = admitted). Cancelling the wait removes the entry from
  the queue; nothing else is lost.

``caller`` is the authenticated caller's name (``""``: auth is off, one caller, which may
use the whole queue); each named caller holds at most its share of the queue's places.
* ``Ticket.release()`` — the worker is done (its session detached). Idempotent.
* ``capacity()`` — the JSON-able ``/capacity`` document.

**Shares.** The wait queue's places, counted per caller: pure accounting, no I/O, no clock.

A *place* is one waiter: one subtask, planning or synthesis turn, or session waiting for
the gate. The queue is bounded twice:

* ``max_queue`` places in all;
* ``share`` places per authenticated caller, so one caller that fills its share is
  refused (429) while every other caller still queues, behind at most ``share`` of its
  places. The anonymous caller (``""``: auth is off, so every client is the same caller)
  may use the whole queue.

A request that needs ``places`` places (a task with that many subtasks) is checked for all
of them at once: it fits only if every one of them does. A request larger than a bound
is clamped to the bound (it goes in when the queue, or its caller's share, is empty), so a
task with more subtasks than the share is delayed, never refused forever.

Who owns what: the one FIFO of waiters (:class:`~mesh.gate.queue.WaiterQueue`, behind
the floor gate) calls :meth:`QueueShares.add` and
:meth:`QueueShares.remove` exactly when a waiter enters and leaves it, so
``waiting(caller)`` is always the caller's places in that FIFO.

**The queue.** One FIFO of waiters for every admission: the floor gate's.

:class:`WaiterQueue` owns the queue's order, its per-caller places (:mod:`mesh.gate.queue`),
the waits, their position reports, and what a cancelled wait gives back. What differs
between admissions is one question, asked of the head only: *may it go now, and with
what?* That is ``choose(head)``: the floor gate answers with a ticket when
:func:`~mesh.gate.decide.decide` admits.

Invariants:

* FIFO: only the head is ever granted, by :meth:`WaiterQueue.pump`, while ``choose``
  answers; a waiter leaves the queue only by its grant or by its own cancellation.
* ``shares`` counts exactly the waiters in the queue, per caller.
* A grant made to a waiter that was cancelled before it could take it goes back through
  ``abandon(grant)``, so cancellation never leaks a ticket.
* Every waiter is woken when the queue moves (:meth:`WaiterQueue.poke`): they re-report
  their positions. The head also re-asks every ``head_recheck_s`` (load changes while
  nobody releases), the others every ``rest_recheck_s`` (default: only when woken).

Everything runs on one event loop; the methods that do not await are atomic with respect
to other tasks.

**Holding an admission.** Admit, attach, release: one worker's hold on the gate (and on the
pool), for every caller.

Every layer that starts work (the A2A executor's subtasks, the agent's plan and synthesis
turns, the session API, the OpenAI API) does the same three things: wait for the
admission's ticket, attach a pool session (or let its worker attach one), and in the end
detach the session and release the ticket, even from a cancelled task. :class:`Hold` is
that, once:

* :func:`admitted` — an async context manager: admit, yield the :class:`Hold`, close it on
  exit (session detached, ticket released), whatever the exit.
* :meth:`Hold.acquire` — the same hold without the block, for holders that outlive one
  (a session of the session API, an OpenAI conversation's ticket); close it with
  :meth:`Hold.aclose`. :meth:`Hold.keep` hands a hold out of an :func:`admitted` block.

Invariants: :meth:`Hold.aclose` is idempotent and shielded from cancellation, detaches
before it releases (the slot is free before the next worker is admitted into it), and
releases the ticket even when the detach fails. A hold is also a
:class:`~mesh.gate.queue.Ticket` (``key``, ``release()``), so it goes where a ticket goes.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import anyio

from mesh.engine.interface import Engine, EngineError, Session

__all__ = [
    "ANONYMOUS", "Admission", "Hold", "NotAdmitted", "OnPosition", "QueueCheck", "QueueFull",
    "QueueShares", "Ticket", "Waiter", "WaiterQueue", "admitted", "places_needed", "report_admitted"
]


# -------------------- the seam ------------------------------------------------

class QueueFull(Exception):
    """The wait queue is at its bound; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class QueueCheck:
    ok: bool
    queue_len: int
    retry_after_s: float
    reason: str = ""


OnPosition = Callable[[int], Awaitable[None]]


class Ticket(Protocol):
    key: str

    async def release(self) -> None: ...


class Admission(Protocol):
    def check_queue(self, *, places: int = 1, caller: str = "") -> QueueCheck: ...

    async def admit(
        self, key: str, on_position: OnPosition | None = None, *, accepted: bool = False,
        caller: str = "",
    ) -> Ticket: ...

    def capacity(self) -> dict[str, Any]: ...

# -------------------- shares --------------------------------------------------

ANONYMOUS = ""  # the caller of every request when auth is off


def places_needed(places: int, bound: int) -> int:
    """The places a request of ``places`` must find free under ``bound`` (clamped, >= 1)."""
    return max(1, min(places, bound))


class QueueShares:
    """Places per caller in one FIFO (see the module docstring)."""

    def __init__(self, max_queue: int, share: int) -> None:
        if max_queue < 0 or share < 1:
            raise ValueError(f"need max_queue >= 0 and share >= 1, got {max_queue}, {share}")
        self.max_queue = max_queue
        self.share = share
        self._waiting: Counter[str] = Counter()

    def share_of(self, caller: str) -> int:
        """The places ``caller`` may hold: the whole queue for the anonymous caller."""
        return max(1, self.max_queue) if caller == ANONYMOUS else self.share

    def waiting(self, caller: str) -> int:
        return self._waiting[caller]

    @property
    def num_callers(self) -> int:
        """Callers with at least one place in the queue."""
        return len(self._waiting)

    def over_share(self, caller: str, places: int = 1) -> int:
        """How many of ``caller``'s places must leave the queue before a request of
        ``places`` fits its share (0: it fits now)."""
        share = self.share_of(caller)
        return max(0, self._waiting[caller] + places_needed(places, share) - share)

    def refusal(self, caller: str, places: int = 1) -> str:
        """Why ``caller``'s request of ``places`` does not fit its share ("" if it does)."""
        if not self.over_share(caller, places):
            return ""
        need = places_needed(places, self.share_of(caller))
        return (f"this caller already has {self._waiting[caller]} places in the gate's queue "
                f"and asks for {need} more; each caller may hold {self.share_of(caller)} of "
                f"its {self.max_queue} places (max_queue_per_caller); retry when some of its "
                "work has started")

    def add(self, caller: str) -> None:
        self._waiting[caller] += 1

    def remove(self, caller: str) -> None:
        left = self._waiting[caller] - 1
        if left > 0:
            self._waiting[caller] = left
        else:
            del self._waiting[caller]

# -------------------- the queue -----------------------------------------------

G = TypeVar("G")


class Waiter(Generic[G]):
    """One queued request: ``grant`` is set (and ``wake`` fired) when it may go."""

    __slots__ = ("caller", "grant", "key", "wake")

    def __init__(self, key: str, caller: str = ANONYMOUS) -> None:
        self.key = key
        self.caller = caller
        self.grant: G | None = None
        self.wake = anyio.Event()


class WaiterQueue(Generic[G]):
    """The FIFO (see the module docstring). ``choose(head)`` returns the head's grant or
    None (the head stays); ``abandon(grant)`` takes back a grant nobody took."""

    def __init__(self, choose: Callable[[Waiter[G]], G | None],
                 abandon: Callable[[G], None], shares: QueueShares, *,
                 head_recheck_s: float, rest_recheck_s: float = math.inf) -> None:
        self._choose = choose
        self._abandon = abandon
        self.shares = shares
        self.head_recheck_s = head_recheck_s
        self.rest_recheck_s = rest_recheck_s
        self._queue: deque[Waiter[G]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Waiter[G]]:
        return iter(self._queue)

    def positions_of(self, caller: str) -> list[int]:
        """The 1-based positions of ``caller``'s waiters, head first."""
        return [i for i, w in enumerate(self._queue, 1) if w.caller == caller]

    async def wait(self, waiter: Waiter[G], on_position: OnPosition | None = None) -> G:
        """Queue ``waiter`` and wait for its grant, reporting each new position to
        ``on_position``. Cancelled: the waiter leaves the queue (or hands its grant
        back through ``abandon``) and the rest move up."""
        self._enter(waiter)
        last = -1
        try:
            while True:
                self.pump()
                if waiter.grant is not None:
                    return waiter.grant
                pos = self._queue.index(waiter) + 1
                if on_position is not None and pos != last:
                    last = pos
                    await on_position(pos)
                    continue  # time passed: re-check before sleeping
                # No await between the state check above and this wait: no lost wake-up.
                waiter.wake = wake = anyio.Event()
                timeout = self.head_recheck_s if pos == 1 else self.rest_recheck_s
                with anyio.move_on_after(timeout):
                    await wake.wait()
        except BaseException:
            if waiter.grant is not None:
                self._abandon(waiter.grant)
            elif waiter in self._queue:
                self._leave(waiter)
                self.poke()
            raise

    def pump(self) -> None:
        """Grant from the head while ``choose`` answers; wake everyone if the queue moved."""
        moved = False
        while self._queue:
            head = self._queue[0]
            grant = self._choose(head)
            if grant is None:
                break
            self._leave(head)
            head.grant = grant
            head.wake.set()
            moved = True
        if moved:
            self.wake_all()

    def poke(self) -> None:
        """Something was released: grant what can be, and let every waiter look again."""
        self.pump()
        self.wake_all()

    def wake_all(self) -> None:
        for w in self._queue:
            w.wake.set()

    def _enter(self, waiter: Waiter[G]) -> None:
        self._queue.append(waiter)
        self.shares.add(waiter.caller)

    def _leave(self, waiter: Waiter[G]) -> None:
        self._queue.remove(waiter)
        self.shares.remove(waiter.caller)


async def report_admitted(on_position: OnPosition | None, undo: Callable[[], object]) -> None:
    """Tell ``on_position`` the wait is over (position 0); if that fails (or is
    cancelled), ``undo()`` the admission before the error propagates."""
    if on_position is None:
        return
    try:
        await on_position(0)
    except BaseException:
        undo()
        raise

# -------------------- holding an admission ------------------------------------

class NotAdmitted(Exception):
    """``within_s`` passed before the admission gave a ticket (the wait left the queue);
    retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Hold:
    """One admitted worker: its ticket and, once :meth:`attach` ran, its pool session."""

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self.key = ticket.key
        self.session: Session | None = None
        self.closed = False
        self._kept = False

    @classmethod
    async def acquire(
        cls, admission: Admission, key: str, *, on_position: OnPosition | None = None,
        accepted: bool = False, caller: str = ANONYMOUS, within_s: float | None = None,
    ) -> Hold:
        """Wait for ``admission``'s ticket (see :class:`~mesh.gate.queue.Admission` for
        ``on_position``, ``accepted`` and ``caller``). Raises
        :class:`~mesh.gate.queue.QueueFull` when the queue refuses the wait, and
        :class:`NotAdmitted` when ``within_s`` seconds (None: no bound) pass first."""
        try:
            with anyio.fail_after(within_s):
                ticket = await admission.admit(key, on_position, accepted=accepted,
                                               caller=caller)
        except TimeoutError:
            raise NotAdmitted(f"not admitted within {within_s} s",
                              admission.check_queue().retry_after_s) from None
        return cls(ticket)

    async def attach(self, engine: Engine) -> Session:
        """Attach this hold's pool session (detached again by :meth:`aclose`). An
        engine error (``PoolFull``) propagates; the ticket stays held until closed."""
        if self.session is not None or self.closed:
            raise RuntimeError(f"hold {self.key} already has a session or is closed")
        self.session = await engine.attach()
        return self.session

    def keep(self) -> Hold:
        """Hand this hold out of its :func:`admitted` block: leaving the block no longer
        closes it; the new owner calls :meth:`aclose`."""
        self._kept = True
        return self

    async def aclose(self) -> None:
        """Detach the session (if any), then release the ticket. Idempotent, shielded."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            try:
                if self.session is not None:
                    with contextlib.suppress(EngineError):
                        await self.session.detach()
            finally:
                await self.ticket.release()

    async def release(self) -> None:
        """The :class:`~mesh.gate.queue.Ticket` face: :meth:`aclose`."""
        await self.aclose()

    async def __aenter__(self) -> Hold:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if not self._kept:
            await self.aclose()


@contextlib.asynccontextmanager
async def admitted(
    admission: Admission, key: str, *, on_position: OnPosition | None = None,
    accepted: bool = False, caller: str = ANONYMOUS, within_s: float | None = None,
) -> AsyncIterator[Hold]:
    """``async with admitted(...) as hold``: :meth:`Hold.acquire`, then the block, then
    :meth:`Hold.aclose` (unless the block called :meth:`Hold.keep`)."""
    hold = await Hold.acquire(admission, key, on_position=on_position, accepted=accepted,
                              caller=caller, within_s=within_s)
    async with hold:
        yield hold
