"""The coordinator's ``AgentExecutor``: the SDK's contract and the task's event writer.

``execute`` hands every task to the one task path (:class:`mesh.agent.task.AgentTask`)
with what the door checked of its message (:func:`mesh.a2a.validation.checked_message`;
nothing is parsed again), and writes what it says as the SDK's events (persisted, streamed
and pushed). Life of a task with explicit subtasks (a planned one adds its planning and
synthesis turns)::

    submitted ─▶ submitted "queued for the gate at position N" (per subtask, while queued)
              ─▶ working "admitted" ─▶ working per worker turn / tool call,
                 generated text as chunks of a ``stream-<subtask>`` artifact (append=True,
                 last_chunk=True at the end)
              ─▶ completed with the ``answer`` artifact │ failed with the reason │
                 rejected (queue full) │ canceled

Text that is progress, not an output (the plan forming), streams as working status lines
(:meth:`_Run.notes`); the plan rides in the task's metadata, so the ``answer`` is the last
artifact (issue 41). A failed worker does not cancel its siblings: the task completes with
the answers it has, naming the missing ones; it fails only when every worker failed.

Contract with the SDK: ``execute`` enqueues the ``Task`` first when ``context.current_task``
is None and always ends in a terminal state unless cancelled. ``cancel`` writes the
canceled state, then the SDK cancels ``execute``, which reaches the gate wait or the
running worker; admission tickets are released in a ``finally``, and the cancelled run's
late events are dropped (:class:`_Run.closed`): nothing follows the terminal event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import a2a_pb2 as pb

from mesh.a2a.store import owner_of
from mesh.a2a.validation import checked_message
from mesh.agent.task import Agent, AgentTask, TextSink, WorkerFactory
from mesh.gate.queue import Admission, QueueFull
from mesh.worker.types import EventKind, WorkerEvent

__all__ = ["CoordinatorExecutor"]

logger = logging.getLogger(__name__)

_TOOL_TEXT_MAX = 500
_FLUSH_CHARS = 4096
# status-line text (a note stream) flushes at most this often: each line stays in history
_NOTE_FLUSH_S = 1.0


class _Run:
    """One execution's event writer (:class:`~mesh.agent.task.TaskEvents`). Once
    ``closed`` (the task ended, or was canceled), it writes nothing more, so no event can
    follow the terminal one. ``is_working`` once any working status was written: progress
    lines never take the task back to submitted."""

    def __init__(self, updater: TaskUpdater, flush_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.updater = updater
        self.flush_s = flush_s
        self.clock = clock
        self.closed = False
        self.is_working = False

    def _message(self, text: str, metadata: dict[str, Any] | None = None) -> pb.Message:
        return self.updater.new_agent_message([pb.Part(text=text)], metadata=metadata)

    async def status(self, state: pb.TaskState, text: str, metadata: dict[str, Any] | None = None,
                     *, task_metadata: dict[str, Any] | None = None) -> None:
        # ``metadata`` rides on the status message; ``task_metadata`` on the event, which
        # the SDK merges into the task's own metadata (what a finished task keeps).
        if self.closed:
            return
        self.is_working = self.is_working or state == pb.TaskState.TASK_STATE_WORKING
        message = self._message(text, metadata)
        if task_metadata:
            await self.updater.update_status(state, message=message, metadata=task_metadata)
        else:
            await self.updater.update_status(state, message=message)

    async def progress(self, text: str, metadata: dict[str, Any]) -> None:
        state = (pb.TaskState.TASK_STATE_WORKING if self.is_working
                 else pb.TaskState.TASK_STATE_SUBMITTED)
        await self.status(state, text, metadata)

    async def artifact(self, parts: list[pb.Part], **kwargs: Any) -> None:
        if self.closed:
            return
        await self.updater.add_artifact(parts, **kwargs)

    async def finish(self, state: pb.TaskState, text: str) -> None:
        if self.closed:
            return
        self.closed = True
        await self.updater.update_status(state, message=self._message(text))

    def stream(self, artifact_id: str, name: str) -> _TextStream:
        return _TextStream(self, artifact_id=artifact_id, name=name, flush_s=self.flush_s,
                           clock=self.clock)

    def notes(self, key: str) -> _NoteStream:
        return _NoteStream(self, artifact_id=key, name=key,
                           flush_s=max(self.flush_s, _NOTE_FLUSH_S), clock=self.clock)

    async def worker_event(self, sink: TextSink, sid: str, event: WorkerEvent) -> None:
        """Text to ``sink``; a turn, tool call or result, or status line as a status."""
        if event.kind is EventKind.TEXT:
            await sink.add(event.text)
            return
        await sink.flush()
        text = event.text
        is_tool = event.kind in (EventKind.TOOL_CALL, EventKind.TOOL_RESULT)
        if is_tool and len(text) > _TOOL_TEXT_MAX:
            text = text[:_TOOL_TEXT_MAX] + f"... [{len(event.text)} chars]"
        label = {EventKind.TOOL_CALL: "tool call: ",
                 EventKind.TOOL_RESULT: "tool result: "}.get(event.kind, "")
        meta: dict[str, Any] = {"subtask": sid, "event": event.kind.value, "turn": event.turn}
        # the turn's wait for the decode gate, a pause, its place in the gate's line
        for key in ("wait_s", "paused_s", "turn_place"):
            value = event.data.get(key)
            if isinstance(value, int | float):
                meta[key] = int(value) if key == "turn_place" else float(value)
        await self.status(pb.TaskState.TASK_STATE_WORKING, f"[{sid}] {label}{text}", meta)


@dataclass
class _TextStream:
    """Coalesces generated pieces into artifact chunks (one store write per chunk)."""

    run: _Run
    artifact_id: str
    name: str
    flush_s: float
    clock: Callable[[], float]
    buffer: list[str] = field(default_factory=list)
    size: int = 0
    num_chunks: int = 0
    last_flush: float = 0.0

    async def add(self, text: str) -> None:
        if not text:
            return
        self.buffer.append(text)
        self.size += len(text)
        now = self.clock()
        if self.size >= _FLUSH_CHARS or now - self.last_flush >= self.flush_s:
            await self.flush(now)

    async def flush(self, now: float | None = None, *, last: bool = False) -> None:
        if not self.buffer and not (last and self.num_chunks):
            return
        text = "".join(self.buffer)
        self.buffer.clear()
        self.size = 0
        self.last_flush = self.clock() if now is None else now
        await self._write(text, last)
        self.num_chunks += 1

    async def _write(self, text: str, last: bool) -> None:
        await self.run.artifact([pb.Part(text=text)] if text else [],
                                artifact_id=self.artifact_id, name=self.name,
                                append=self.num_chunks > 0, last_chunk=last)


@dataclass
class _NoteStream(_TextStream):
    """The same coalescing, written as working status lines instead of an artifact
    (metadata ``{"subtask": <key>, "event": "text"}``): text that is progress, not an
    output, such as the plan forming. Every status line goes to the task's history, so
    these flush at most every :data:`_NOTE_FLUSH_S`."""

    async def _write(self, text: str, last: bool) -> None:
        if text:
            await self.run.status(pb.TaskState.TASK_STATE_WORKING, text,
                                  {"subtask": self.artifact_id, "event": "text"})


class CoordinatorExecutor(AgentExecutor):
    """The SDK's executor over the one task path (see the module docstring). ``agent``
    (optional) plans messages without explicit subtasks."""

    def __init__(self, worker_factory: WorkerFactory, admission: Admission, *,
                 text_flush_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                 agent: Agent | None = None) -> None:
        self._agent = agent
        self._worker_factory = worker_factory
        self._admission = admission
        self._text_flush_s = text_flush_s
        self._clock = clock
        self._runs: dict[str, _Run] = {}

    @property
    def num_running(self) -> int:
        """Tasks whose ``execute`` is in progress on this process."""
        return len(self._runs)

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        if message is None or context.task_id is None:
            raise ValueError("execute() needs a message and a task id")
        task = context.current_task
        task_id = context.task_id
        context_id = task.context_id if task is not None else (context.context_id or "")
        if task is None:
            await event_queue.enqueue_event(pb.Task(
                id=task_id, context_id=context_id, history=[message],
                status=pb.TaskStatus(state=pb.TaskState.TASK_STATE_SUBMITTED)))
        run = _Run(TaskUpdater(event_queue, task_id, context_id), self._text_flush_s,
                   self._clock)
        checked = checked_message(context.call_context)
        if checked is None:  # an app wired without the guard's context builder
            await run.finish(pb.TaskState.TASK_STATE_REJECTED,
                             "rejected: the message did not pass the request guard; serve "
                             "the app with mesh.a2a.validation.CheckedContextBuilder")
            return
        caller = owner_of(context.call_context) if context.call_context is not None else ""
        self._runs[task_id] = run
        try:
            await AgentTask(self._agent, run, self._admission, task_id,
                            f"{caller}\x00{context_id}", checked.text, self._worker_factory,
                            checked.subtasks, caller=caller, hops=checked.hops).run()
        except QueueFull as e:
            await run.finish(pb.TaskState.TASK_STATE_REJECTED,
                             f"rejected: over capacity ({e}); retry after {e.retry_after_s:.0f} s")
        except Exception as e:  # any failure point (admit, a flush, an error group, ...)
            await self._fail(run, task_id, e)
        finally:
            self._runs.pop(task_id, None)

    async def _fail(self, run: _Run, task_id: str, exc: Exception) -> None:
        """End the task FAILED at once with the reason (never leave it SUBMITTED/WORKING)."""
        logger.error("task %s failed: %s", task_id, exc, exc_info=exc)
        leaf: BaseException = exc
        while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
            leaf = leaf.exceptions[0]
        reason = f"failed: {type(leaf).__name__}" + (f": {leaf}" if str(leaf) else "")
        try:
            await run.finish(pb.TaskState.TASK_STATE_FAILED, reason)
        except Exception:
            logger.exception("task %s: could not write its failed state", task_id)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Write the canceled state; the SDK then cancels ``execute`` (see module doc)."""
        task_id = context.task_id or ""
        run = self._runs.get(task_id)
        if run is not None:
            run.closed = True
        task = context.current_task
        context_id = task.context_id if task is not None else (context.context_id or "")
        updater = TaskUpdater(event_queue, task_id, context_id)
        await updater.cancel(updater.new_agent_message([pb.Part(text="canceled by the client")]))
