"""What a task says while it runs, as the agent sees it: the event writer's seam.

The A2A executor (:mod:`mesh.a2a.executor`) implements :class:`TaskEvents` over the SDK's
event queue (status updates, artifacts, the terminal state); the agent (:mod:`.task`,
:mod:`.fanout`) only calls it. The artifact names are the task's public surface.
"""

from __future__ import annotations

from typing import Any, Protocol

from a2a.types import a2a_pb2 as pb

from mesh.worker.types import WorkerEvent

__all__ = ["ANSWER_ARTIFACT", "PLAN_ARTIFACT", "TaskEvents", "TextSink"]

#: The artifact holding a task's answer: its text, then a data part ``{"plan": ...,
#: "subtasks": [...]}`` (:func:`mesh.agent.synthesis.summary`). Peers and nodes read it.
ANSWER_ARTIFACT = "answer"
#: The artifact holding a planned task's plan (a data part, :meth:`Plan.to_dict`).
PLAN_ARTIFACT = "plan"


class TextSink(Protocol):
    """Generated text streamed as chunks of one artifact."""

    async def add(self, text: str) -> None: ...

    async def flush(self, now: float | None = None, *, last: bool = False) -> None: ...


class TaskEvents(Protocol):
    """The executor's event writer, as the agent uses it. Once the task reached a
    terminal state (``finish``, or a cancel) every call is a no-op."""

    async def status(
        self, state: pb.TaskState, text: str, metadata: dict[str, Any] | None = None
    ) -> None: ...

    async def progress(self, text: str, metadata: dict[str, Any]) -> None:
        """A status line in the task's current state (submitted while nothing ran yet)."""

    async def artifact(self, parts: list[pb.Part], **kwargs: Any) -> None: ...

    async def finish(self, state: pb.TaskState, text: str) -> None: ...

    def stream(self, artifact_id: str, name: str) -> TextSink:
        """A sink streaming text as chunks of the artifact ``artifact_id``."""
        ...

    async def worker_event(self, sink: TextSink, sid: str, event: WorkerEvent) -> None:
        """What subtask ``sid``'s worker reported: text to ``sink``, the rest as status."""
