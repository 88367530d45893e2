"""The worker seam: what the coordinator asks of a worker, and what a worker reports.

A :class:`Worker` runs one subtask to the end. The coordinator calls ``run`` once the gate
has admitted the subtask; the worker reports progress through ``emit`` and returns a
:class:`WorkerResult`. Contract:

* ``run`` always returns or raises; an exception means the subtask failed, and its message
  is the reason shown to the client. The worker detaches its pool session in every case
  (success, failure, cancellation).
* Cancellation arrives as ``anyio``/``asyncio`` cancellation of ``run``; the worker must
  free its session and re-raise.
* ``emit`` may be awaited often (once per generated piece); it never raises on purpose.

A worker may be local (a pool session, :mod:`mesh.worker.loop`) or remote (another A2A
agent); the coordinator does not know which.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["NO_HOPS", "EventKind", "Hops", "Subtask", "Worker", "WorkerEvent", "WorkerResult"]


@dataclass(frozen=True)
class Hops:
    """How far the task a subtask belongs to was delegated to get here: ``count`` hops so
    far and the ``chain`` of agents it went through (A2A metadata ``meshHops`` and
    ``meshChain``, checked at the door). A worker that delegates on sends :meth:`onward`."""

    count: int = 0
    chain: tuple[str, ...] = ()

    def onward(self, origin: str) -> Hops:
        """The hops a message this agent (``origin``) sends on carries."""
        return Hops(self.count + 1, (*self.chain, origin))


NO_HOPS = Hops()  #: a message sent here first (no delegation yet)


@dataclass(frozen=True)
class Subtask:
    """One unit of delegated work. ``params`` carries scenario knobs (steps, seeds...);
    ``hops``: of the incoming message, passed on to any peer or node the worker asks."""

    id: str
    instructions: str
    params: Mapping[str, Any] = field(default_factory=dict)
    hops: Hops = NO_HOPS
    # Completion order: the task's start time (time.monotonic()); every turn the worker
    # asks for carries it (SamplingParams.priority). None: the session's attach time.
    priority: float | None = None


class EventKind(enum.StrEnum):
    TURN_STARTED = "turn_started"  # text: "turn N"
    TEXT = "text"  # a generated piece, to stream as an artifact chunk
    TOOL_CALL = "tool_call"  # text: the call as parsed, e.g. 'read_file(path="x")'
    TOOL_RESULT = "tool_result"  # text: the (possibly truncated) tool output
    STATUS = "status"  # free-form progress line


@dataclass(frozen=True)
class WorkerEvent:
    kind: EventKind
    text: str
    turn: int = 0
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerResult:
    """The final answer and what it cost."""

    answer: str
    num_turns: int
    num_generated: int
    num_tool_calls: int
    finish_reason: str  # "answer" | "max_turns" | "max_tokens"
    data: Mapping[str, Any] = field(default_factory=dict)


Emit = Callable[[WorkerEvent], Awaitable[None]]


class Worker(Protocol):
    async def run(self, subtask: Subtask, emit: Emit) -> WorkerResult: ...
