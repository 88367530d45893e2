"""What the OpenAI API, the session API and the dashboard share about their callers and
workers' tickets (held with :class:`~mesh.gate.queue.Hold`): who the caller is
(:func:`caller_of`), whose share of the gate's queue a request takes and whose sessions,
conversations or streams it counts against; the gate's refusals as a :class:`Refusal`
each API renders as a 429 with ``Retry-After``; and :class:`Periodic`, the background task
that retires idle holders (the OpenAI API's sweeper, the session API's reaper).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request

from mesh.gate.queue import ANONYMOUS, Admission, Hold, NotAdmitted, QueueFull, Ticket

__all__ = ["Periodic", "Refusal", "admit", "caller_of", "queue_refusal", "release"]


def caller_of(request: Request) -> str:
    """The caller's name: the one :class:`~mesh.a2a.app.BearerAuth` set from the bearer
    token (``scope["user"]``), else the anonymous caller (auth off: every client is that
    one caller). Each API scopes its sessions, conversations, queue places and streams by
    it."""
    user = request.scope.get("user")
    name = getattr(user, "username", None) or getattr(user, "display_name", None)
    return str(name) if name else ANONYMOUS


class Refusal(Exception):
    """The gate said no: answered 429 with ``Retry-After: retry_after_s``."""

    def __init__(self, code: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


def queue_refusal(admission: Admission, caller: str = "") -> Refusal | None:
    """The gate's queue check for one of ``caller``'s places, as a refusal (None: the
    queue takes the request)."""
    check = admission.check_queue(caller=caller)
    if check.ok:
        return None
    return Refusal("queue_full", check.reason or "the queue is full", check.retry_after_s)


async def admit(admission: Admission, key: str, timeout_s: float | None,
                caller: str = "", *, check: bool = True) -> Hold:
    """The queue check (unless not ``check``), then a hold within ``timeout_s`` (one place
    in ``caller``'s share); raises Refusal (queue_full, not_admitted) otherwise. The
    caller closes the hold (``async with hold`` or ``hold.aclose()``)."""
    refusal = queue_refusal(admission, caller) if check else None
    if refusal is not None:
        raise refusal
    try:
        return await Hold.acquire(admission, key, caller=caller, within_s=timeout_s)
    except QueueFull as exc:
        raise Refusal("queue_full", str(exc), exc.retry_after_s) from None
    except NotAdmitted as exc:
        raise Refusal("not_admitted", str(exc), exc.retry_after_s) from None


async def release(ticket: Ticket | None) -> None:
    """Release ``ticket`` (if any), even from a cancelled task."""
    if ticket is None:
        return
    with anyio.CancelScope(shield=True):
        await ticket.release()


class Periodic:
    """Runs ``tick`` every ``period()`` seconds in the serving loop: started by the first
    :meth:`ensure_started` (from a handler), stopped by :meth:`aclose`."""

    def __init__(self, tick: Callable[[], Awaitable[Any]], period: Callable[[], float]) -> None:
        self._tick = tick
        self._period = period
        self._task: asyncio.Task[None] | None = None

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._period())
            await self._tick()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
