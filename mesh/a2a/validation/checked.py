"""What the guard checked of a message being sent, carried to the executor: parse once.

The guard (:mod:`.guard`) reads a send's body, checks it and leaves a
:class:`CheckedMessage` on the ASGI scope (:func:`put_checked`); the SDK's routes build
each call's ``ServerCallContext`` with :class:`CheckedContextBuilder`, which copies it into
the context's ``state``; the executor reads it back with :func:`checked_message`. So the
subtask list and the hops are read from the JSON once, at the door, and never re-derived
from the SDK's protobuf.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.routes import DefaultServerCallContextBuilder
from starlette.requests import Request
from starlette.types import Scope

from mesh.agent.subtasks import SubtaskSpec
from mesh.worker.types import NO_HOPS, Hops

__all__ = ["CheckedContextBuilder", "CheckedMessage", "checked_message", "put_checked"]

_KEY = "mesh.checked_message"  # on the ASGI scope and in the call context's state


@dataclass(frozen=True)
class CheckedMessage:
    """A sent message as the door checked it.

    ``subtasks``: its explicit subtask list (None: it has none, its text is planned or
    run as one subtask); ``text``: with a list, its text parts (each subtask's shared
    context), else its text parts and other data parts (as JSON) in part order;
    ``hops``: how far it was delegated (``metadata.meshHops``/``meshChain``);
    ``places``: the gate's queue places it asks for (one per listed subtask, else one).
    """

    text: str
    subtasks: tuple[SubtaskSpec, ...] | None = None
    hops: Hops = NO_HOPS

    @classmethod
    def of_parts(cls, pieces: list[tuple[str, Any]], subtasks: list[SubtaskSpec] | None,
                 hops: Hops) -> CheckedMessage:
        """From the message's ``pieces`` in part order: ``("text", str)`` or ``("data",
        value)`` (a data part that is not the subtask list)."""
        if subtasks is not None:
            lines = [v for k, v in pieces if k == "text" and v.strip()]
            return cls("\n".join(lines), tuple(subtasks), hops)
        lines = [v if k == "text" else json.dumps(v, sort_keys=True) for k, v in pieces
                 if k != "text" or v.strip()]
        return cls("\n".join(lines).strip(), None, hops)

    @property
    def places(self) -> int:
        return len(self.subtasks) if self.subtasks else 1


def put_checked(scope: Scope, checked: CheckedMessage) -> None:
    """Leave ``checked`` on the request's ``scope`` for :class:`CheckedContextBuilder`."""
    scope[_KEY] = checked


def checked_message(context: ServerCallContext | None) -> CheckedMessage | None:
    """What the guard checked of the message this call sends (None: it did not run)."""
    if context is None:
        return None
    checked = context.state.get(_KEY)
    return checked if isinstance(checked, CheckedMessage) else None


class CheckedContextBuilder(DefaultServerCallContextBuilder):
    """The SDK's call context, plus the :class:`CheckedMessage` the guard left on the
    scope. Give it to ``create_jsonrpc_routes`` and ``create_rest_routes``
    (``context_builder=``); the 0.3 adapters wrap it."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        checked = request.scope.get(_KEY)
        if checked is not None:
            context.state[_KEY] = checked
        return context
