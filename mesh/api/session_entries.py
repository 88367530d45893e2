"""The session API's records and answers that need no handler state: one session's
:class:`Entry` (its hold on the gate and the pool, its owner, its running turn), how a
session is described, and which HTTP error an engine error is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from mesh.api.session_wire import error_response
from mesh.engine.interface import (
    ContextOverflow,
    EngineError,
    Generation,
    Session,
    SessionFailed,
    SessionLoad,
)
from mesh.gate.queue import Hold

__all__ = ["Entry", "describe", "engine_error", "start_error"]


@dataclass
class Entry:
    """A session made here. ``hold`` owns its ticket and its pool session: closing it
    detaches the session and releases the ticket."""

    session: Session
    hold: Hold
    created_at: float
    owner: str = ""  # the authenticated caller that created it ("" without auth)
    generation: Generation | None = None
    iterator: AsyncIterator[Any] | None = None
    last_used: float = 0.0


def describe(sid: str, entry: Entry, load: SessionLoad | None, now: float) -> dict[str, Any]:
    """``GET /v1/sessions/{id}``'s body (``load``: the pool's row, None once detached)."""
    return {
        "id": sid,
        "context_len": entry.session.context_len,
        "state": load.state.value if load else "detached",
        "private_cells": load.private_cells if load else 0,
        "decode_tps": load.decode_tps if load else None,
        "num_generated": load.num_generated if load else 0,
        "age_s": now - entry.created_at,
        "idle_s": now - entry.last_used,
        "in_turn": entry.generation is not None,
    }


def engine_error(exc: EngineError) -> Response:
    """The answer to an engine error in a turn (the caller drops a failed session)."""
    if isinstance(exc, ContextOverflow):
        return error_response(422, "context_overflow", str(exc))
    if isinstance(exc, SessionFailed):
        return error_response(410, "session_failed", str(exc))
    return error_response(503, "engine_error", str(exc))


def start_error(exc: Exception) -> Response:
    """The answer to a turn the engine refused to start, other than an engine error."""
    if isinstance(exc, ValueError):
        return error_response(400, "empty_input", f"{exc} (send non-empty \"text\")")
    return error_response(
        409, "session_busy", f"{exc}; the previous turn is still stopping, retry shortly"
    )
