"""Every subtask of a task through the gate to a worker, side by side: the one fan-out.

:func:`run_subtask` is one subtask's life: queue for the gate (its queue position said as
progress), admitted, the worker runs (its text streamed as ``stream-<id>``, its other
events as status lines), the admission released in a ``finally``. :func:`fan_out` runs a
task's subtasks at once: a worker that raises fails only its own subtask
(:class:`SubtaskFailed`, the sibling workers go on); anything else (the gate breaking, a
write failing, a full queue) cancels the rest and is raised, so the task fails with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from a2a.types import a2a_pb2 as pb

from mesh.agent.events import TaskEvents
from mesh.agent.subtasks import local_id
from mesh.gate.queue import Admission, QueueFull, admitted
from mesh.worker.types import Subtask, Worker, WorkerEvent, WorkerResult

__all__ = ["SubtaskFailed", "WorkerFactory", "fan_out", "run_subtask"]

logger = logging.getLogger(__name__)

WorkerFactory = Callable[[], Worker]


class SubtaskFailed(Exception):
    """A worker raised; the message is the reason the client sees."""


async def run_subtask(events: TaskEvents, admission: Admission, workers: WorkerFactory,
                      subtask: Subtask, caller: str = "") -> WorkerResult:
    """Run ``subtask`` on a fresh worker once the gate admits it (see the module doc);
    ``caller``: whose share of the gate's queue it takes. Raises :class:`SubtaskFailed`
    when the worker raised."""
    sid = local_id(subtask)
    meta: dict[str, Any] = {"subtask": sid}

    async def on_position(position: int) -> None:
        if position > 0:
            await events.progress(f"[{sid}] queued for the gate at position {position}",
                                  {**meta, "event": "queued", "queue_position": position})

    # The request passed check_queue at the door for all its places (or its plan waited
    # for room): it queues, it is never rejected here. The worker attaches its own session;
    # the ticket is released (shielded) whatever the exit.
    async with admitted(admission, subtask.id, on_position=on_position, accepted=True,
                        caller=caller):
        await events.status(pb.TaskState.TASK_STATE_WORKING, f"[{sid}] admitted; worker started",
                            {**meta, "event": "admitted"})
        sink = events.stream(f"stream-{sid}", f"{sid} output")

        async def emit(event: WorkerEvent) -> None:
            await events.worker_event(sink, sid, event)

        try:
            result = await workers().run(subtask, emit)
        except (asyncio.CancelledError, QueueFull):
            raise
        except Exception as e:
            logger.info("subtask %s failed: %s", subtask.id, e, exc_info=True)
            raise SubtaskFailed(f"subtask {sid} failed: {str(e) or type(e).__name__}") from e
        await sink.flush(last=True)
        return result


RunOne = Callable[[Subtask], Awaitable[WorkerResult]]


async def fan_out(subtasks: Sequence[Subtask],
                  run_one: RunOne) -> list[WorkerResult | SubtaskFailed]:
    """Every subtask's result, or how its worker failed, in order (see the module doc)."""

    async def one(s: Subtask) -> WorkerResult | SubtaskFailed:
        try:
            return await run_one(s)
        except SubtaskFailed as e:
            return e

    if len(subtasks) == 1:
        return [await one(subtasks[0])]
    try:
        async with asyncio.TaskGroup() as group:
            jobs = [group.create_task(one(s)) for s in subtasks]
    except BaseExceptionGroup as eg:
        for exc in eg.exceptions:
            if isinstance(exc, QueueFull):
                raise exc from None
        raise
    return [job.result() for job in jobs]
