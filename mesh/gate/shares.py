"""The wait queue's places, counted per caller: pure accounting, no I/O, no clock.

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

Who owns what: the one FIFO of waiters (:class:`~mesh.gate.waiters.WaiterQueue`, behind
the floor gate and the node pool) calls :meth:`QueueShares.add` and
:meth:`QueueShares.remove` exactly when a waiter enters and leaves it, so
``waiting(caller)`` is always the caller's places in that FIFO.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["ANONYMOUS", "QueueShares", "places_needed"]

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
