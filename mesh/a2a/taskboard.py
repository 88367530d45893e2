"""A bounded, in-memory view of the coordinator's tasks, for the live dashboard.

:class:`ObservedTaskStore` wraps the task store the request handler writes through and
reports every saved task to a :class:`TaskBoard`. The board keeps the live (non-terminal)
tasks and the most recent finished ones, both bounded, so a long-running mesh holds a
fixed amount of memory here whatever its traffic. It is read by ``GET /dashboard/events``
(see :mod:`mesh.api.dashboard`) through :meth:`TaskBoard.snapshot`.

The board spans every caller: it is an operator's view, served only behind the same
bearer auth as ``/capacity``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.tasks import TaskStore
from a2a.types import a2a_pb2 as pb

__all__ = ["ObservedTaskStore", "TaskBoard"]

_PREFIX = "TASK_STATE_"
_TERMINAL = frozenset({"completed", "failed", "canceled", "rejected"})
_QUEUED = frozenset({"submitted", "unspecified"})


def state_name(task: pb.Task) -> str:
    """``TASK_STATE_WORKING`` -> ``working``."""
    name: str = pb.TaskState.Name(task.status.state)
    return name.removeprefix(_PREFIX).lower()


@dataclass(slots=True)
class _Row:
    id: str
    state: str
    first_seen: float
    last_seen: float

    def as_dict(self, now: float) -> dict[str, Any]:
        terminal = self.state in _TERMINAL
        # A finished task's age is how long it ran; a live one's is how long it has existed.
        age = (self.last_seen if terminal else now) - self.first_seen
        return {"id": self.id, "state": self.state, "ageS": round(max(age, 0.0), 3)}


class TaskBoard:
    """Live tasks (at most ``max_live``) and the last ``max_recent`` finished ones."""

    def __init__(
        self,
        *,
        max_live: int = 256,
        max_recent: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_live < 1 or max_recent < 1:
            raise ValueError("TaskBoard needs max_live >= 1 and max_recent >= 1")
        self._max_live = max_live
        self._live: OrderedDict[str, _Row] = OrderedDict()
        self._recent: deque[_Row] = deque(maxlen=max_recent)
        self._clock = clock
        self.finished_total = 0

    def observe(self, task: pb.Task) -> None:
        """Record the state ``task`` was just saved in."""
        self.update(task.id, state_name(task))

    def update(self, task_id: str, state: str) -> None:
        """Record ``task_id`` in ``state`` (a lower-case A2A state name)."""
        now = self._clock()
        row = self._live.get(task_id)
        if state in _TERMINAL:
            if row is None:
                if any(r.id == task_id for r in self._recent):
                    return  # a finished task saved again (e.g. an artifact flush)
                row = _Row(task_id, state, now, now)
            else:
                del self._live[task_id]
            row.state, row.last_seen = state, now
            self._recent.append(row)
            self.finished_total += 1
            return
        if row is None:
            self._live[task_id] = _Row(task_id, state, now, now)
            while len(self._live) > self._max_live:
                self._live.popitem(last=False)  # the oldest; bounded whatever happens
        else:
            row.state, row.last_seen = state, now

    def snapshot(self) -> dict[str, Any]:
        """``{running, queued, finishedTotal, live: [...], recent: [...]}``; rows are
        ``{id, state, ageS}``, recent ones newest first."""
        now = self._clock()
        live = list(self._live.values())
        queued = sum(1 for r in live if r.state in _QUEUED)
        return {
            "running": len(live) - queued,
            "queued": queued,
            "finishedTotal": self.finished_total,
            "live": [r.as_dict(now) for r in live],
            "recent": [r.as_dict(now) for r in reversed(self._recent)],
        }


class ObservedTaskStore(TaskStore):
    """A :class:`TaskStore` that forwards to ``inner`` and reports each save to ``board``.

    The save reaches the board only once the inner store accepted it.
    """

    def __init__(self, inner: TaskStore, board: TaskBoard) -> None:
        self.inner = inner
        self.board = board

    async def save(self, task: pb.Task, context: ServerCallContext) -> None:
        await self.inner.save(task, context)
        self.board.observe(task)

    async def get(self, task_id: str, context: ServerCallContext) -> pb.Task | None:
        return await self.inner.get(task_id, context)

    async def list(
        self, params: pb.ListTasksRequest, context: ServerCallContext
    ) -> pb.ListTasksResponse:
        return await self.inner.list(params, context)

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        await self.inner.delete(task_id, context)
