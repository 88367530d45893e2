"""The coordinator's ``AgentExecutor``: a task in, subtasks through the gate, workers out.

Life of a task (every step is an event on the SDK's queue, so it is persisted, streamed to
subscribers and pushed)::

    submitted ─▶ submitted "queued for the gate at position N" (per subtask, while queued)
              ─▶ working "admitted" ─▶ working per worker turn / tool call,
                 generated text as chunks of a ``stream-<subtask>`` artifact (append=True,
                 last_chunk=True at the end)
              ─▶ completed with the ``answer`` artifact │ failed with the reason │
                 rejected (bad subtasks, queue full) │ canceled

A worker that fails does not cancel its siblings: the task completes with the answers it
has and says which subtasks are missing and why; it fails only when every worker failed.

Contract with the SDK (``AgentExecutor``): ``execute`` enqueues the ``Task`` first when
``context.current_task`` is None and always ends in a terminal state unless it is
cancelled. ``cancel`` writes the canceled state itself and then the SDK cancels the
``execute`` coroutine; that cancellation reaches the gate wait (the queue entry is
dropped) or the running worker (which detaches its session), and every admission ticket
is released in a ``finally``. After ``cancel`` has written its terminal state, the
cancelled run's own late events are dropped (:class:`_Run.closed`), so nothing follows
the terminal event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict

from mesh.a2a.store import owner_of
from mesh.agent.subtasks import join_answers, local_id, message_text, subtasks_from_message
from mesh.agent.synthesis import Outcome, missing_note
from mesh.agent.task import Agent, AgentTask
from mesh.fleet.peers import CURRENT_HOPS, hops_of
from mesh.gate.types import Admission, QueueFull
from mesh.worker.types import EventKind, Subtask, Worker, WorkerEvent, WorkerResult

__all__ = ["ANSWER_ARTIFACT", "CoordinatorExecutor", "WorkerFactory"]

logger = logging.getLogger(__name__)

WorkerFactory = Callable[[], Worker]
ANSWER_ARTIFACT = "answer"
_TOOL_TEXT_MAX = 500
_FLUSH_CHARS = 4096


class _Run:
    """One execution's event writer. Once ``closed`` (the task was canceled), it writes
    nothing more, so no event can follow the terminal one. ``caller``: whose share of the
    gate's queue the task's subtasks take (the authenticated caller, "" without auth)."""

    def __init__(self, updater: TaskUpdater, caller: str = "") -> None:
        self.updater = updater
        self.caller = caller
        self.closed = False
        self.is_working = False

    def _message(self, text: str, metadata: dict[str, Any] | None = None) -> pb.Message:
        return self.updater.new_agent_message([pb.Part(text=text)], metadata=metadata)

    async def status(
        self, state: pb.TaskState, text: str, metadata: dict[str, Any] | None = None
    ) -> None:
        # Metadata rides on the status message: event metadata would be merged into the
        # task's own metadata by the SDK.
        if self.closed:
            return
        await self.updater.update_status(state, message=self._message(text, metadata))

    async def progress(self, text: str, metadata: dict[str, Any]) -> None:
        state = pb.TaskState.TASK_STATE_WORKING if self.is_working else (
            pb.TaskState.TASK_STATE_SUBMITTED
        )
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
        await self.run.artifact(
            [pb.Part(text=text)] if text else [],
            artifact_id=self.artifact_id,
            name=self.name,
            append=self.num_chunks > 0,
            last_chunk=last,
        )
        self.num_chunks += 1


class CoordinatorExecutor(AgentExecutor):
    """Runs each task's subtasks through the gate and the workers (see module docstring)."""

    def __init__(
        self,
        worker_factory: WorkerFactory,
        admission: Admission,
        *,
        max_subtasks: int = 32,
        text_flush_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        agent: Agent | None = None,
    ) -> None:
        self._agent = agent
        self._worker_factory = worker_factory
        self._admission = admission
        self._max_subtasks = max_subtasks
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
            await event_queue.enqueue_event(
                pb.Task(
                    id=task_id,
                    context_id=context_id,
                    status=pb.TaskStatus(state=pb.TaskState.TASK_STATE_SUBMITTED),
                    history=[message],
                )
            )
        caller = owner_of(context.call_context) if context.call_context is not None else ""
        run = _Run(TaskUpdater(event_queue, task_id, context_id), caller)
        self._runs[task_id] = run
        # The hop count travels on to any peer this task's workers delegate to.
        CURRENT_HOPS.set(hops_of(MessageToDict(message.metadata)))
        try:
            planned = self._planned(context, run, message, task_id, context_id)
            await (planned.run() if planned is not None else self._execute(run, message, task_id))
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

    def _planned(
        self, context: RequestContext, run: _Run, message: pb.Message, task_id: str,
        context_id: str,
    ) -> AgentTask | None:
        """The planned run of this message, or None when it is dispatched as before."""
        agent = self._agent
        if agent is None or agent.config.plan == "never":
            return None
        text = message_text(message)
        if text is None:
            return None  # explicit subtasks (or nothing to plan): no planning turn
        owner = run.caller

        def make_sink(artifact_id: str, name: str) -> _TextStream:
            return _TextStream(run, artifact_id=artifact_id, name=name,
                               flush_s=self._text_flush_s, clock=self._clock)

        return AgentTask(agent, run, self._admission, task_id, f"{owner}\x00{context_id}",
                         text, lambda s: self._run_one(run, s), make_sink, caller=owner)

    async def _execute(self, run: _Run, message: pb.Message, task_id: str) -> None:
        try:
            subtasks = subtasks_from_message(message, task_id, self._max_subtasks)
        except ValueError as e:
            await run.finish(pb.TaskState.TASK_STATE_REJECTED, f"rejected: {e}")
            return
        try:
            results = await self._run_all(run, subtasks)
        except QueueFull as e:
            await run.finish(
                pb.TaskState.TASK_STATE_REJECTED,
                f"rejected: over capacity ({e}); retry after {e.retry_after_s:.0f} s",
            )
            return
        except _SubtaskFailed as e:
            await run.finish(pb.TaskState.TASK_STATE_FAILED, str(e))
            return
        failed = [(s, r) for s, r in zip(subtasks, results, strict=True)
                  if isinstance(r, _SubtaskFailed)]
        if len(failed) == len(subtasks):
            await run.finish(pb.TaskState.TASK_STATE_FAILED,
                             "; ".join(str(r) for _, r in failed))
            return
        answers = [(local_id(s), r.answer) for s, r in zip(subtasks, results, strict=True)
                   if isinstance(r, WorkerResult)]
        summary = [
            {
                "id": local_id(s),
                "answer": r.answer,
                # camelCase, as every A2A 1.0 JSON key
                "numTurns": r.num_turns,
                "numGenerated": r.num_generated,
                "numToolCalls": r.num_tool_calls,
                "finishReason": r.finish_reason,
            } if isinstance(r, WorkerResult) else
            {"id": local_id(s), "answer": "", "finishReason": "failed", "error": str(r)}
            for s, r in zip(subtasks, results, strict=True)
        ]
        text = join_answers(answers)
        if failed:  # the same note a planned task's answer carries
            text += "\n\n" + missing_note(
                [Outcome(local_id(st), st.instructions, error=str(r)) for st, r in failed])
        data = pb.Part()
        data.data.struct_value.update({"subtasks": summary})
        await run.artifact(
            [pb.Part(text=text), data],
            artifact_id=ANSWER_ARTIFACT,
            name=ANSWER_ARTIFACT,
            last_chunk=True,
        )
        done = len(subtasks) - len(failed)
        await run.finish(
            pb.TaskState.TASK_STATE_COMPLETED,
            f"completed {len(subtasks)} subtask(s)" if not failed
            else f"completed {done} of {len(subtasks)} subtask(s); {len(failed)} failed",
        )

    async def _run_all(
        self, run: _Run, subtasks: list[Subtask]
    ) -> list[WorkerResult | _SubtaskFailed]:
        """Every subtask's result, or how its worker failed (a worker's failure is its own;
        its siblings go on). Anything else (the gate breaking, a full queue) cancels the
        rest and is raised."""
        if len(subtasks) == 1:
            return [await self._run_one(run, subtasks[0])]

        async def one(s: Subtask) -> WorkerResult | _SubtaskFailed:
            try:
                return await self._run_one(run, s)
            except _SubtaskFailed as e:
                return e

        try:
            async with asyncio.TaskGroup() as group:
                jobs = [group.create_task(one(s)) for s in subtasks]
        except BaseExceptionGroup as eg:
            for exc in eg.exceptions:
                if isinstance(exc, QueueFull):
                    raise exc from None
            raise
        return [job.result() for job in jobs]

    async def _run_one(self, run: _Run, subtask: Subtask) -> WorkerResult:
        sid = local_id(subtask)
        meta: dict[str, Any] = {"subtask": sid}

        async def on_position(position: int) -> None:
            if position > 0:
                await run.progress(
                    f"[{sid}] queued for the gate at position {position}",
                    {**meta, "event": "queued", "queue_position": position},
                )

        # The request passed check_queue at the door for all its subtasks (one place each,
        # in its caller's share): it queues, it is never rejected here.
        ticket = await self._admission.admit(subtask.id, on_position, accepted=True,
                                             caller=run.caller)
        try:
            run.is_working = True
            await run.status(
                pb.TaskState.TASK_STATE_WORKING,
                f"[{sid}] admitted; worker started",
                {**meta, "event": "admitted"},
            )
            stream = _TextStream(
                run,
                artifact_id=f"stream-{sid}",
                name=f"{sid} output",
                flush_s=self._text_flush_s,
                clock=self._clock,
            )

            async def emit(event: WorkerEvent) -> None:
                await self._translate(run, stream, sid, event)

            try:
                result = await self._worker_factory().run(subtask, emit)
            except (asyncio.CancelledError, QueueFull):
                raise
            except Exception as e:
                logger.info("subtask %s failed: %s", subtask.id, e, exc_info=True)
                reason = str(e) or type(e).__name__
                raise _SubtaskFailed(f"subtask {sid} failed: {reason}") from e
            await stream.flush(last=True)
            return result
        finally:
            await ticket.release()

    async def _translate(
        self, run: _Run, stream: _TextStream, sid: str, event: WorkerEvent
    ) -> None:
        if event.kind is EventKind.TEXT:
            await stream.add(event.text)
            return
        await stream.flush()
        text = event.text
        is_tool = event.kind in (EventKind.TOOL_CALL, EventKind.TOOL_RESULT)
        if is_tool and len(text) > _TOOL_TEXT_MAX:
            text = text[:_TOOL_TEXT_MAX] + f"... [{len(event.text)} chars]"
        label = {
            EventKind.TURN_STARTED: "",
            EventKind.TOOL_CALL: "tool call: ",
            EventKind.TOOL_RESULT: "tool result: ",
            EventKind.STATUS: "",
        }[event.kind]
        meta: dict[str, Any] = {"subtask": sid, "event": event.kind.value, "turn": event.turn}
        wait_s = event.data.get("wait_s")
        if isinstance(wait_s, int | float):  # the turn's wait for the decode gate
            meta["wait_s"] = float(wait_s)
        await run.status(pb.TaskState.TASK_STATE_WORKING, f"[{sid}] {label}{text}", meta)

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


class _SubtaskFailed(Exception):
    """A worker raised; the message is the reason the client sees."""
