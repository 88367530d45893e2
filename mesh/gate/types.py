"""The admission seam between the gate and the layers that start work.

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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Admission", "OnPosition", "QueueCheck", "QueueFull", "Ticket"]


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
