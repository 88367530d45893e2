"""Admit, attach, release: one worker's hold on the gate (and on the pool), for every caller.

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
:class:`~mesh.gate.types.Ticket` (``key``, ``release()``), so it goes where a ticket goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import TracebackType

import anyio

from mesh.engine.interface import Engine, EngineError, Session
from mesh.gate.shares import ANONYMOUS
from mesh.gate.types import Admission, OnPosition, Ticket

__all__ = ["Hold", "NotAdmitted", "admitted"]


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
        """Wait for ``admission``'s ticket (see :class:`~mesh.gate.types.Admission` for
        ``on_position``, ``accepted`` and ``caller``). Raises
        :class:`~mesh.gate.types.QueueFull` when the queue refuses the wait, and
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
        """The :class:`~mesh.gate.types.Ticket` face: :meth:`aclose`."""
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
