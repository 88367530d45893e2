"""One FIFO of waiters for every admission queue: the floor gate's and the node pool's.

:class:`WaiterQueue` owns the queue's order, its per-caller places (:mod:`mesh.gate.shares`),
the waits, their position reports, and what a cancelled wait gives back. What differs
between admissions is one question, asked of the head only: *may it go now, and with
what?* That is ``choose(head)``: the floor gate answers with a ticket when
:func:`~mesh.gate.decide.decide` admits; the node pool with the node that has most room.

Invariants:

* FIFO: only the head is ever granted, by :meth:`WaiterQueue.pump`, while ``choose``
  answers; a waiter leaves the queue only by its grant or by its own cancellation.
  ``front=True`` enters at the head (a node pool's retry goes before new work).
* ``shares`` counts exactly the waiters in the queue, per caller.
* A grant made to a waiter that was cancelled before it could take it goes back through
  ``abandon(grant)``, so cancellation never leaks a ticket (or a node's reserved room).
* Every waiter is woken when the queue moves (:meth:`WaiterQueue.poke`): they re-report
  their positions. The head also re-asks every ``head_recheck_s`` (load changes while
  nobody releases), the others every ``rest_recheck_s`` (default: only when woken).

Everything runs on one event loop; the methods that do not await are atomic with respect
to other tasks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import anyio

from mesh.gate.shares import ANONYMOUS, QueueShares
from mesh.gate.types import OnPosition

__all__ = ["Waiter", "WaiterQueue", "report_admitted"]

G = TypeVar("G")


class Waiter(Generic[G]):
    """One queued request: ``grant`` is set (and ``wake`` fired) when it may go.
    ``exclude`` names what ``choose`` must not grant it (a node pool: the nodes a retried
    subtask already failed on)."""

    __slots__ = ("caller", "exclude", "grant", "key", "wake")

    def __init__(self, key: str, caller: str = ANONYMOUS,
                 exclude: frozenset[str] = frozenset()) -> None:
        self.key = key
        self.caller = caller
        self.exclude = exclude
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

    async def wait(self, waiter: Waiter[G], on_position: OnPosition | None = None, *,
                   front: bool = False) -> G:
        """Queue ``waiter`` and wait for its grant, reporting each new position to
        ``on_position``. Cancelled: the waiter leaves the queue (or hands its grant
        back through ``abandon``) and the rest move up."""
        self._enter(waiter, front=front)
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

    def _enter(self, waiter: Waiter[G], *, front: bool) -> None:
        if front:
            self._queue.appendleft(waiter)
        else:
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
