"""One turn streamed from a pool session, and the bookkeeping of a subtask's turns.

Shared by the workers (:mod:`mesh.worker.loop`, :mod:`mesh.worker.simulated`) and the
agent's planning and synthesis turns: :func:`stream_turn` generates one turn and emits
its pieces (stopping the generation on any early exit), :func:`release` detaches a
session even under cancellation, :func:`closed_text` is a turn's text as the session's
context holds it, :class:`Tally` counts a subtask's turns into its
:class:`~mesh.worker.types.WorkerResult`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import anyio

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Session
from mesh.engine.interface import TurnResult as EngineTurn
from mesh.worker.text import LoopGuard
from mesh.worker.types import Emit, EventKind, WorkerEvent, WorkerResult

__all__ = ["Tally", "WorkerFailed", "closed_text", "release", "stream_turn"]


class WorkerFailed(Exception):
    """The subtask failed; the message is the reason shown to the client."""


async def stream_turn(
    session: Session, params: SamplingParams, emit: Emit, turn: int, *,
    loop_stop: bool = False,
) -> EngineTurn:
    """Generate one turn, emitting each piece; on any early exit, stop the generation.

    With ``loop_stop`` (answers and syntheses; never a scenario's turn, whose length is
    the load it simulates) a turn that repeats a phrase
    (:class:`~mesh.worker.text.LoopGuard`) is stopped there: its result is the text before
    the repeat, with finish reason ``loop`` (a finished turn).
    """
    generation = session.generate(params)
    pieces = generation.__aiter__()
    guard = LoopGuard() if loop_stop else None
    generated = 0
    finished = False
    try:
        async for piece in pieces:
            generated += piece.token >= 0
            if piece.paused_s:  # the decode gate paused the turn: waiting, not decoding
                await emit(WorkerEvent(
                    EventKind.STATUS,
                    f"paused {piece.paused_s:.2f} s by the decode gate to keep the floor",
                    turn, {"paused_s": round(piece.paused_s, 4)}))
            if piece.text:
                await emit(WorkerEvent(EventKind.TEXT, piece.text, turn))
                if guard is not None and guard.feed(piece.text) is not None:
                    break
        else:
            finished = True
    finally:
        if not finished:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await generation.aclose()
                close = getattr(pieces, "aclose", None)
                if close is not None:
                    await close()
    if guard is not None and guard.cut is not None:
        return EngineTurn(text=guard.text[:guard.cut].rstrip(), num_prompt_tokens=0,
                          num_generated=generated, finish_reason="loop", decode_s=0.0)
    if generation.result is None:
        raise WorkerFailed(f"the engine ended turn {turn} without a result")
    return generation.result


async def release(session: Session) -> None:
    """Detach ``session`` even while the caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        await session.detach()


def closed_text(result: EngineTurn, stops: tuple[str, ...]) -> str:
    """The turn's text with its matched stop string, as the session's context holds it.

    The engine names the stop and leaves all of it out of ``text``; an engine that reports
    no name may have left the stop's first pieces in: those are completed instead.
    """
    if result.stop is not None:
        return result.text + result.stop
    if result.finish_reason == "stop":
        for stop in stops:
            for k in range(len(stop), 0, -1):
                if result.text.endswith(stop[:k]):
                    return result.text[: len(result.text) - k] + stop
    return result.text



@dataclass
class Tally:
    """What a subtask's turns produced so far; :meth:`result` is the worker's result."""

    session_id: str
    turns: int = 0
    generated: int = 0
    tool_calls: int = 0
    parse_errors: int = 0
    repeated_calls: int = 0
    last_text: str = ""
    finishes: list[str] = field(default_factory=list)

    def result(self, answer: str, finish: str, **extra: Any) -> WorkerResult:
        return WorkerResult(
            answer=answer,
            num_turns=self.turns,
            num_generated=self.generated,
            num_tool_calls=self.tool_calls,
            finish_reason=finish,
            data={
                "session_id": self.session_id,
                "parse_errors": self.parse_errors,
                "repeated_calls": self.repeated_calls,
                "turn_finishes": list(self.finishes),
                **extra,
            },
        )
